"""Triton kernels of the transform codec in a paged cache: quantize and pack ``y``, unpack and dequantize rows.

What
    The codec's two matrix products run in torch (``kvlab.transform.api``); these kernels do everything between
    them, byte for byte as ``kvlab.transform.reference`` does (``quantize`` + ``pack`` + ``write_rows``;
    ``read_rows`` + ``unpack`` + ``dequantize``):

    * ``quantize_rows(y, codec)``: per token and group the fp16 gain (the fp64 root mean square of ``y``) and
      every component's code, found by a binary search over the component's boundaries
      (``y > boundary * gain``, ``max_bits`` steps); codes go to a uint8 scratch tensor ``[T, G, D]``.
    * ``pack_rows(codes, gains, codec, cache, slot_mapping)``: each byte of a group's bit stream is the OR of
      the (at most nine) component codes that overlap it, read through a table built once per codec; the gain
      follows as two bytes; slot ``-1`` is not written.
    * ``load_rows(cache, codec, slots)``: each component's code from the two bytes that hold it, its centroid
      times the gain: ``y_hat [N, G, D]`` float32.

Layout: ``kvlab.transform.codec``. On a CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _checks as C
from .codec import TransformCodec

__all__ = ["load_rows", "pack_rows", "quantize_rows"]

CONTRIBUTORS = 9  # components that can overlap one byte: eight 1-bit codes starting in it and one straddling into it
BLOCK_TOKENS = 32


# ----------------------------------------------------------------------------- device tables


def _tables(codec: TransformCodec, device) -> dict:
    """Per device, once per codec: boundaries, codebooks, bit widths and offsets, the pack table."""
    cache = codec.__dict__.setdefault("_device_tables", {})
    key = str(device)
    if key in cache:
        return cache[key]
    g, d = codec.groups, codec.dim
    bits = codec.bits.long().cpu()
    offsets = codec.offsets.cpu()
    code_bytes = [C.cdiv(b, 8) for b in codec.group_bits]
    nb = max(1, max(code_bytes))
    idx = torch.full((g, nb, CONTRIBUTORS), -1, dtype=torch.int32)
    rel = torch.zeros((g, nb, CONTRIBUTORS), dtype=torch.int32)
    for gi in range(g):
        fill = [0] * nb
        for c in range(d):
            b, o = int(bits[gi, c]), int(offsets[gi, c])
            if b == 0:
                continue
            for j in range(o // 8, (o + b - 1) // 8 + 1):  # the bytes this code overlaps
                idx[gi, j, fill[j]] = c
                rel[gi, j, fill[j]] = o - 8 * j
                fill[j] += 1
    levels = codec.codebooks.shape[-1]
    bounds = codec.boundaries if levels > 1 else torch.full((g, d, 1), float("inf"))
    t = {
        "bounds": bounds.to(device, torch.float32).contiguous(),
        "books": codec.codebooks.to(device, torch.float32).contiguous(),
        "bits": bits.to(device, torch.int32).contiguous(),
        "offsets": offsets.to(device, torch.int32).contiguous(),
        "group_offsets": torch.tensor(codec.group_offsets, dtype=torch.int32, device=device),
        "code_bytes": torch.tensor(code_bytes, dtype=torch.int32, device=device),
        "pack_idx": idx.to(device), "pack_rel": rel.to(device),
        "max_code_bytes": nb, "levels": levels, "bound_stride": bounds.shape[-1],
    }
    cache[key] = t
    return t


# ----------------------------------------------------------------------------- quantize


@triton.jit
def _quantize_kernel(
    # pointers
    y_ptr,  # [T, G, D] float32
    bounds_ptr,  # [G, D, NBND] float32, ascending, +inf past a component's 2**bits - 1 boundaries
    codes_ptr,  # [T, G, D] uint8 (out)
    gains_ptr,  # [T, G] float16 (out)
    # sizes
    T, G, D,
    NBND,
    # settings
    GAIN: tl.constexpr, MAX_BITS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    i_t, i_g = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)  # [BT]
    o_d = tl.arange(0, BD)  # [BD]
    m_t, m_d = o_t < T, o_d < D
    m = m_t[:, None] & m_d[None, :]
    p_y = y_ptr + (o_t[:, None] * G + i_g) * D + o_d[None, :]
    b_y = tl.load(p_y, mask=m, other=0.0)  # [BT, BD]
    if GAIN:
        b_y64 = b_y.to(tl.float64)
        b_g = tl.sqrt(tl.sum(b_y64 * b_y64, axis=1) / D).to(tl.float16)  # [BT]
    else:
        b_g = tl.full([BT], 1.0, tl.float16)
    b_gf = tl.where(m_t, b_g.to(tl.float32), 1.0)[:, None]  # tokens past T: any finite gain
    # binary search: the number of boundaries below y / gain, as y > boundary * gain
    b_pos = tl.zeros([BT, BD], dtype=tl.int32)
    p_b = bounds_ptr + (i_g * D + o_d[None, :]) * NBND
    for k in tl.static_range(MAX_BITS - 1, -1, -1):
        b_b = tl.load(p_b + b_pos + (1 << k) - 1, mask=m, other=float("inf"))
        b_pos += tl.where(b_y > b_b * b_gf, 1 << k, 0)
    tl.store(codes_ptr + (o_t[:, None] * G + i_g) * D + o_d[None, :], b_pos.to(tl.uint8), mask=m)
    tl.store(gains_ptr + o_t * G + i_g, b_g, mask=m_t)


def quantize_rows(y: torch.Tensor, codec: TransformCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """``y [T, G, D]`` float32 -> ``(codes [T, G, D] uint8, gains [T, G] fp16)``; no checks (``api.store`` checks)."""
    t = _tables(codec, y.device)
    tokens = y.shape[0]
    codes = torch.empty(tokens, codec.groups, codec.dim, dtype=torch.uint8, device=y.device)
    gains = torch.empty(tokens, codec.groups, dtype=torch.float16, device=y.device)
    if tokens:
        bd = triton.next_power_of_2(codec.dim)
        bt = max(1, min(BLOCK_TOKENS, 8192 // bd))
        _quantize_kernel[(triton.cdiv(tokens, bt), codec.groups)](
            y, t["bounds"], codes, gains, tokens, codec.groups, codec.dim, t["bound_stride"],
            GAIN=codec.gain, MAX_BITS=max(codec.max_bits, 1), BT=bt, BD=bd)
    return codes, gains


# ----------------------------------------------------------------------------- pack


@triton.jit
def _pack_kernel(
    # pointers
    codes_ptr,  # [T, G, D] uint8
    gains_ptr,  # [T, G] float16
    idx_ptr, rel_ptr,  # [G, NB, NC] int32: the components overlapping each code byte, their bit offset in it
    goff_ptr, nbytes_ptr,  # [G] int32: where a group starts in the row, its code bytes
    slot_ptr,  # [T] int32 or int64: the row of each token (-1: not written)
    cache_ptr,  # [slots, ROW] uint8
    # sizes
    T, G, D, NB, ROW,
    # settings
    NC: tl.constexpr, GAIN: tl.constexpr, BT: tl.constexpr, BNB: tl.constexpr,
):
    i_t, i_g = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)  # [BT]
    o_j = tl.arange(0, BNB)  # [BNB]
    b_s = tl.load(slot_ptr + o_t, mask=o_t < T, other=-1).to(tl.int64)
    m_t = (o_t < T) & (b_s >= 0)
    b_goff = tl.load(goff_ptr + i_g).to(tl.int64)
    b_nb = tl.load(nbytes_ptr + i_g)
    m_j = o_j < b_nb
    b_acc = tl.zeros([BT, BNB], dtype=tl.int32)
    for k in tl.static_range(NC):
        b_i = tl.load(idx_ptr + (i_g * NB + o_j) * NC + k, mask=m_j, other=-1)  # [BNB]
        b_r = tl.load(rel_ptr + (i_g * NB + o_j) * NC + k, mask=m_j, other=0)
        m = m_t[:, None] & (b_i >= 0)[None, :]
        b_c = tl.load(codes_ptr + (o_t[:, None] * G + i_g) * D + b_i[None, :], mask=m, other=0).to(tl.int32)
        b_r2 = b_r[None, :]
        b_acc |= tl.where(b_r2 >= 0, b_c << tl.maximum(b_r2, 0), b_c >> tl.maximum(-b_r2, 0)) & 0xFF
    p_row = cache_ptr + b_s[:, None] * ROW + b_goff
    tl.store(p_row + o_j[None, :], b_acc.to(tl.uint8), mask=m_t[:, None] & m_j[None, :])
    if GAIN:
        b_h = tl.load(gains_ptr + o_t * G + i_g, mask=m_t, other=0.0).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        p_gain = cache_ptr + b_s * ROW + b_goff + b_nb
        tl.store(p_gain, (b_h & 0xFF).to(tl.uint8), mask=m_t)
        tl.store(p_gain + 1, (b_h >> 8).to(tl.uint8), mask=m_t)


def pack_rows(codes: torch.Tensor, gains: torch.Tensor, codec: TransformCodec, cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """Write token ``i``'s codes and gains to row ``slot_mapping[i]`` of ``cache [..., row_bytes]``; no checks."""
    t = _tables(codec, codes.device)
    tokens = codes.shape[0]
    if not tokens:
        return
    bt = BLOCK_TOKENS
    _pack_kernel[(triton.cdiv(tokens, bt), codec.groups)](
        codes, gains, t["pack_idx"], t["pack_rel"], t["group_offsets"], t["code_bytes"], slot_mapping, cache,
        tokens, codec.groups, codec.dim, t["max_code_bytes"], codec.row_bytes,
        NC=CONTRIBUTORS, GAIN=codec.gain, BT=bt, BNB=triton.next_power_of_2(t["max_code_bytes"]))


