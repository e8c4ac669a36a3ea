"""Triton kernels of the transform codec in a paged cache: ``store_transform`` and ``load_transform``.

What
    The codec's two matrix products run in torch (``kvlab.transform.api``); these kernels do everything between
    them, byte for byte as ``kvlab.transform.reference`` does:

    * ``store_transform(y, codec, cache, slot_mapping)`` (``quantize`` + ``pack`` + ``write_rows``): one fused
      kernel per tile of tokens and group. The gain is the fp64 root mean square of the group's ``y``, rounded
      to fp32 and then to fp16 as torch converts (1 with ``gain=False``). Each byte of the group's bit stream
      is then the sum of the parts of the codes that overlap it (their bits are disjoint, so the sum is their
      OR); a code is found where a byte needs it, by a binary search over its component's boundaries
      (``y > boundary * gain``, ``max_bits`` steps), through a table built once per codec: for each byte, the
      components that overlap it and where their code starts relative to the byte. The gain follows as two
      bytes. Slot ``-1`` is padding: its row is not written.
    * ``load_transform(cache, codec, slots)`` (``read_rows`` + ``unpack`` + ``dequantize``): each component's
      code from the two bytes that hold it, its centroid times the gain: ``y_hat [*slots.shape, G, D]``
      float32.

Layout: ``kvlab.transform.codec``. On a CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _checks as C
from .._kernels import tables as T
from .codec import TransformCodec

__all__ = ["check_cache", "load_transform", "store_transform"]

BLOCK_TOKENS = 32
# tokens x lanes of one program: compiled for sm_90 with 4 warps, 2048 keep the store and the load under 170 registers
# a thread without spills (8192: 255 registers and spills); the interpreter is fastest with few, large programs
BLOCK_ELEMENTS, INTERPRETED_BLOCK_ELEMENTS = 2048, 8192


def _block_elements(device) -> int:
    return BLOCK_ELEMENTS if T.compiled(device) else INTERPRETED_BLOCK_ELEMENTS


# ----------------------------------------------------------------------------- device tables


def _tables(codec: TransformCodec, device) -> dict:
    """Per device, once per codec: boundaries, codebooks, bit widths and offsets, the byte table of the store."""
    cache = codec.__dict__.setdefault("_device_tables", {})
    key = str(device)
    if key in cache:
        return cache[key]
    g, d = codec.groups, codec.dim
    bits = codec.bits.long().cpu()
    offsets = codec.offsets.cpu()
    code_bytes = [C.cdiv(b, 8) for b in codec.group_bits]
    nb = max(1, max(code_bytes))
    parts = [[[] for _ in range(nb)] for _ in range(g)]  # parts[g][j]: (component, its first bit - 8 j)
    for gi in range(g):
        for c in range(d):
            b, o = int(bits[gi, c]), int(offsets[gi, c])
            for j in range(o // 8, (o + b - 1) // 8 + 1) if b else ():
                parts[gi][j].append((c, o - 8 * j))
    width = max(1, max(len(p) for row in parts for p in row))  # at most 9: eight 1-bit codes and one straddling
    idx = torch.full((g, nb, width), -1, dtype=torch.int32)
    rel = torch.zeros((g, nb, width), dtype=torch.int32)
    for gi in range(g):
        for j in range(nb):
            for k, (c, r) in enumerate(parts[gi][j]):
                idx[gi, j, k], rel[gi, j, k] = c, r
    levels = codec.codebooks.shape[-1]
    bounds = codec.boundaries if levels > 1 else torch.full((g, d, 1), float("inf"))
    t = {
        "bounds": bounds.to(device, torch.float32).contiguous(),
        "books": codec.codebooks.to(device, torch.float32).contiguous(),
        "bits": bits.to(device, torch.int32).contiguous(),
        "offsets": offsets.to(device, torch.int32).contiguous(),
        "group_offsets": torch.tensor(codec.group_offsets, dtype=torch.int32, device=device),
        "code_bytes": torch.tensor(code_bytes, dtype=torch.int32, device=device),
        "part_idx": idx.to(device), "part_rel": rel.to(device), "parts": width,
        "max_code_bytes": nb, "levels": levels, "bound_stride": bounds.shape[-1],
    }
    cache[key] = t
    return t


def check_cache(cache: torch.Tensor, codec: TransformCodec) -> None:
    if not isinstance(codec, TransformCodec):
        raise TypeError(f"codec must be a kvlab.transform.TransformCodec, got {type(codec).__name__}")
    C.check_tensor("cache", cache, (torch.uint8,), ndim_min=2, last_dim=codec.row_bytes)
    if not cache.is_contiguous():
        raise ValueError("cache must be contiguous")
    C.check_kernel_device("cache", cache)


# ----------------------------------------------------------------------------- store


@triton.jit
def _store_kernel(
    # pointers
    y_ptr,  # [T, G, D] float32: the transformed vectors
    bounds_ptr,  # [G, D, NBND] float32, ascending, +inf past a component's 2**bits - 1 boundaries
    idx_ptr, rel_ptr,  # [G, NB, NP] int32: the components overlapping each code byte (-1: none), their first bit - 8 j
    goff_ptr, nbytes_ptr,  # [G] int32: where a group starts in the row, its code bytes
    slot_ptr,  # [T] int32 or int64: the row of each token (-1: padding, not written)
    cache_ptr,  # [S, ROW] uint8 (out)
    # sizes
    T, S, G, D, NB, NBND, ROW,
    # settings
    NP: tl.constexpr, MAX_BITS: tl.constexpr, GAIN: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    BNB: tl.constexpr,
):
    i_t, i_g = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)  # [BT]
    o_d = tl.arange(0, BD)  # [BD]
    o_j = tl.arange(0, BNB)  # [BNB]
    b_s = tl.load(slot_ptr + o_t, mask=o_t < T, other=-1).to(tl.int64)
    m_t = (o_t < T) & (b_s >= 0) & (b_s < S)  # a row outside the cache (unchecked) is not written
    p_y = y_ptr + (o_t * G + i_g) * D  # [BT]: the group's vector of each token
    # the gain: fp64 root mean square, rounded to fp16
    if GAIN:
        b_y = tl.load(p_y[:, None] + o_d[None, :], mask=m_t[:, None] & (o_d < D)[None, :], other=0.0)  # [BT, BD]
        b_y64 = b_y.to(tl.float64)
        b_ms = tl.sum(b_y64 * b_y64, axis=1) / D  # [BT]; fp64 division and square root round correctly (PTX .rn)
        b_g = tl.sqrt(b_ms).to(tl.float32).to(tl.float16)  # via fp32, as torch converts fp64 to fp16
    else:
        b_g = tl.full([BT], 1.0, tl.float16)
    b_gf = tl.where(m_t, b_g.to(tl.float32), 1.0)[:, None]  # [BT, 1]; tokens not stored: any finite gain
    # each code byte: the sum (= OR, disjoint bits) of the parts of the codes that overlap it
    b_nb = tl.load(nbytes_ptr + i_g)
    m_j = o_j < b_nb
    b_acc = tl.zeros([BT, BNB], dtype=tl.int32)
    for k in tl.static_range(NP):
        b_i = tl.load(idx_ptr + (i_g * NB + o_j) * NP + k, mask=m_j, other=-1)  # [BNB]
        b_r = tl.load(rel_ptr + (i_g * NB + o_j) * NP + k, mask=m_j, other=0)[None, :]  # [1, BNB]
        m = m_t[:, None] & (b_i >= 0)[None, :]  # [BT, BNB]
        b_c = tl.maximum(b_i, 0)[None, :]
        b_yc = tl.load(p_y[:, None] + b_c, mask=m, other=0.0)  # [BT, BNB]: the component's value
        p_b = bounds_ptr + (i_g * D + b_c) * NBND
        b_code = tl.zeros([BT, BNB], dtype=tl.int32)
        for s in tl.static_range(MAX_BITS - 1, -1, -1):  # binary search: #{boundaries j : y > boundary_j * gain}
            b_b = tl.load(p_b + b_code + (1 << s) - 1, mask=m, other=float("inf"))
            b_code += tl.where(b_yc > b_b * b_gf, 1 << s, 0)
        b_part = tl.where(b_r >= 0, b_code << tl.maximum(b_r, 0), b_code >> tl.maximum(-b_r, 0)) & 0xFF
        b_acc += tl.where(m, b_part, 0)
    b_goff = tl.load(goff_ptr + i_g).to(tl.int64)
    p_row = cache_ptr + b_s * ROW + b_goff  # [BT]
    tl.store(p_row[:, None] + o_j[None, :], b_acc.to(tl.uint8), mask=m_t[:, None] & m_j[None, :])
    if GAIN:
        b_h = b_g.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF  # [BT]
        tl.store(p_row + b_nb, (b_h & 0xFF).to(tl.uint8), mask=m_t)
        tl.store(p_row + b_nb + 1, (b_h >> 8).to(tl.uint8), mask=m_t)


def store_transform(y: torch.Tensor, codec: TransformCodec, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize and pack ``y [T, groups, dim]`` float32 into the rows ``slot_mapping [T]`` of ``cache``.

    ``cache`` is uint8 ``[..., row_bytes]`` (a paged cache ``[num_blocks, block_size, row_bytes]``), contiguous;
    slot ``-1`` (padding) or any row outside the cache: not written. Checks types and shapes without a host sync; ``kvlab.transform.api.store`` also
    checks the values (finite, slots in range, gains within fp16)."""
    check_cache(cache, codec)
    C.check_tensor("y", y, (torch.float32,))
    if y.dim() != 3 or tuple(y.shape[1:]) != (codec.groups, codec.dim):
        raise ValueError(f"y must be [tokens, groups, dim] = [T, {codec.groups}, {codec.dim}], got {tuple(y.shape)}")
    C.check_tensor("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if tuple(slot_mapping.shape) != (y.shape[0],):
        raise ValueError(f"slot_mapping must be [tokens] = [{y.shape[0]}], got shape {tuple(slot_mapping.shape)}")
    C.check_same_device(y=y, cache=cache, slot_mapping=slot_mapping)
    tokens = y.shape[0]
    if not tokens:
        return
    t = _tables(codec, y.device)
    bd = triton.next_power_of_2(codec.dim)
    bnb = triton.next_power_of_2(t["max_code_bytes"])
    bt = max(1, min(BLOCK_TOKENS, _block_elements(y.device) // max(bd, bnb)))
    _store_kernel[(triton.cdiv(tokens, bt), codec.groups)](
        y.contiguous(), t["bounds"], t["part_idx"], t["part_rel"], t["group_offsets"], t["code_bytes"],
        slot_mapping.contiguous(), cache,
        tokens, cache.numel() // codec.row_bytes, codec.groups, codec.dim, t["max_code_bytes"], t["bound_stride"], codec.row_bytes,
        NP=t["parts"], MAX_BITS=max(codec.max_bits, 1), GAIN=codec.gain, BT=bt, BD=bd, BNB=bnb)


# ----------------------------------------------------------------------------- load


@triton.jit
def _load_kernel(
    # pointers
    cache_ptr,  # [S, ROW] uint8
    slot_ptr,  # [N] int32 or int64
    books_ptr,  # [G, D, L] float32
    bits_ptr, off_ptr,  # [G, D] int32: bit width and bit offset in the group's stream
    goff_ptr, nbytes_ptr,  # [G] int32: where a group starts in the row, its code bytes
    out_ptr,  # [N, G, D] float32 (out)
    # sizes
    N, S, G, D, L, ROW,
    # settings
    GAIN: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    i_t, i_g = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)  # [BT]
    o_d = tl.arange(0, BD)  # [BD]
    m_n, m_d = o_t < N, o_d < D
    b_s = tl.load(slot_ptr + o_t, mask=m_n, other=-1).to(tl.int64)
    m_t = m_n & (b_s >= 0) & (b_s < S)  # a row outside the cache (unchecked) reads as zeros
    m = m_t[:, None] & m_d[None, :]
    b_goff = tl.load(goff_ptr + i_g).to(tl.int64)
    b_bits = tl.load(bits_ptr + i_g * D + o_d, mask=m_d, other=0)  # [BD]
    b_off = tl.load(off_ptr + i_g * D + o_d, mask=m_d, other=0)
    b_byte = (b_goff + b_off // 8)[None, :]  # [1, BD]: the first byte of each code in the row
    p_row = cache_ptr + b_s[:, None] * ROW
    b_lo = tl.load(p_row + b_byte, mask=m & (b_byte < ROW), other=0).to(tl.int32)  # a 0-bit code may sit at the end
    b_hi = tl.load(p_row + b_byte + 1, mask=m & (b_byte + 1 < ROW), other=0).to(tl.int32)
    b_code = ((b_lo | (b_hi << 8)) >> (b_off % 8)[None, :]) & ((1 << b_bits) - 1)[None, :]  # [BT, BD]
    b_v = tl.load(books_ptr + (i_g * D + o_d[None, :]) * L + b_code, mask=m, other=0.0)
    if GAIN:
        p_gain = cache_ptr + b_s * ROW + b_goff + tl.load(nbytes_ptr + i_g)  # [BT]
        b_lo = tl.load(p_gain, mask=m_t, other=0).to(tl.int32)
        b_h = b_lo | (tl.load(p_gain + 1, mask=m_t, other=0).to(tl.int32) << 8)  # the fp16 gain's bits
        b_gain = b_h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        b_v = b_v * b_gain[:, None]
    tl.store(out_ptr + (o_t[:, None] * G + i_g) * D + o_d[None, :], b_v, mask=m_n[:, None] & m_d[None, :])


def load_transform(cache: torch.Tensor, codec: TransformCodec, slots: torch.Tensor) -> torch.Tensor:
    """``y_hat [*slots.shape, groups, dim]`` float32: the dequantized rows ``slots`` (any shape) of ``cache``.

    A slot outside the cache reads as zeros. Checks types and shapes without a host sync;
    ``kvlab.transform.api.load`` also checks that the slots are rows of the cache."""
    check_cache(cache, codec)
    C.check_tensor("slots", slots, (torch.int32, torch.int64))
    C.check_same_device(cache=cache, slots=slots)
    flat = slots.reshape(-1).contiguous()
    n = flat.shape[0]
    out = torch.empty(n, codec.groups, codec.dim, dtype=torch.float32, device=cache.device)
    if n:
        t = _tables(codec, cache.device)
        bd = triton.next_power_of_2(codec.dim)
        bt = max(1, min(BLOCK_TOKENS, _block_elements(cache.device) // bd))
        _load_kernel[(triton.cdiv(n, bt), codec.groups)](
            cache, flat, t["books"], t["bits"], t["offsets"], t["group_offsets"], t["code_bytes"], out,
            n, cache.numel() // codec.row_bytes, codec.groups, codec.dim, t["levels"], codec.row_bytes, GAIN=codec.gain, BT=bt, BD=bd)
    return out.view(*slots.shape, codec.groups, codec.dim)
