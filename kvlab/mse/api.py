"""The MSE codec in the paged KV cache: ``store_mse`` and ``load_mse`` check their inputs, then launch the
kernels of ``triton_store`` / ``triton_load`` (every device; the CPU through Triton's interpreter) or, on a CUDA
GPU where the support matrix (``kvlab.layout``) allows, those of ``gluon_store`` / ``gluon_load``.

Layout (``kvlab.layout``)
    cache: uint8 ``[num_blocks, block_size, num_heads, slot_bytes]``, one slot of one head is
    ``key indices | key norm (fp16 LE) | value indices | value norm (fp16 LE)``. Token ``i`` goes to
    slot ``slot_mapping[i] = block * block_size + offset``; ``-1`` is padding (not written; read as
    zeros). Indices form a little-endian bit stream, element ``j`` at bit ``bits * j``. Kernels are
    compiled per ``num_heads`` and ``block_size`` (the row and slot divisions become multiplies).

Reference
    ``kvlab.mse.reference.MSECodec.encode`` / ``decode`` with ``store_slots`` / ``load_slots``. This module
    does not import it; ``tests/ops/test_mse.py`` compares the two (``torch.equal`` on the cache).

Checks
    With ``check=True`` (the default) the launchers also check values, which costs one host sync per
    call: slot numbers in range (before the launch) and, for ``store_mse``, NaN/Inf inputs and stored
    norms outside fp16's normal range, above 65504 or nonzero below 6.1e-05 (the kernel writes each
    row's norm, the launcher checks them after the launch and, if one is bad, puts the call's slots back
    as they were before raising). ``store_mse`` records the key and value codecs that wrote the cache
    and a checked ``load_mse`` refuses a codec of another identity (``kvlab._checks.check_reader``).
    ``check=False`` skips every value check and never syncs; the kernels still skip out-of-range slots
    instead of writing outside the cache.
"""

from __future__ import annotations

import math

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import _checks as C
from .._kernels import tables as T
from .._kernels.tables import tile_order
from ..params import MSEParams
from ..launch import CodecLaunch, launch_settings
from ..layout import MSE_BITS, NORM_BYTES, MSESlot, packed_bytes
from .triton_load import load_mse_kernel
from .triton_store import store_mse_kernel

__all__ = ["load_mse", "store_mse"]

GROUP = 8  # indices per group: 8 indices of `bits` bits are exactly `bits` bytes
STORE_PIECE = 128  # columns of a row one store thread holds (registers); longer rows are split
# at most 168 registers a thread for the 3- and 4-bit stores (else 173 and 178): 3 programs of 4 warps an SM
# instead of 2, for a few spilled bytes; 1.08x (3 bits) and 1.04x (4 bits) faster on an H200
# (results/codec_ab_store_maxnreg.json); the 2-bit store needs 166 and is slower capped
STORE_MAXNREG = {3: 168, 4: 168}
LOAD_TILE_ELEMENTS = 2048  # default BLOCK_ROWS * BLOCK_D of a load program (16 rows of 128)
LOAD_NUM_WARPS = {2: 2, 3: 1, 4: 1}  # default warps of a load program, by bits
# model-space load: rows per tile (a tensor-core tile of y R^T), warps, persistent programs per SM, one
# stage (the loop prefetches its next tile by hand; Triton's pipelining stages loads through shared
# memory) and at most 128 registers a thread (4 programs an SM); the fastest on an H200
MODEL_TILE_ROWS, MODEL_NUM_WARPS, MODEL_PROGRAMS_PER_SM = 64, 4, 4
MODEL_OPTIONS = dict(num_stages=1, maxnreg=128)
# Where the support matrix allows, at the default launch: the Hadamard store on a CUDA GPU runs the Gluon kernel of
# gluon_store (a row on 4 threads), the model-space load on Hopper that of gluon_load, and the Triton model-space
# load writes each tile by a bulk (TMA) store from shared memory (Hopper and later): each measured faster on an H200.


# ----------------------------------------------------------------------------- launchers


def _rotation(codec, device):
    """The dense rotation ``R`` (float32) on ``device``."""
    return T.cached(codec, ("rotation", device), codec.rotation,
                   lambda r: r.to(device=device, dtype=torch.float32).contiguous())


