"""Bit-level device code of the affine kernels (``kvlab.affine.triton``): the two correctly rounded divisions of a
group (``scale_and_inverse``: Brisebarre, Muller and Raina's division by a constant, and one Newton step in fp64),
the packing of 2-, 3-, 4- and 8-bit codes into bytes and back (``pack_rows`` / ``unpack_rows``; 3-bit codes as
24-bit words), and fp16 values as byte lanes."""

from __future__ import annotations

import triton
import triton.language as tl

INF = tl.constexpr(float("inf"))


# ----------------------------------------------------------------------------- scale and inverse

# 1 / (2**bits - 1) as ZH + ZL: ZH = RN(1 / L), ZL = RN(1 / L - ZH), fp32 values (RECIPROCAL_SPLIT[L] = (ZH, ZL))
RECIPROCAL_SPLIT = {
    3: (float.fromhex("0x1.555556p-2"), float.fromhex("-0x1.555556p-27")),
    7: (float.fromhex("0x1.24924ap-3"), float.fromhex("-0x1.b6db6ep-28")),
    15: (float.fromhex("0x1.111112p-4"), float.fromhex("-0x1.dddddep-29")),
    255: (float.fromhex("0x1.010102p-8"), float.fromhex("-0x1.fdfdfep-33")),
}
ZH3, ZL3 = tl.constexpr(RECIPROCAL_SPLIT[3][0]), tl.constexpr(RECIPROCAL_SPLIT[3][1])
ZH7, ZL7 = tl.constexpr(RECIPROCAL_SPLIT[7][0]), tl.constexpr(RECIPROCAL_SPLIT[7][1])
ZH15, ZL15 = tl.constexpr(RECIPROCAL_SPLIT[15][0]), tl.constexpr(RECIPROCAL_SPLIT[15][1])
ZH255, ZL255 = tl.constexpr(RECIPROCAL_SPLIT[255][0]), tl.constexpr(RECIPROCAL_SPLIT[255][1])


@triton.jit
def divide_by_levels(b_r, LEVELS: tl.constexpr):
    """``RN(b_r / LEVELS)`` in fp32 for fp32 ``b_r >= 0`` (below 2**-93 only up to fp16 rounding: the
    quotient's fp16 is 0 either way), as ``RN(r ZH + RN(r ZL))``: the fused multiply-add is done in
    fp64, where ``r ZH + RN(r ZL)`` is exact (a 48-bit product plus a 24-bit term within 53 bits), so
    the one rounding is the final cast; the same arithmetic under the interpreter."""
    if LEVELS == 3:
        zh, zl = ZH3, ZL3
    elif LEVELS == 7:
        zh, zl = ZH7, ZL7
    elif LEVELS == 15:
        zh, zl = ZH15, ZL15
    else:
        zh, zl = ZH255, ZL255
    return (b_r.to(tl.float64) * zh + (b_r * zl).to(tl.float64)).to(tl.float32)


@triton.jit
def scale_and_inverse(b_lo, b_hi, LEVELS: tl.constexpr):
    """A group's fp16 scale ``fp16(RN((hi - lo) / LEVELS))`` (as fp16 and as fp32) and ``RN(1 / scale)``
    (0 where the scale is 0 or infinite). The inverse: ``r0`` the fast fp32 reciprocal (within 2 ulp),
    one Newton step ``r0 (2 - s r0)`` in fp64 (``s r0`` is exact there) leaves it within 2**-44 of
    ``1 / s``, and an fp16 ``s`` has an 11-bit significand, so ``1 / s`` is either exact in fp32 or at
    least 2**-35 (relative) from every fp32 rounding boundary: the cast rounds it correctly."""
    b_s16 = divide_by_levels(b_hi - b_lo, LEVELS).to(tl.float16)
    b_s = b_s16.to(tl.float32)
    m_s = (b_s > 0) & (b_s < INF)
    b_s1 = tl.where(m_s, b_s, 1.0)
    b_r0 = tl.fdiv(tl.full(b_s1.shape, 1.0, tl.float32), b_s1).to(tl.float64)
    b_r = (b_r0 * (2.0 - b_s1.to(tl.float64) * b_r0)).to(tl.float32)
    return b_s16, b_s, tl.where(m_s, b_r, 0.0)


