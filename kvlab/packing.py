"""Bit packing of codes, in pure torch: the byte streams of ``kvlab.layout`` that the reference codecs write.

``pack_indices`` / ``unpack_indices`` check their input; ``pack_valid_indices`` / ``unpack_valid_indices`` are
the same for indices an encoder has just produced (no check, no host sync). ``fp16_bytes`` /
``fp16_from_bytes``: an fp16 value as its two little-endian bytes. Like the references, no kernel imports this.
"""

from __future__ import annotations

import torch

from . import _checks as C
from . import layout
from .layout import packed_bytes

__all__ = ["fp16_bytes", "fp16_from_bytes", "pack_indices", "pack_valid_indices", "unpack_indices", "unpack_valid_indices"]


def pack_indices(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer indices ``[..., n]`` (values in ``[0, 2**bits)``) into uint8 ``[..., ceil(bits n / 8)]``."""
    C.check_int("bits", bits, layout.PACK_BITS)
    C.check_codes("idx", idx, bits)
    return pack_valid_indices(idx, bits)


def pack_valid_indices(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """``pack_indices`` of indices known to be in range (the encoders' own)."""
    n = idx.shape[-1]
    nbytes = packed_bytes(n, bits)
    idx = idx.to(torch.int64)
    if bits == 8:
        return idx.to(torch.uint8)
    # Element j occupies bits [bits*j, bits*j + bits) of a little-endian stream.
    start = torch.arange(n, device=idx.device) * bits
    out = torch.zeros(*idx.shape[:-1], nbytes + 1, dtype=torch.int64, device=idx.device)
    lo_byte, shift = start // 8, start % 8
    out.index_add_(-1, lo_byte, (idx << shift) & 0xFF)
    out.index_add_(-1, lo_byte + 1, idx >> (8 - shift))  # the part that straddles into the next byte
    return out[..., :nbytes].to(torch.uint8)


def unpack_indices(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_indices``: uint8 ``[..., nbytes]`` -> int64 ``[..., n]``.

    ``nbytes`` must be ``packed_bytes(n, bits)``, the bytes ``pack_indices`` writes for ``n`` indices.
    """
    C.check_int("bits", bits, layout.PACK_BITS)
    C.check_int("n", n, minimum=0)
    C.check_tensor("packed", packed, (torch.uint8,), ndim_min=1)
    if packed.shape[-1] != packed_bytes(n, bits):
        raise ValueError(f"packed's last dimension must be packed_bytes(n={n}, bits={bits}) = {packed_bytes(n, bits)}, "
                         f"got shape {tuple(packed.shape)}")
    return unpack_valid_indices(packed, bits, n)


def unpack_valid_indices(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """``unpack_indices`` of codes known to fit (the decoders' own slices of a checked code)."""
    data = packed.to(torch.int64)
    if bits == 8:
        return data[..., :n]
    data = torch.cat([data, torch.zeros_like(data[..., :1])], -1)
    start = torch.arange(n, device=packed.device) * bits
    lo_byte, shift = start // 8, start % 8
    word = data[..., lo_byte] | (data[..., lo_byte + 1] << 8)
    return (word >> shift) & ((1 << bits) - 1)


def fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp16 values ``[...]`` -> little-endian bytes ``[..., 2]``."""
    u = x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack([u & 0xFF, u >> 8], -1).to(torch.uint8)


def fp16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes ``[..., 2]`` -> fp16 ``[...]``."""
    u = b[..., 0].to(torch.int32) | (b[..., 1].to(torch.int32) << 8)
    return torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16).view(torch.float16)