def _rotation_t16(codec, device, order: bool = False):
    """``R^T`` in fp16, zero-padded to the load tile's width (``8 * _block_g(dim)``), on ``device``;
    ``order``: its rows in the tile order of the prmt lookup (``tile_order``), as the fast tile holds them."""
    def build(r):
        width = 8 * _block_g(codec.dim)
        rt = torch.zeros(width, width, dtype=torch.float16)
        rt[: codec.dim, : codec.dim] = r.detach().to("cpu", torch.float32).T.to(torch.float16)
        if order:
            rt = rt[tile_order(codec.bits, width)]
        return rt.to(device).contiguous()

    return T.cached(codec, ("rotation_t16", device, order), codec.rotation, build)


def _square_tuple(bits: int) -> int:
    """Indices per entry of the store's squares table (``_square_sums``)."""
    return 1 if bits == 4 else 2  # tables of 16, 64 and 16 entries: at most 512 bytes, mostly one cache line


def _square_sums(codec, device):
    """The store's table for ``|c|^2`` (float64): sums of the squares of the centroids of ``E =
    _square_tuple(bits)`` consecutive codes, added in order in float64 (each square is exact).

    Entry ``t < 2**(E bits)`` is the sum for the ``E`` codes that ``t`` packs (code ``i`` in bits
    ``[bits i, bits i + bits)``); then, for tuples that are partly padding, the sums of the first
    ``r`` of them for ``r = 1 .. E - 1``, each section ``2**(r bits)`` entries long.
    """
    def build(centroids):
        c = T.codebook(centroids.detach().to("cpu", torch.float64), codec.bits)
        levels, bits = c.numel(), codec.bits
        sections = []
        for r in [_square_tuple(bits)] + list(range(1, _square_tuple(bits))):
            t = torch.arange(levels**r)
            acc = torch.zeros(levels**r, dtype=torch.float64)
            for i in range(r):
                acc = acc + c[(t >> (bits * i)) & (levels - 1)] ** 2
            sections.append(acc)
        return torch.cat(sections).to(device)

    return T.cached(codec, ("square_sums", device, _square_tuple(codec.bits)), codec.centroids, build)


def _midpoints(codec, device, name: str = "codec"):
    """``(mid, tie)`` on ``device`` for the store's division-free compare (see ``_thresholds``), for
    the boundaries the odd quantizer compares with: the middle one (zero), then the positive ones.

    ``mid[i]`` (float64) is the midpoint between boundary ``i`` (float32) and the next float32 up;
    ``tie[i]`` (int32) is 1 where a value exactly at the midpoint rounds up (to the even neighbour).
    """
    def build(boundaries):
        b = boundaries.detach().to("cpu", torch.float32)
        if not bool(torch.isfinite(b).all()) or bool((b[1:] <= b[:-1]).any()):
            raise ValueError(f"{name}.boundaries must be finite and strictly ascending")
        if b.numel() != (1 << codec.bits) - 1 or not torch.equal(b, -b.flip(0)):
            raise ValueError(f"{name}.boundaries must be 2**bits - 1 = {(1 << codec.bits) - 1} values, antisymmetric "
                             f"(b[i] == -b[-1 - i], the middle one 0), got {b.tolist()}")
        b = b[(1 << (codec.bits - 1)) - 1:]  # 0, then the positive ones
        up = torch.nextafter(b, torch.tensor(float("inf")))
        mid = (b.double() + up.double()) / 2  # exact: a 25-bit significand
        tie = ((up.view(torch.int32) & 1) == 0).to(torch.int32)  # round half to even
        return mid.to(device), tie.to(device)

    return T.cached(codec, ("midpoints", device), codec.boundaries, build)


def _hadamard_signs(codec):
    """``codec.hadamard_signs`` when the codec has a Hadamard rotation the store can fuse, else None."""
    signs = getattr(codec, "hadamard_signs", None)
    if signs is None:
        return None
    dim = codec.dim
    C.check_tensor("codec.hadamard_signs", signs, C.FLOAT_DTYPES)
    if dim & (dim - 1) or tuple(signs.shape) != (dim,):
        raise ValueError(f"hadamard_signs must have shape ({dim},) for a power-of-two dim, got {tuple(signs.shape)} (dim {dim})")
    return signs