# ----------------------------------------------------------------------------- load


@triton.jit
def _load_kernel(
    # pointers
    cache_ptr,  # [slots, ROW] uint8
    slot_ptr,  # [N] int32 or int64
    books_ptr,  # [G, D, L] float32
    bits_ptr, off_ptr,  # [G, D] int32: bit width and bit offset in the group's stream
    goff_ptr, nbytes_ptr,  # [G] int32
    out_ptr,  # [N, G, D] float32 (out)
    # sizes
    N, G, D, L, ROW,
    # settings
    GAIN: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    i_t, i_g = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)  # [BT]
    o_d = tl.arange(0, BD)  # [BD]
    m_t, m_d = o_t < N, o_d < D
    m = m_t[:, None] & m_d[None, :]
    b_s = tl.load(slot_ptr + o_t, mask=m_t, other=0).to(tl.int64)
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
        p_gain = cache_ptr + b_s * ROW + b_goff + tl.load(nbytes_ptr + i_g)
        b_h = tl.load(p_gain, mask=m_t, other=0).to(tl.int32) | (tl.load(p_gain + 1, mask=m_t, other=0).to(tl.int32) << 8)
        b_gain = b_h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        b_v = b_v * b_gain[:, None]
    tl.store(out_ptr + (o_t[:, None] * G + i_g) * D + o_d[None, :], b_v, mask=m)


def load_rows(cache: torch.Tensor, codec: TransformCodec, slots: torch.Tensor) -> torch.Tensor:
    """``y_hat [N, G, D]`` float32 of the rows ``slots [N]`` of ``cache [..., row_bytes]``; no checks."""
    t = _tables(codec, cache.device)
    n = slots.shape[0]
    out = torch.empty(n, codec.groups, codec.dim, dtype=torch.float32, device=cache.device)
    if n:
        bd = triton.next_power_of_2(codec.dim)
        bt = max(1, min(BLOCK_TOKENS, 8192 // bd))
        _load_kernel[(triton.cdiv(n, bt), codec.groups)](
            cache, slots, t["books"], t["bits"], t["offsets"], t["group_offsets"], t["code_bytes"], out,
            n, codec.groups, codec.dim, t["levels"], codec.row_bytes, GAIN=codec.gain, BT=bt, BD=bd)
    return out