# ----------------------------------------------------------------------------- bit fields


@triton.jit
def byte_lanes(NB: tl.constexpr, BITS: tl.constexpr):
    """Lane ``l`` of a packed row ``[NB]`` -> (byte offset in the row, lane holds a byte).

    2, 4, 8 bit: lane l is byte l. 3 bit: 8 codes fill 3 bytes, kept in 4 lanes (the 4th unused).
    """
    o_l = tl.arange(0, NB)
    if BITS == 3:
        return (o_l // 4) * 3 + o_l % 4, o_l % 4 < 3
    else:
        return o_l, o_l < NB


@triton.jit
def code_lanes(p_run, m, NB: tl.constexpr, BITS: tl.constexpr, RUN_BYTES: tl.constexpr, PARTIAL: tl.constexpr):
    """Byte addresses ``[A, B, NB]`` of the packed lanes (``byte_lanes``) of the runs of packed bytes that
    start at ``p_run [A, B]``, and their mask: ``m`` (``[A, B, 1]``), the lanes that hold a byte and, when
    ``PARTIAL`` (the lanes outnumber a run's bytes), the lanes inside the run's ``RUN_BYTES`` bytes."""
    o_b, m_b = byte_lanes(NB, BITS)
    m_c = m
    if BITS == 3:
        m_c = m_c & m_b[None, None, :]
    if PARTIAL:
        m_c = m_c & (o_b < RUN_BYTES)[None, None, :]
    return p_run[:, :, None] + o_b[None, None, :], m_c


@triton.jit
def codes24(b_q):
    """3 bit: codes ``[M, N]`` (int32 < 8, N a multiple of 8) -> ``[M, N / 8]`` 24-bit words, code ``j`` of a
    word at bit ``3 j``."""
    M: tl.constexpr = b_q.shape[0]
    N: tl.constexpr = b_q.shape[1]
    # j % 8 = 4 c2 + 2 c1 + c0 -> [M, N/8, c2, c1, c0]
    b_c0, b_c1 = tl.split(tl.reshape(b_q, [M, N // 8, 2, 2, 2]))
    b_00, b_10 = tl.split(b_c0)  # c0 = 0: c1 = 0 (j = 0, 4), c1 = 1 (j = 2, 6)
    b_01, b_11 = tl.split(b_c1)
    b_0, b_4 = tl.split(b_00)
    b_2, b_6 = tl.split(b_10)
    b_1, b_5 = tl.split(b_01)
    b_3, b_7 = tl.split(b_11)
    return b_0 | (b_1 << 3) | (b_2 << 6) | (b_3 << 9) | (b_4 << 12) | (b_5 << 15) | (b_6 << 18) | (b_7 << 21)


@triton.jit
def store_words3(p_c, b_q, m_s, BLOCK_ROWS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GS: tl.constexpr):
    """3 bit, groups of a multiple of 32 codes at 4-byte aligned addresses ``p_c [BR, BG, 1]``: the codes
    ``b_q [BR, BG, BLOCK_GS]`` as 32-bit words, three for each 32 codes (eight 24-bit words side by side)."""
    NC: tl.constexpr = BLOCK_GS // 32
    b_w = tl.reshape(codes24(tl.reshape(b_q, [BLOCK_ROWS * BLOCK_G, BLOCK_GS])), [BLOCK_ROWS, BLOCK_G, NC, 2, 2])
    b_even, b_odd = tl.split(b_w.to(tl.uint32))  # 24-bit words (0, 2), (1, 3) of each 32 codes
    b_0, b_2 = tl.split(b_even)
    b_1, b_3 = tl.split(b_odd)
    p_w = p_c.to(tl.pointer_type(tl.uint32)) + 3 * tl.arange(0, NC)[None, None, :]
    tl.store(p_w, b_0 | (b_1 << 24), mask=m_s)
    tl.store(p_w + 1, (b_1 >> 8) | (b_2 << 16), mask=m_s)
    tl.store(p_w + 2, (b_2 >> 16) | (b_3 << 8), mask=m_s)


@triton.jit
def pack_rows(b_q, BITS: tl.constexpr):
    """Codes ``[M, N]`` (int32 < 2**BITS, N a multiple of 8) -> packed lanes ``[M, NB]`` uint8.

    Code j sits at bit ``BITS * j`` of a little-endian stream; see ``byte_lanes`` for lane -> byte.
    """
    M: tl.constexpr = b_q.shape[0]
    N: tl.constexpr = b_q.shape[1]
    if BITS == 8:
        return b_q.to(tl.uint8)
    elif BITS == 4:
        b_0, b_1 = tl.split(tl.reshape(b_q, [M, N // 2, 2]))  # [M, N/2] each: j % 2 = 0, 1
        return (b_0 | (b_1 << 4)).to(tl.uint8)
    elif BITS == 2:
        # j % 4 = 2 c1 + c0 -> [M, N/4, c1, c0]; split c0, then c1
        b_e, b_o = tl.split(tl.reshape(b_q, [M, N // 4, 2, 2]))
        b_0, b_2 = tl.split(b_e)
        b_1, b_3 = tl.split(b_o)
        return (b_0 | (b_1 << 2) | (b_2 << 4) | (b_3 << 6)).to(tl.uint8)
    else:
        b_w = codes24(b_q)
        b_lane0 = tl.join(b_w & 0xFF, b_w >> 16)  # lanes 0, 2
        b_lane1 = tl.join((b_w >> 8) & 0xFF, tl.zeros_like(b_w))  # lanes 1, 3
        return tl.reshape(tl.join(b_lane0, b_lane1), [M, N // 2]).to(tl.uint8)  # [M, N/8, 2, 2] -> lanes


@triton.jit
def unpack_rows(b_p, N: tl.constexpr, BITS: tl.constexpr):
    """Packed lanes ``[M, NB]`` uint8 -> codes ``[M, N]`` int32 (inverse of ``pack_rows``)."""
    M: tl.constexpr = b_p.shape[0]
    b_b = b_p.to(tl.int32)
    if BITS == 8:
        return b_b
    elif BITS == 4:
        return tl.reshape(tl.join(b_b & 0xF, b_b >> 4), [M, N])
    elif BITS == 2:
        b_e = tl.join(b_b & 0x3, (b_b >> 4) & 0x3)  # j % 4 = 0, 2
        b_o = tl.join((b_b >> 2) & 0x3, b_b >> 6)  # j % 4 = 1, 3
        return tl.reshape(tl.join(b_e, b_o), [M, N])
    else:
        b_c0, b_c1 = tl.split(tl.reshape(b_b, [M, N // 8, 2, 2]))  # lanes 0, 2 | lanes 1, 3
        b_0, b_2 = tl.split(b_c0)
        b_1, b_3 = tl.split(b_c1)
        b_w = b_0 | (b_1 << 8) | (b_2 << 16)  # [M, N/8] 24-bit words
        b_00 = tl.join(b_w & 0x7, (b_w >> 12) & 0x7)  # j = 0, 4
        b_10 = tl.join((b_w >> 6) & 0x7, (b_w >> 18) & 0x7)  # j = 2, 6
        b_01 = tl.join((b_w >> 3) & 0x7, (b_w >> 15) & 0x7)  # j = 1, 5
        b_11 = tl.join((b_w >> 9) & 0x7, b_w >> 21)  # j = 3, 7
        return tl.reshape(tl.join(tl.join(b_00, b_10), tl.join(b_01, b_11)), [M, N])


@triton.jit
def fp16_lanes(b_v):
    """fp16 values ``[...]`` -> their little-endian bytes ``[..., 2]`` uint8."""
    b_u = b_v.to(tl.uint16, bitcast=True)
    return tl.join(b_u & 0xFF, b_u >> 8).to(tl.uint8)


@triton.jit
def fp16_from_lanes(b_b):
    """Little-endian bytes ``[..., 2]`` uint8 -> fp16 values ``[...]`` as fp32."""
    b_lo, b_hi = tl.split(b_b)
    b_u = b_lo.to(tl.uint16) | (b_hi.to(tl.uint16) << 8)
    return b_u.to(tl.float16, bitcast=True).to(tl.float32)


# ----------------------------------------------------------------------------- token axis