def _sign_bits(codec, device, dtype):
    """The sign bit of each of the codec's Hadamard signs, as an int16/int32 [dim] mask for ``dtype`` inputs."""
    def build(signs):
        s = signs.detach().to("cpu", torch.float64)
        if not bool(((s == 1) | (s == -1)).all()):
            raise ValueError("hadamard_signs must hold only +1 and -1")
        if dtype == torch.float32:
            return torch.where(s < 0, -(2**31), 0).to(torch.int32).to(device)
        return torch.where(s < 0, -(2**15), 0).to(torch.int16).to(device)

    return T.cached(codec, ("sign_bits", device, dtype.itemsize), codec.hadamard_signs, build)


def _hadamard_scale(codec) -> float:
    scale = getattr(codec, "hadamard_scale", None)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise TypeError(f"hadamard_scale must be a positive float (1/sqrt(dim)), got {scale!r}")
    return float(scale)


def _alignment(cache, offset: int) -> int:
    """The largest of 1, 2, 4 dividing the address of every slot's byte ``offset`` in ``cache``."""
    g = cache.data_ptr() + offset
    for s in cache.stride()[:3]:
        g = math.gcd(g, s)
    return 4 if g % 4 == 0 else 2 if g % 2 == 0 else 1


def _model_lookup_tables(cache, codec, offset: int):
    """The ``prmt`` table registers of a model-space load of the codes at byte ``offset`` of the slots
    (``_prmt_tables``), or None where the lookup cannot run: a dim other than 32, 64 or 128, a 4-bit
    codebook that is not symmetric, or codes not all 4-byte aligned or all 2 bytes past a word boundary."""
    if codec.dim not in (32, 64, 128) or _word_phase(cache, offset) is None:
        return None
    return T.prmt_tables(codec)


def _store_compiled_options(bits: int, num_warps: int, dim: int, piece: int = STORE_PIECE) -> dict:
    """Launch options of a compiled store: the register cap of ``STORE_MAXNREG`` where it was measured
    (4 warps, a row of 65 to 128 columns in one thread's registers), else none."""
    cap = STORE_MAXNREG.get(bits)
    return {"maxnreg": cap} if cap and num_warps == 4 and _store_block_d(dim) == 128 and piece == 128 else {}


def _model_options() -> dict:
    """Launch options of the model-space load (``maxnreg`` only when compiled)."""
    return {k: v for k, v in MODEL_OPTIONS.items() if k != "maxnreg" or not T.interpreted()}


def _word_phase(cache, offset: int) -> int | None:
    """Bytes past a 4-byte boundary at which every slot's byte ``offset`` in ``cache`` sits (0 or 2), or
    None when that varies between slots or is odd."""
    if any(s % 4 for s in cache.stride()[:3]):
        return None
    phase = (cache.data_ptr() + offset) % 4
    return phase if phase in (0, 2) else None


def _store_head(cache, offset: int, code_bytes: int) -> int:
    """Bytes from every code of this part to its first 4-byte aligned address.

    -1 (store bytes) when that varies between slots or leaves no whole 4-byte word.
    """
    head = -(cache.data_ptr() + offset) % 4
    if any(s % 4 for s in cache.stride()[:3]) or code_bytes - head < 4:
        return -1
    return head


def _store_block_d(dim: int) -> int:
    return max(16, C.next_power_of_2(dim))


def check_codec(name: str, codec) -> None:
    if not isinstance(codec, MSEParams):
        raise TypeError(f"{name} must be an MSE codec (kvlab.MSECodec), got {type(codec).__name__}")
    C.check_int(f"{name}.bits", codec.bits, MSE_BITS)
    C.check_int(f"{name}.dim", codec.dim, minimum=3)
    dim, levels = codec.dim, 1 << codec.bits
    for attr, shape in (("rotation", (dim, dim)), ("boundaries", (levels - 1,)), ("centroids", (levels,))):
        t = getattr(codec, attr)
        C.check_tensor(f"{name}.{attr}", t, C.FLOAT_DTYPES)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}.{attr} must have shape {shape} for dim={dim}, bits={codec.bits}, got {tuple(t.shape)}")


