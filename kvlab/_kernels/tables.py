"""Device tables of a codec, built once per codec and device, and the device facts the launchers read.

``cached(codec, key, source, build)`` keeps ``build(source)`` per codec (weakly: it goes with the codec)
while ``source``, a codec attribute, stays the same object, so a codec whose tensors are replaced gets new
tables. Every launcher (MSE store and load, the decode loops) takes its tables through it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref

import torch

from ..layout import code_order

__all__ = ["TABLES", "byte_planes", "cached", "centroids", "codebook", "interpreted", "interpreter_runs_ptx", "on_device",
           "prmt_tables", "signed32", "sm_count", "tile_order"]


TABLES = weakref.WeakKeyDictionary()  # codec -> {(name, device, ...): (source tensor, table)}


def cached(codec, key, source, build):
    """``build(source)``, cached per codec while ``source`` (a codec attribute) stays the same object."""
    try:
        per_codec = TABLES.setdefault(codec, {})
    except TypeError:  # not weak-referenceable: build every call
        per_codec = {}
    hit = per_codec.get(key)
    if hit is not None and hit[0] is source:
        return hit[1]
    table = build(source)
    per_codec[key] = (source, table)
    return table


def codebook(centroids: torch.Tensor, bits: int) -> torch.Tensor:
    """The centroid of each code (``centroids`` ascending; ``kvlab.layout.code_order``)."""
    return centroids[code_order(bits).to(centroids.device)]


def centroids(codec, device):
    """The codebook (the centroid of each code) as float32 on ``device``."""
    return cached(codec, ("centroids", device), codec.centroids,
                   lambda c: codebook(c, codec.bits).to(device=device, dtype=torch.float32).contiguous())


def tile_order(bits: int, dim: int) -> torch.Tensor:
    """int64 ``[dim]``: the coordinate held by each position of an MSE tile of ``bits``-bit codes."""
    p = torch.arange(dim)
    if bits == 2:
        return (p // 16) * 16 + (p % 8) // 2 + 4 * (p % 2) + 8 * ((p % 16) // 8)
    return p


def signed32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


def byte_planes(c16: list[int]) -> tuple[int, int, int, int]:
    """fp16 bit patterns of up to 8 entries -> (low bytes 0-3, low bytes 4-7, high bytes 0-3, high bytes 4-7)."""
    c16 = c16 + [0] * (8 - len(c16))
    lo = [v & 0xFF for v in c16]
    hi = [v >> 8 for v in c16]
    word = lambda b: signed32(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24)  # noqa: E731
    return word(lo[:4]), word(lo[4:]), word(hi[:4]), word(hi[4:])


def prmt_tables(codec):
    """The four int32 table registers of the fast lookup, or None when the fp16 codebook does not fit it."""
    def build(centroids):
        c = codebook(centroids.detach().to("cpu", torch.float32).to(torch.float16), codec.bits)
        bits16 = [int(v) & 0xFFFF for v in c.view(torch.int16)]
        if codec.bits == 4:  # the magnitudes, codes 0-7; needs a symmetric codebook (codes 8-15: their negatives)
            if not (torch.equal(c[8:], -c[:8]) and bool((c[:8] > 0).all())):
                return None
            return byte_planes(bits16[:8])
        if codec.bits == 3:
            return byte_planes(bits16)
        return (signed32(bits16[0] | bits16[1] << 16), signed32(bits16[2] | bits16[3] << 16), 0, 0)

    return cached(codec, ("prmt",), codec.centroids, build)


def interpreter_runs_ptx() -> bool:
    """Whether Triton's interpreter has been given a way to run inline PTX (kvlab's tests install an
    emulator of the few instructions the fast path uses, ``tests/ptx.py``)."""
    from triton.runtime import interpreter

    return getattr(interpreter.InterpreterBuilder.create_inline_asm, "emulates_ptx", False)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere: the interpreter runs programs one by one)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def compiled(device) -> bool:
    """Whether kernels on ``device`` run compiled for a CUDA GPU (else Triton's interpreter runs them). Every
    choice of a GPU-only path (Gluon kernels, inline PTX, tile sizes and register caps) asks this."""
    return torch.device(device).type == "cuda" and not interpreted()


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability ``(major, minor)`` of a CUDA device."""
    return torch.cuda.get_device_capability(device)


def on_device(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