def _check_cache(cache) -> None:
    C.check_tensor("cache", cache, (torch.uint8,))
    if cache.dim() != 4:
        raise ValueError(f"cache must have shape [num_blocks, block_size, num_heads, slot_bytes], got {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError(f"cache must be contiguous in its last (byte) dimension, got strides {cache.stride()}")


def _block_g(dim: int) -> int:
    return C.next_power_of_2(C.cdiv(dim, GROUP))


def _default_block_rows(dim: int) -> int:
    return max(1, min(256, LOAD_TILE_ELEMENTS // (GROUP * _block_g(dim))))


def store_mse(
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: torch.Tensor,
    key_codec,
    value_codec,
    *,
    check: bool = True,
    launch: CodecLaunch | None = None,
) -> None:
    """Encode ``key`` and ``value`` ``[num_tokens, num_heads, dim]`` into ``cache`` (in place).

    ``cache`` is uint8 ``[num_blocks, block_size, num_heads, MSESlot(dim, key_bits, value_bits).slot_bytes]``
    (contiguous in its last dimension; other strides are free); token ``i`` goes to slot
    ``slot_mapping[i]``, ``-1`` skips it. The bytes equal ``store_slots(cache, slot_mapping,
    key_codec.encode(key), value_codec.encode(value), layout)``.

    ``check=True`` (default) also checks values, with one host sync: slots in ``[-1, num_slots)``,
    and no NaN/Inf, norm above 65504 or nonzero norm below 6.1e-05 in the written rows of
    ``key``/``value`` (ValueError, raised after the launch, once the call's slots are put back as they
    were). Rows with slot -1 are not checked.
    ``check=False`` skips those checks and never syncs; out-of-range slots are then skipped silently.

    Hadamard codecs (``codec.hadamard_signs`` set) are rotated inside the kernel, from the input
    rows; Haar codecs by a float32 torch GEMM first (see the module docstring). ``launch``
    (``kvlab.CodecLaunch``: ``num_warps``, default 4, ``block_rows`` and ``piece``) tunes the launch: a
    thread holds ``piece`` columns of a row (16, 32, 64 or 128; default 128: a whole row of up to 128
    columns), a row's pieces sit on neighbouring lanes and its last butterfly stages pair them, so
    ``block_rows = 32 * num_warps / pieces`` (the default) is the natural tile: fewer rows leave threads
    computing copies, more rows put several rows in a thread's registers (spills). The bytes do not
    depend on the tiling.
    """
    check_codec("key_codec", key_codec)
    check_codec("value_codec", value_codec)
    C.check_tensor("key", key, C.FLOAT_DTYPES)
    C.check_tensor("value", value, C.FLOAT_DTYPES)
    if key.dim() != 3:
        raise ValueError(f"key must have shape [num_tokens, num_heads, dim], got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value must have the shape of key {tuple(key.shape)}, got {tuple(value.shape)}")
    num_tokens, num_heads, dim = key.shape
    for name, codec in (("key_codec", key_codec), ("value_codec", value_codec)):
        if codec.dim != dim:
            raise ValueError(f"{name}.dim ({codec.dim}) must equal key's last dimension ({dim})")
    _check_cache(cache)
    layout = MSESlot(dim, key_codec.bits, value_codec.bits)
    num_blocks, block_size, cache_heads, slot_bytes = cache.shape
    if (cache_heads, slot_bytes) != (num_heads, layout.slot_bytes):
        raise ValueError(
            f"cache must have shape [num_blocks, block_size, {num_heads}, {layout.slot_bytes}] for {layout}, "
            f"got {tuple(cache.shape)}"
        )
    C.check_tensor("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    C.check_same_device(cache=cache, key=key, value=value, slot_mapping=slot_mapping)
    C.check_kernel_device("cache", cache)
    C.check_bool("check", check)
    num_slots = num_blocks * block_size
    C.check_slot_mapping(slot_mapping, num_tokens, num_slots, cache.device, values=check)
    block_rows, num_warps, piece = launch_settings(launch, "store_mse", ("block_rows", "num_warps", "piece"))
    num_warps = 4 if num_warps is None else num_warps
    piece = STORE_PIECE if piece is None else piece
    default_tiling = block_rows is None and num_warps == 4 and piece == STORE_PIECE
    pieces = max(1, _store_block_d(dim) // piece)  # threads per row
    block_rows = 32 * num_warps // pieces if block_rows is None else block_rows  # default: a piece per thread
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return

    device = cache.device
    parts = []
    for name, x, codec, offset, index_bytes in (("key_codec", key, key_codec, 0, layout.key_bytes),
                                                ("value_codec", value, value_codec, layout.value_offset, layout.value_bytes)):
        signs = _hadamard_signs(codec)
        if signs is not None:  # fused: the kernel rotates the input rows itself
            rows = x.reshape(num_rows, dim)
            rows = rows if rows.stride(1) == 1 else rows.contiguous()
            sign_bits = _sign_bits(codec, device, rows.dtype)
            scale = _hadamard_scale(codec)
        else:  # the reference's rotation, as one GEMM per tensor: [num_rows, dim] fp32, contiguous
            rows = x.reshape(num_rows, dim).float() @ _rotation(codec, device)
            sign_bits, scale = rows, 1.0  # unused
        mid, tie = _midpoints(codec, device, name)
        parts.append(dict(rows=rows, signs=sign_bits, mid=mid, tie=tie, scale=scale, hadamard=signs is not None,
                          squares=_square_sums(codec, device),
                          head=_store_head(cache, offset, index_bytes + NORM_BYTES)))
    # check: every written row's norm (rows not written stay 0); else a placeholder, never accessed
    norms = torch.zeros(2, num_rows if check else 1, dtype=torch.float32, device=device)
    saved = _save_slots(cache, slot_mapping) if check else None  # a failing checked call puts them back
    specs = _store_specs(parts, (key_codec, value_codec), layout, slot_mapping, cache, norms, num_rows, dim,
                         block_rows, pieces, num_warps, piece, check, default_tiling)
    with T.on_device(device):
        for fn, grid, args, options in specs:
            fn[grid](**args, **options)
    if check:
        try:
            for name, part_norms in (("key", norms[0]), ("value", norms[1])):
                C.check_fp16_scales(name, part_norms)
        except ValueError:
            _restore_slots(cache, saved)
            raise
    C.record_writer(cache, key_codec, value_codec)


class MSEStoreStep:
    """``store_mse(key, value, slot_mapping, cache, key_codec, value_codec, check=False)`` repeated on inputs of
    one shape, dtype and layout (a decode step: one token per sequence): the checks, device tables and launch
    arguments are prepared once, and each call replays the two launches (``kvlab._kernels.replay.Launch``) with the new
    rows and slots. The bytes are ``store_mse``'s. Inputs of another shape or layout go through ``store_mse``."""

    def __init__(self, key, value, slot_mapping, cache, key_codec, value_codec):
        store_mse(key, value, slot_mapping, cache, key_codec, value_codec, check=False)  # checks shapes; compiles
        from .._kernels.replay import Launch

        self.cache, self.codecs = cache, (key_codec, value_codec)
        self.shape, self.dtype = tuple(key.shape), key.dtype
        num_tokens, num_heads, dim = key.shape
        self.num_rows, self.dim = num_tokens * num_heads, dim
        layout = MSESlot(dim, key_codec.bits, value_codec.bits)
        pieces = max(1, _store_block_d(dim) // STORE_PIECE)
        parts = []
        for name, x, codec, offset, index_bytes in (("key_codec", key, key_codec, 0, layout.key_bytes),
                                                    ("value_codec", value, value_codec, layout.value_offset,
                                                     layout.value_bytes)):
            hadamard = _hadamard_signs(codec) is not None
            rows = self._rows(x, codec, hadamard)
            mid, tie = _midpoints(codec, cache.device, name)
            parts.append(dict(rows=rows, signs=_sign_bits(codec, cache.device, rows.dtype) if hadamard else rows,
                              mid=mid, tie=tie, scale=_hadamard_scale(codec) if hadamard else 1.0, hadamard=hadamard,
                              squares=_square_sums(codec, cache.device),
                              head=_store_head(cache, offset, index_bytes + NORM_BYTES)))
        self.hadamard = (parts[0]["hadamard"], parts[1]["hadamard"])
        self.stride = (parts[0]["rows"].stride(0), parts[1]["rows"].stride(0), slot_mapping.stride(0))
        norms = torch.zeros(2, 1, dtype=torch.float32, device=cache.device)
        specs = _store_specs(parts, self.codecs, layout, slot_mapping, cache, norms, self.num_rows, dim,
                             32 * 4 // pieces, pieces, 4, STORE_PIECE, False, True)
        self.launches = [Launch(fn, grid, args, options, variable=("x_ptr", "slot_ptr"))
                         for fn, grid, args, options in specs]

    def _rows(self, x, codec, hadamard: bool):
        if hadamard:
            return x.reshape(self.num_rows, self.dim)
        return x.reshape(self.num_rows, self.dim).float() @ _rotation(codec, x.device)

    def __call__(self, key, value, slot_mapping) -> None:
        rows = [self._rows(x, codec, h) for x, codec, h in zip((key, value), self.codecs, self.hadamard)]
        if (tuple(key.shape) != self.shape or value.shape != key.shape or key.dtype != self.dtype
                or value.dtype != self.dtype or (rows[0].stride(0), rows[1].stride(0), slot_mapping.stride(0)) != self.stride
                or rows[0].stride(1) != 1 or rows[1].stride(1) != 1):
            store_mse(key, value, slot_mapping, self.cache, *self.codecs, check=False)
            return
        with T.on_device(self.cache.device):
            for launch, x in zip(self.launches, rows):
                launch(x_ptr=x, slot_ptr=slot_mapping)


def _store_specs(parts, codecs, layout, slot_mapping, cache, norms, num_rows: int, dim: int, block_rows: int,
                 pieces: int, num_warps: int, piece: int, check: bool, default_tiling: bool) -> list:
    """The launches of ``store_mse`` (keys, then values) as ``(kernel, grid, arguments by name, options)``."""
    num_blocks, block_size, num_heads, _ = cache.shape
    num_slots = num_blocks * block_size
    device = cache.device
    gluon = T.compiled(device) and default_tiling
    specs = []
    for p, codec, offset, index_bytes, part_norms in (
        (parts[0], codecs[0], 0, layout.key_bytes, norms[0]),
        (parts[1], codecs[1], layout.value_offset, layout.value_bytes, norms[1]),
    ):
        if gluon and p["hadamard"]:
            from . import gluon_store

            if gluon_store.supports(dim, p["head"]):
                specs.append(gluon_store.spec(
                    (p["rows"], p["signs"], p["mid"], p["tie"], p["squares"], slot_mapping, cache, part_norms,
                     p["scale"], p["rows"].stride(0), num_rows, num_slots, slot_mapping.stride(0), cache.stride(0),
                     cache.stride(1), cache.stride(2)),
                    dict(D=dim, NUM_HEADS=num_heads, BLOCK_SIZE=block_size, BITS=codec.bits,
                         TUPLE=_square_tuple(codec.bits), OFFSET=offset, INDEX_BYTES=index_bytes, HEAD=p["head"],
                         NORM_CORRECTION=bool(codec.norm_correction), CHECK=check)))
                continue
        block_d = _store_block_d(dim)
        args = dict(  # no FMA contraction: y = z * scale must be rounded before t - y
            x_ptr=p["rows"], sign_ptr=p["signs"], mid_ptr=p["mid"], tie_ptr=p["tie"], sq_ptr=p["squares"],
            slot_ptr=slot_mapping, cache_ptr=cache, norm_ptr=part_norms, scale=p["scale"], stride_x=p["rows"].stride(0),
            num_rows=num_rows, num_slots=num_slots, offset=offset, stride_slot=slot_mapping.stride(0),
            stride_block=cache.stride(0), stride_pos=cache.stride(1), stride_head=cache.stride(2),
            D=dim, C=block_d // 8, LOG_D=dim.bit_length() - 1, PIECES=pieces, NUM_HEADS=num_heads,
            BLOCK_SIZE=block_size, BLOCK_ROWS=block_rows, BITS=codec.bits, TUPLE=_square_tuple(codec.bits),
            INDEX_BYTES=index_bytes, HEAD=p["head"], HADAMARD=p["hadamard"],
            NORM_CORRECTION=bool(codec.norm_correction), CHECK=check)
        options = dict(num_warps=num_warps, enable_fp_fusion=False,
                       **({} if T.interpreted() else _store_compiled_options(codec.bits, num_warps, dim, piece)))
        specs.append((store_mse_kernel, (C.cdiv(num_rows, block_rows),), args, options))
    return specs


def _save_slots(cache: torch.Tensor, slot_mapping: torch.Tensor):
    """The slots ``slot_mapping`` names (in range, checked before) and their bytes, to undo a failed write."""
    slots = slot_mapping[slot_mapping >= 0].long()
    block, pos = slots // cache.shape[1], slots % cache.shape[1]
    return block, pos, cache[block, pos].clone()


def _restore_slots(cache: torch.Tensor, saved) -> None:
    block, pos, data = saved
    cache[block, pos] = data


def _part_layout(codec, part: str, slot_bytes: int):
    """``(offset, index_bytes)`` of ``part``'s code in a slot; the other part's size comes from ``slot_bytes``."""
    code_bytes = packed_bytes(codec.dim, codec.bits) + NORM_BYTES
    other = slot_bytes - code_bytes
    if other not in {packed_bytes(codec.dim, b) + NORM_BYTES for b in MSE_BITS}:
        raise ValueError(
            f"cache's slot_bytes ({slot_bytes}) does not fit a {part} code of {code_bytes} bytes "
            f"(dim={codec.dim}, bits={codec.bits}) plus a code of 2, 3 or 4 bits"
        )
    offset = 0 if part == "key" else other
    return offset, code_bytes - NORM_BYTES


def load_mse(
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    codec,
    part: str = "key",
    space: str = "rotated",
    out_dtype: torch.dtype = torch.float16,
    *,
    check: bool = True,
    launch: CodecLaunch | None = None,
) -> torch.Tensor:
    """Decode the ``part`` ("key" or "value") codes of ``slot_mapping``'s slots: ``[num_tokens, num_heads, dim]``.

    Equals ``codec.decode(codes, space)`` of the codes ``load_slots`` returns, cast to ``out_dtype`` (in model
    space up to the order of the matrix product's sums: beyond dim 128 a float32 result may differ by about 1e-6)
    (``space="rotated"``: ``y = x @ R`` coordinates, for attention in rotated space; ``"model"``:
    times ``R.T``, in the kernel as an fp16 product with fp32 accumulation for 16-bit outputs and dims
    of 9 to 128, else as one batched fp32 GEMM after the kernel). Rows whose slot is
    ``-1`` (or, with ``check=False``, out of range) come out as zeros. The other part's bit width is
    inferred from the cache's ``slot_bytes``. ``check=True`` (default) checks the slot range with
    one host sync, and that ``codec`` is the codec that wrote ``part`` (when ``store_mse`` wrote the
    cache); ``check=False`` does not sync. ``launch`` (``kvlab.CodecLaunch``) tunes the launch:
    ``block_rows`` (a power of two; default 2048 elements per tile, 16 rows of 128; in model space 64
    rows) and ``num_warps`` (default one warp, two for 2-bit codes; four in model space) (the defaults
    were the fastest on an H200, ``benchmarks/bench_launch_configs.py --only mse_load``);
    ``fast`` (model space in the kernel only): look the centroids up with byte permutes of 32-bit
    code words (inline PTX, as the decode kernel does) instead of shifting out and gathering each
    index; ``None`` (default) does when it can: on a GPU, dims of 32, 64 or 128, a symmetric
    4-bit codebook, codes that all start 4-byte aligned or all 2 bytes past a word boundary.
    """
    check_codec("codec", codec)
    C.check_choice("part", part, ("key", "value"))
    C.check_choice("space", space, ("rotated", "model"))
    if out_dtype not in C.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of (float16, bfloat16, float32), got {out_dtype}")
    C.check_bool("check", check)
    _check_cache(cache)
    C.check_kernel_device("cache", cache)
    num_blocks, block_size, num_heads, slot_bytes = cache.shape
    offset, index_bytes = _part_layout(codec, part, slot_bytes)
    C.check_tensor("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D [num_tokens], got shape {tuple(slot_mapping.shape)}")
    num_tokens = slot_mapping.shape[0]
    C.check_slot_mapping(slot_mapping, num_tokens, num_blocks * block_size, cache.device, values=check)
    if check:
        C.check_reader(cache, *((codec, None) if part == "key" else (None, codec)), names=("codec", "codec"))
    block_rows, num_warps, fast = launch_settings(launch, "load_mse", ("block_rows", "num_warps", "fast"))
    # model space: fused (an fp16 product in the kernel) for 16-bit outputs; an exact fp32 GEMM for fp32
    # (tiles of 16 to 128 columns: R^T, at most 32 KB in fp16, is loaded once by every program)
    fused = space == "model" and out_dtype != torch.float32 and 16 <= 8 * _block_g(codec.dim) <= 128
    if block_rows is None:
        block_rows = MODEL_TILE_ROWS if fused else _default_block_rows(codec.dim)
    if num_warps is None:
        num_warps = MODEL_NUM_WARPS if fused else LOAD_NUM_WARPS[codec.bits]
    if fused and block_rows < 16:
        raise ValueError(f"launch.block_rows must be >= 16 for space='model' with a 16-bit out_dtype (a tensor-core tile), got {block_rows}")

    device, dim, num_rows = cache.device, codec.dim, num_tokens * num_heads
    rot, cent = _rotation(codec, device), T.centroids(codec, device)
    align = _alignment(cache, offset)
    tables = _model_lookup_tables(cache, codec, offset) if fused else None
    can_fast = tables is not None and (not T.interpreted() or T.interpreter_runs_ptx())
    if fast is None:
        fast = can_fast
    elif fast and not can_fast:
        raise ValueError("launch.fast=True needs space='model' with a 16-bit out_dtype, dim 32, 64 or 128, a symmetric "
                         "4-bit codebook, 2- or 4-byte aligned codes and a CUDA device (inline PTX)")
    # rotated space, 3 bit: the codes as 32-bit words when every code starts on or 2 bytes past a word boundary
    phase = _word_phase(cache, offset)
    words3 = not fused and codec.bits == 3 and dim in (32, 64, 128, 256) and phase is not None
    out = torch.empty(num_rows, dim, dtype=out_dtype if space == "rotated" or fused else torch.float32, device=device)
    major = T.capability(device)[0] if T.compiled(device) else None  # compute capability
    # fused, compiled for Hopper at the default tile: the Gluon kernel (centroid tiles made in the MMA's registers)
    mma = (fused and fast and major == 9 and block_rows == MODEL_TILE_ROWS
           and num_warps == MODEL_NUM_WARPS)
    if mma:
        from . import gluon_load

        mma = gluon_load.supports(dim, codec.bits)
    if num_rows and mma:
        grid = (min(C.cdiv(num_rows, gluon_load.TILE_ROWS), gluon_load.PROGRAMS_PER_SM * T.sm_count(device)),)
        b = T.cached(codec, ("mma_b", device), codec.rotation,
                    lambda r: gluon_load.operand_b(r, codec.bits).to(device))
        with T.on_device(device):
            gluon_load.launch(grid, (cache, slot_mapping, b, out, *tables, num_rows, num_blocks * block_size,
                                  slot_mapping.stride(0), cache.stride(0), cache.stride(1), cache.stride(2), grid[0]),
                           dict(D=dim, NUM_HEADS=num_heads, BLOCK_SIZE=block_size, BITS=codec.bits, OFFSET=offset,
                                INDEX_BYTES=index_bytes, ALIGN4=phase == 0))
    elif num_rows:
        rt = _rotation_t16(codec, device, order=fast) if fused else cent  # cent: a placeholder, never read
        # fused: tiles leave by bulk stores through a tensor descriptor of out (rows counted in int32)
        out_desc = (fused and dim == 8 * _block_g(dim) and block_rows <= 256 and num_rows < 2**31
                    and (major is None or major >= 9))
        tiles = C.cdiv(num_rows, block_rows)
        # fused: persistent programs, a few per SM, each loading R^T once
        grid = (min(tiles, MODEL_PROGRAMS_PER_SM * T.sm_count(device)) if fused else tiles,)
        with T.on_device(device):
            load_mse_kernel[grid](
                cache, slot_mapping, cent, rt,
                TensorDescriptor.from_tensor(out, [block_rows, dim]) if out_desc else out,
                *(tables if fast else (0, 0, 0, 0)),
                num_rows, num_blocks * block_size,
                slot_mapping.stride(0), cache.stride(0), cache.stride(1), cache.stride(2),
                grid[0],
                D=dim,
                NUM_HEADS=num_heads,
                BLOCK_SIZE=block_size,
                BLOCK_ROWS=block_rows,
                BLOCK_G=_block_g(dim),
                BITS=codec.bits,
                INDEX_BYTES=index_bytes,
                OFFSET=offset,
                UNIT=max(u for u in (1, 2, 4) if codec.bits % u == 0 and align % u == 0),
                NORM_ALIGNED=align % 2 == 0 and index_bytes % 2 == 0,
                BF16_BY_BITS=out.dtype == torch.bfloat16 and T.interpreted(),
                MODEL=fused,
                FAST=fast,
                ALIGN4=(fast or words3) and phase == 0,
                INTERPRETED_TILES=C.cdiv(tiles, grid[0]) if fused and T.interpreted() else 0,
                WORDS3=words3,
                OUT_DESC=out_desc,
                num_warps=num_warps,
                **(_model_options() if fused else {}),
            )
    if space == "model" and not fused:
        out = (out @ rot.T).to(out_dtype)  # the reference's inverse rotation, one GEMM for all rows
    return out.view(num_tokens, num_heads, dim)
