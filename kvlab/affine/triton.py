"""Triton kernels for the affine codec: asymmetric min/max quantization with a fp16 scale and zero per group.

What
    ``encode_affine`` / ``decode_affine`` encode and decode exactly what ``kvlab.affine.reference.AffineCodec``
    does (same bytes, ``torch.equal``), for 2, 3, 4 and 8 bits, with groups of ``group_size``
    channels of a token (``axis="token"``) or ``group_size`` tokens of a channel (``axis="channel"``).
    ``encode_affine_mixed`` / ``decode_affine_mixed`` encode a layer's K (or V) ``[tokens, heads, dim]``
    with a bit width per head (``MixedAffineLayout``), in one launch, without padding a head to the
    widest one.

    Per group, in fp32: ``scale = fp16((max - min) / (2**bits - 1))``, ``zero = fp16(min)``,
    ``q = clamp(floor((x - zero) * inv + 1/2), 0, 2**bits - 1)`` with ``inv = 1 / scale`` (``inv = 0``
    where ``scale == 0``), each division correctly rounded, and the multiply and add rounded
    separately (pack kernels are launched with ``enable_fp_fusion=False``), so the codes are
    bit-exact; decoding is ``q * scale + zero`` in fp32, then cast to ``out_dtype``.

Layout
    As ``kvlab.layout`` states it: a token-axis code is ``[indices | scales | zeros]`` of one vector, a
    channel-axis code is ``group_size`` rows of packed indices then ``dim`` scales and ``dim`` zeros;
    a mixed code is the per-head token-axis codes of a token, concatenated in head order.

How
    Every program owns a tile of whole groups: ``[BLOCK_ROWS, groups, group_size]`` for the token axis
    (``BLOCK_ROWS`` vectors), ``[BLOCK_GROUPS, group_size, dim]`` for the channel axis (``BLOCK_GROUPS``
    codes); by default an encoder's program is one warp with a small tile (``PACK_TILE``,
    ``CHANNEL_PACK_TILE``), a decoder's four warps. It loads the tile once, reduces min/max per group
    in registers, quantizes, and builds each output byte from its source fields (``tl.split`` of the
    code tile, shifts and ors), so a vector is read once and its code written once: per fp16 vector of
    ``dim`` elements ``2 dim`` bytes in and ``bits dim / 8 + 4 dim / group_size`` bytes out. Sizes that
    are not powers of two are padded to one and masked. The two divisions of a group need no division
    instruction (``_scale_and_inverse``): ``range / (2**bits - 1)`` is Brisebarre, Muller and Raina's
    division by a constant, ``RN(r zh + RN(r zl))`` with ``zh + zl`` the constant's reciprocal split in
    two fp32 numbers, and ``1 / scale`` one Newton step in fp64 from the fast fp32 reciprocal. Both
    return the correctly rounded quotient: ``tests/ops/test_affine.py`` checks the first for every
    fp32 significand and the second for every fp16 scale. All address arithmetic is int64. With
    ``check=True`` each program also writes a flag (NaN/Inf input, fp16 overflow of a scale or zero)
    that the launcher reads once after the launch, with a flag of nonzero groups whose fp16 scale and
    zero both underflow to 0 (the other end of the range, where such a group would decode to zeros);
    ``check=False`` skips that host sync.

Reference
    ``kvlab.affine.reference.AffineCodec`` (this module does not import it); tests in
    ``tests/ops/test_affine.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import _checks as C


AXES = ("token", "channel")
FP32_MAX = tl.constexpr(3.4028234663852886e38)  # |x| <= FP32_MAX: finite (NaN compares false)
FP16_MAX = tl.constexpr(C.FP16_MAX)
INF = tl.constexpr(float("inf"))
FLAG_NONFINITE = tl.constexpr(1)  # a program's tile holds NaN or Inf
FLAG_OVERFLOW = tl.constexpr(2)  # a group's scale or zero overflows fp16
# Default launches (elements per program, and warps), the fastest of sweeps on an H200 at dim 128. Encoding
# (results/codec_launch_configs_affine.csv, 16M vectors): one warp with a small tile (a group's reduction stays
# in the warp, and many programs per SM hide the loads); decoding (results/codec_launch_configs.csv): four warps.
TILE_ELEMENTS = 4096  # decoding, token axis (and per head of a mixed code)
PACK_TILE = 1024  # encoding, token axis (and per head of a mixed code): 8 vectors of 128
CHANNEL_PACK_TILE = {2: 8192, 3: 8192, 4: 4096, 8: 4096}  # encoding, channel axis, by bits: 2 or 1 codes of 32 x 128
CHANNEL_UNPACK_TILE = 8192
PACK_NUM_WARPS = 1
UNPACK_NUM_WARPS = 4
MAX_TILE_ELEMENTS = 1 << 16  # largest tile a launch may ask for (block_rows x elements per row)


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
def _divide_by_levels(b_r, LEVELS: tl.constexpr):
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
def _scale_and_inverse(b_lo, b_hi, LEVELS: tl.constexpr):
    """A group's fp16 scale ``fp16(RN((hi - lo) / LEVELS))`` (as fp16 and as fp32) and ``RN(1 / scale)``
    (0 where the scale is 0 or infinite). The inverse: ``r0`` the fast fp32 reciprocal (within 2 ulp),
    one Newton step ``r0 (2 - s r0)`` in fp64 (``s r0`` is exact there) leaves it within 2**-44 of
    ``1 / s``, and an fp16 ``s`` has an 11-bit significand, so ``1 / s`` is either exact in fp32 or at
    least 2**-35 (relative) from every fp32 rounding boundary: the cast rounds it correctly."""
    b_s16 = _divide_by_levels(b_hi - b_lo, LEVELS).to(tl.float16)
    b_s = b_s16.to(tl.float32)
    m_s = (b_s > 0) & (b_s < INF)
    b_s1 = tl.where(m_s, b_s, 1.0)
    b_r0 = tl.fdiv(tl.full(b_s1.shape, 1.0, tl.float32), b_s1).to(tl.float64)
    b_r = (b_r0 * (2.0 - b_s1.to(tl.float64) * b_r0)).to(tl.float32)
    return b_s16, b_s, tl.where(m_s, b_r, 0.0)


# ----------------------------------------------------------------------------- bit fields


@triton.jit
def _byte_lanes(NB: tl.constexpr, BITS: tl.constexpr):
    """Lane ``l`` of a packed row ``[NB]`` -> (byte offset in the row, lane holds a byte).

    2, 4, 8 bit: lane l is byte l. 3 bit: 8 codes fill 3 bytes, kept in 4 lanes (the 4th unused).
    """
    o_l = tl.arange(0, NB)
    if BITS == 3:
        return (o_l // 4) * 3 + o_l % 4, o_l % 4 < 3
    else:
        return o_l, o_l < NB


@triton.jit
def _code_lanes(p_run, m, NB: tl.constexpr, BITS: tl.constexpr, RUN_BYTES: tl.constexpr, PARTIAL: tl.constexpr):
    """Byte addresses ``[A, B, NB]`` of the packed lanes (``_byte_lanes``) of the runs of packed bytes that
    start at ``p_run [A, B]``, and their mask: ``m`` (``[A, B, 1]``), the lanes that hold a byte and, when
    ``PARTIAL`` (the lanes outnumber a run's bytes), the lanes inside the run's ``RUN_BYTES`` bytes."""
    o_b, m_b = _byte_lanes(NB, BITS)
    m_c = m
    if BITS == 3:
        m_c = m_c & m_b[None, None, :]
    if PARTIAL:
        m_c = m_c & (o_b < RUN_BYTES)[None, None, :]
    return p_run[:, :, None] + o_b[None, None, :], m_c


@triton.jit
def _codes24(b_q):
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
def _store_words3(p_c, b_q, m_s, BLOCK_ROWS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GS: tl.constexpr):
    """3 bit, groups of a multiple of 32 codes at 4-byte aligned addresses ``p_c [BR, BG, 1]``: the codes
    ``b_q [BR, BG, BLOCK_GS]`` as 32-bit words, three for each 32 codes (eight 24-bit words side by side)."""
    NC: tl.constexpr = BLOCK_GS // 32
    b_w = tl.reshape(_codes24(tl.reshape(b_q, [BLOCK_ROWS * BLOCK_G, BLOCK_GS])), [BLOCK_ROWS, BLOCK_G, NC, 2, 2])
    b_even, b_odd = tl.split(b_w.to(tl.uint32))  # 24-bit words (0, 2), (1, 3) of each 32 codes
    b_0, b_2 = tl.split(b_even)
    b_1, b_3 = tl.split(b_odd)
    p_w = p_c.to(tl.pointer_type(tl.uint32)) + 3 * tl.arange(0, NC)[None, None, :]
    tl.store(p_w, b_0 | (b_1 << 24), mask=m_s)
    tl.store(p_w + 1, (b_1 >> 8) | (b_2 << 16), mask=m_s)
    tl.store(p_w + 2, (b_2 >> 16) | (b_3 << 8), mask=m_s)


@triton.jit
def _pack_rows(b_q, BITS: tl.constexpr):
    """Codes ``[M, N]`` (int32 < 2**BITS, N a multiple of 8) -> packed lanes ``[M, NB]`` uint8.

    Code j sits at bit ``BITS * j`` of a little-endian stream; see ``_byte_lanes`` for lane -> byte.
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
        b_w = _codes24(b_q)
        b_lane0 = tl.join(b_w & 0xFF, b_w >> 16)  # lanes 0, 2
        b_lane1 = tl.join((b_w >> 8) & 0xFF, tl.zeros_like(b_w))  # lanes 1, 3
        return tl.reshape(tl.join(b_lane0, b_lane1), [M, N // 2]).to(tl.uint8)  # [M, N/8, 2, 2] -> lanes


@triton.jit
def _unpack_rows(b_p, N: tl.constexpr, BITS: tl.constexpr):
    """Packed lanes ``[M, NB]`` uint8 -> codes ``[M, N]`` int32 (inverse of ``_pack_rows``)."""
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
def _fp16_lanes(b_v):
    """fp16 values ``[...]`` -> their little-endian bytes ``[..., 2]`` uint8."""
    b_u = b_v.to(tl.uint16, bitcast=True)
    return tl.join(b_u & 0xFF, b_u >> 8).to(tl.uint8)


@triton.jit
def _fp16_from_lanes(b_b):
    """Little-endian bytes ``[..., 2]`` uint8 -> fp16 values ``[...]`` as fp32."""
    b_lo, b_hi = tl.split(b_b)
    b_u = b_lo.to(tl.uint16) | (b_hi.to(tl.uint16) << 8)
    return b_u.to(tl.float16, bitcast=True).to(tl.float32)


# ----------------------------------------------------------------------------- token axis


@triton.jit
def _pack_token_rows(
    # pointers: row 0 of x, the first byte of row 0's code, this program's flag
    x,
    codes,
    flag,
    # sizes and strides
    i_r,  # first row of the tile (int64)
    n_rows,
    stride_x,  # elements between rows of x
    stride_c,  # bytes between rows of codes
    # settings
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_GS: tl.constexpr,  # GROUP_SIZE padded to a power of two
    BLOCK_G: tl.constexpr,  # NUM_GROUPS padded to a power of two
    CHECK: tl.constexpr,
    WORDS: tl.constexpr = False,  # 3 bit: codes and strides 4-byte aligned, GROUP_SIZE = BLOCK_GS a multiple of 32
):
    """Encode rows ``[i_r, i_r + BLOCK_ROWS)`` of x into their token-axis codes."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    GROUP_BYTES: tl.constexpr = GROUP_SIZE * BITS // 8
    INDEX_BYTES: tl.constexpr = NUM_GROUPS * GROUP_BYTES
    NB: tl.constexpr = BLOCK_GS // 8 * (BITS + (BITS == 3))  # packed lanes per group

    o_r = i_r + tl.arange(0, BLOCK_ROWS)
    o_g = tl.arange(0, BLOCK_G)
    o_k = tl.arange(0, BLOCK_GS)
    m_r = o_r < n_rows
    # masks carry only what can be false, so full tiles stay vectorised
    m_x = m_r[:, None, None]
    m_s = m_r[:, None, None]
    if BLOCK_G != NUM_GROUPS:
        m_x = m_x & (o_g < NUM_GROUPS)[None, :, None]
        m_s = m_s & (o_g < NUM_GROUPS)[None, :, None]
    if BLOCK_GS != GROUP_SIZE:
        m_x = m_x & (o_k < GROUP_SIZE)[None, None, :]

    p_x = x + o_r[:, None, None] * stride_x + (o_g * GROUP_SIZE)[:, None] + o_k[None, :]
    b_x = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)  # [BLOCK_ROWS, BLOCK_G, BLOCK_GS]

    # per-group range; padding lanes of a group must not take part
    if BLOCK_GS != GROUP_SIZE:
        b_lo = tl.min(tl.where((o_k < GROUP_SIZE)[None, None, :], b_x, INF), axis=2)
        b_hi = tl.max(tl.where((o_k < GROUP_SIZE)[None, None, :], b_x, -INF), axis=2)
    else:
        b_lo = tl.min(b_x, axis=2)  # [BLOCK_ROWS, BLOCK_G]
        b_hi = tl.max(b_x, axis=2)
    b_s16, b_s, b_inv = _scale_and_inverse(b_lo, b_hi, LEVELS)
    b_z16 = b_lo.to(tl.float16)
    b_z = b_z16.to(tl.float32)
    # floor(v) clamped to [0, LEVELS] equals v clamped then truncated: no separate floor.
    # Launched with enable_fp_fusion=False: the multiply and the add round separately, as in torch.
    b_q = (b_x - b_z[:, :, None]) * b_inv[:, :, None] + 0.5
    b_q = tl.clamp(b_q, 0.0, LEVELS * 1.0).to(tl.int32)

    if BITS == 3 and WORDS:  # 32-bit stores, not bytes
        _store_words3(codes + o_r[:, None, None] * stride_c + (o_g * GROUP_BYTES)[:, None], b_q, m_s,
                      BLOCK_ROWS, BLOCK_G, BLOCK_GS)
    else:
        # indices: [BLOCK_ROWS * BLOCK_G, BLOCK_GS] -> packed lanes [BLOCK_ROWS, BLOCK_G, NB]
        b_p = tl.reshape(_pack_rows(tl.reshape(b_q, [BLOCK_ROWS * BLOCK_G, BLOCK_GS]), BITS), [BLOCK_ROWS, BLOCK_G, NB])
        p_c, m_c = _code_lanes(codes + o_r[:, None] * stride_c + (o_g * GROUP_BYTES)[None, :], m_s, NB, BITS,
                               GROUP_BYTES, BLOCK_GS != GROUP_SIZE)
        tl.store(p_c, b_p, mask=m_c)

    # scales then zeros, little-endian fp16: [BLOCK_ROWS, BLOCK_G, 2]
    p_s = codes + o_r[:, None, None] * stride_c + INDEX_BYTES + 2 * o_g[:, None] + tl.arange(0, 2)[None, :]
    tl.store(p_s, _fp16_lanes(b_s16), mask=m_s)
    tl.store(p_s + 2 * NUM_GROUPS, _fp16_lanes(b_z16), mask=m_s)

    if CHECK:
        b_bad = tl.where(tl.abs(b_x) <= FP32_MAX, 0, FLAG_NONFINITE)  # NaN compares false
        b_ovf = tl.where((tl.abs(b_s) > FP16_MAX) | (tl.abs(b_z) > FP16_MAX), FLAG_OVERFLOW, 0)
        b_flag = tl.max(tl.max(tl.max(b_bad, axis=2), axis=1), axis=0) | tl.max(tl.max(b_ovf, axis=1), axis=0)
        tl.store(flag, b_flag)


@triton.jit
def _unpack_token_rows(
    # pointers: the first byte of row 0's code, row 0 of the output
    codes,
    out,
    # sizes and strides
    i_r,  # first row of the tile (int64)
    n_rows,
    stride_c,  # bytes between rows of codes
    stride_o,  # elements between rows of out
    # settings
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_GS: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """Decode the token-axis codes of rows ``[i_r, i_r + BLOCK_ROWS)``."""
    GROUP_BYTES: tl.constexpr = GROUP_SIZE * BITS // 8
    INDEX_BYTES: tl.constexpr = NUM_GROUPS * GROUP_BYTES
    NB: tl.constexpr = BLOCK_GS // 8 * (BITS + (BITS == 3))

    o_r = i_r + tl.arange(0, BLOCK_ROWS)
    o_g = tl.arange(0, BLOCK_G)
    o_k = tl.arange(0, BLOCK_GS)
    m_r = o_r < n_rows
    m_x = m_r[:, None, None]
    m_s = m_r[:, None, None]
    if BLOCK_G != NUM_GROUPS:
        m_x = m_x & (o_g < NUM_GROUPS)[None, :, None]
        m_s = m_s & (o_g < NUM_GROUPS)[None, :, None]
    if BLOCK_GS != GROUP_SIZE:
        m_x = m_x & (o_k < GROUP_SIZE)[None, None, :]

    p_c, m_c = _code_lanes(codes + o_r[:, None] * stride_c + (o_g * GROUP_BYTES)[None, :], m_s, NB, BITS,
                           GROUP_BYTES, BLOCK_GS != GROUP_SIZE)
    b_p = tl.load(p_c, mask=m_c, other=0)  # [BLOCK_ROWS, BLOCK_G, NB]
    b_q = _unpack_rows(tl.reshape(b_p, [BLOCK_ROWS * BLOCK_G, NB]), BLOCK_GS, BITS)
    b_q = tl.reshape(b_q, [BLOCK_ROWS, BLOCK_G, BLOCK_GS]).to(tl.float32)

    p_s = codes + o_r[:, None, None] * stride_c + INDEX_BYTES + 2 * o_g[:, None] + tl.arange(0, 2)[None, :]
    b_s = _fp16_from_lanes(tl.load(p_s, mask=m_s, other=0))  # [BLOCK_ROWS, BLOCK_G]
    b_z = _fp16_from_lanes(tl.load(p_s + 2 * NUM_GROUPS, mask=m_s, other=0))
    b_y = b_q * b_s[:, :, None] + b_z[:, :, None]

    p_o = out + o_r[:, None, None] * stride_o + (o_g * GROUP_SIZE)[:, None] + o_k[None, :]
    tl.store(p_o, b_y.to(out.dtype.element_ty), mask=m_x)


@triton.jit
def affine_pack_token_kernel(
    # pointers
    x,  # [n_rows, dim] float, rows stride_x apart
    codes,  # [n_rows, code_bytes] uint8
    flags,  # [programs] int32 (written when CHECK)
    # sizes and strides
    n_rows,
    stride_x,
    stride_c,
    # settings
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_GS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    CHECK: tl.constexpr,
    WORDS: tl.constexpr,  # 3 bit: store 32-bit words (codes 4-byte aligned, groups of a power of two >= 32 codes)
):
    i_r = tl.program_id(0).to(tl.int64)
    _pack_token_rows(
        x, codes, flags + i_r, i_r * BLOCK_ROWS, n_rows, stride_x, stride_c,
        BITS, GROUP_SIZE, NUM_GROUPS, BLOCK_ROWS, BLOCK_GS, BLOCK_G, CHECK, WORDS,
    )  # fmt: skip


@triton.jit
def affine_unpack_token_kernel(
    # pointers
    codes,  # [n_rows, code_bytes] uint8
    out,  # [n_rows, dim] out_dtype
    # sizes and strides
    n_rows,
    stride_c,
    stride_o,
    # settings
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_GS: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    _unpack_token_rows(
        codes, out, i_r * BLOCK_ROWS, n_rows, stride_c, stride_o,
        BITS, GROUP_SIZE, NUM_GROUPS, BLOCK_ROWS, BLOCK_GS, BLOCK_G,
    )  # fmt: skip


# ----------------------------------------------------------------------------- mixed bits per head


@triton.jit
def affine_pack_mixed_kernel(
    # pointers
    x,  # [n_tokens, num_heads, dim] float, last dim contiguous
    codes,  # [n_tokens, bytes_per_token] uint8
    head_bits,  # [num_heads] int32
    head_offsets,  # [num_heads] int64: byte offset of a head's code in a token's row
    flags,  # [programs] int32 (written when CHECK)
    # sizes and strides
    n_tokens,
    num_heads,
    stride_x_t,
    stride_x_h,
    stride_c,  # bytes_per_token
    # settings
    GROUP_SIZE: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_GS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    ALIGN: tl.constexpr,  # every head offset is a multiple of ALIGN bytes (a power of two <= 16)
    CHECK: tl.constexpr,
):
    # one program: BLOCK_ROWS tokens of one head; heads vary fastest, so neighbouring programs
    # read neighbouring heads of the same tokens and write the same rows of codes
    i_p = tl.program_id(0).to(tl.int64)
    i_r, i_h = i_p // num_heads, i_p % num_heads
    b_bits = tl.load(head_bits + i_h)
    p_x = x + i_h * stride_x_h
    p_c = codes + tl.multiple_of(tl.load(head_offsets + i_h), ALIGN)
    o_r = i_r * BLOCK_ROWS
    # the width is uniform over the program: one branch runs, compiled for its constexpr BITS
    if b_bits == 2:
        _pack_token_rows(p_x, p_c, flags + i_p, o_r, n_tokens, stride_x_t, stride_c,
                         2, GROUP_SIZE, NUM_GROUPS, BLOCK_ROWS, BLOCK_GS, BLOCK_G, CHECK)  # fmt: skip
    elif b_bits == 3:
        _pack_token_rows(p_x, p_c, flags + i_p, o_r, n_tokens, stride_x_t, stride_c,
                         3, GROUP_SIZE, NUM_GROUPS, BLOCK_ROWS, BLOCK_GS, BLOCK_G, CHECK)  # fmt: skip
    elif b_bits == 4:
        _pack_token_rows(p_x, p_c, flags + i_p, o_r, n_tokens, stride_x_t, stride_c,
                         4, GROUP_SIZE, NUM_GROUPS, BLOCK_ROWS, BLOCK_GS, BLOCK_G, CHECK)  # fmt: skip
    else:
        _pack_token_rows(p_x, p_c, flags + i_p, o_r, n_tokens, stride_x_t, stride_c,
                         8, GROUP_SIZE, NUM_GROUPS, BLOCK_ROWS, BLOCK_GS, BLOCK_G, CHECK)  # fmt: skip


@triton.jit
def affine_unpack_mixed_kernel(
    # pointers
    codes,  # [n_tokens, bytes_per_token] uint8
    out,  # [n_tokens, num_heads, dim] out_dtype, contiguous
    head_bits,  # [num_heads] int32
    head_offsets,  # [num_heads] int64
    # sizes and strides
    n_tokens,
    num_heads,
    stride_c,
    stride_o_t,
    stride_o_h,
    # settings
    GROUP_SIZE: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_GS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    ALIGN: tl.constexpr,
):
    i_p = tl.program_id(0).to(tl.int64)
    i_r, i_h = i_p // num_heads, i_p % num_heads
    b_bits = tl.load(head_bits + i_h)
    p_c = codes + tl.multiple_of(tl.load(head_offsets + i_h), ALIGN)
    p_o = out + i_h * stride_o_h
    o_r = i_r * BLOCK_ROWS
    if b_bits == 2:
        _unpack_token_rows(p_c, p_o, o_r, n_tokens, stride_c, stride_o_t,
                           2, GROUP_SIZE, NUM_GROUPS, BLOCK_ROWS, BLOCK_GS, BLOCK_G)  # fmt: skip
    elif b_bits == 3:
        _unpack_token_rows(p_c, p_o, o_r, n_tokens, stride_c, stride_o_t,
                           3, GROUP_SIZE, NUM_GROUPS, BLOCK_ROWS, BLOCK_GS, BLOCK_G)  # fmt: skip
    elif b_bits == 4:
        _unpack_token_rows(p_c, p_o, o_r, n_tokens, stride_c, stride_o_t,
                           4, GROUP_SIZE, NUM_GROUPS, BLOCK_ROWS, BLOCK_GS, BLOCK_G)  # fmt: skip
    else:
        _unpack_token_rows(p_c, p_o, o_r, n_tokens, stride_c, stride_o_t,
                           8, GROUP_SIZE, NUM_GROUPS, BLOCK_ROWS, BLOCK_GS, BLOCK_G)  # fmt: skip


# ----------------------------------------------------------------------------- channel axis


@triton.jit
def affine_pack_channel_kernel(
    # pointers
    x,  # [n_codes * GROUP_SIZE, DIM] float, contiguous
    codes,  # [n_codes, GROUP_SIZE * ROW_BYTES + 4 * DIM] uint8
    flags,  # [programs] int32 (written when CHECK)
    # sizes
    n_codes,  # token groups: (product of leading dims) * tokens / GROUP_SIZE
    # settings
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_CODES: tl.constexpr,
    BLOCK_GS: tl.constexpr,  # GROUP_SIZE padded to a power of two
    BLOCK_D: tl.constexpr,  # DIM padded to a power of two
    CHECK: tl.constexpr,
):
    LEVELS: tl.constexpr = (1 << BITS) - 1
    ROW_BYTES: tl.constexpr = DIM * BITS // 8
    CODE_BYTES: tl.constexpr = GROUP_SIZE * ROW_BYTES + 4 * DIM
    NB: tl.constexpr = BLOCK_D // 8 * (BITS + (BITS == 3))  # packed lanes per token row

    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_CODES + tl.arange(0, BLOCK_CODES)
    o_t = tl.arange(0, BLOCK_GS)
    o_d = tl.arange(0, BLOCK_D)
    m_n = o_n < n_codes
    m_x = m_n[:, None, None]
    m_s = m_n[:, None, None]
    if BLOCK_GS != GROUP_SIZE:
        m_x = m_x & (o_t < GROUP_SIZE)[None, :, None]
    if BLOCK_D != DIM:
        m_x = m_x & (o_d < DIM)[None, None, :]
        m_s = m_s & (o_d < DIM)[None, :, None]

    p_x = x + (o_n * GROUP_SIZE * DIM)[:, None, None] + (o_t * DIM)[:, None] + o_d[None, :]
    b_x = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)  # [BLOCK_CODES, BLOCK_GS, BLOCK_D]

    # per-channel range over the group's tokens
    if BLOCK_GS != GROUP_SIZE:
        b_lo = tl.min(tl.where((o_t < GROUP_SIZE)[None, :, None], b_x, INF), axis=1)
        b_hi = tl.max(tl.where((o_t < GROUP_SIZE)[None, :, None], b_x, -INF), axis=1)
    else:
        b_lo = tl.min(b_x, axis=1)  # [BLOCK_CODES, BLOCK_D]
        b_hi = tl.max(b_x, axis=1)
    b_s16, b_s, b_inv = _scale_and_inverse(b_lo, b_hi, LEVELS)
    b_z16 = b_lo.to(tl.float16)
    b_z = b_z16.to(tl.float32)
    # floor(v) clamped to [0, LEVELS] equals v clamped then truncated: no separate floor.
    # Launched with enable_fp_fusion=False: the multiply and the add round separately, as in torch.
    b_q = (b_x - b_z[:, None, :]) * b_inv[:, None, :] + 0.5
    b_q = tl.clamp(b_q, 0.0, LEVELS * 1.0).to(tl.int32)

    # each token row packs along the channels: [BLOCK_CODES, BLOCK_GS, NB]
    b_p = tl.reshape(_pack_rows(tl.reshape(b_q, [BLOCK_CODES * BLOCK_GS, BLOCK_D]), BITS), [BLOCK_CODES, BLOCK_GS, NB])
    m_c = m_n[:, None, None]
    if BLOCK_GS != GROUP_SIZE:
        m_c = m_c & (o_t < GROUP_SIZE)[None, :, None]
    p_c, m_c = _code_lanes(codes + (o_n * CODE_BYTES)[:, None] + (o_t * ROW_BYTES)[None, :], m_c, NB, BITS,
                           ROW_BYTES, BLOCK_D != DIM)
    tl.store(p_c, b_p, mask=m_c)

    # DIM scales then DIM zeros, little-endian fp16: [BLOCK_CODES, BLOCK_D, 2]
    o_s = o_n * CODE_BYTES + GROUP_SIZE * ROW_BYTES  # first scale byte of each code
    p_s = codes + o_s[:, None, None] + 2 * o_d[:, None] + tl.arange(0, 2)[None, :]
    tl.store(p_s, _fp16_lanes(b_s16), mask=m_s)
    tl.store(p_s + 2 * DIM, _fp16_lanes(b_z16), mask=m_s)

    if CHECK:
        b_bad = tl.where(tl.abs(b_x) <= FP32_MAX, 0, FLAG_NONFINITE)
        b_ovf = tl.where((tl.abs(b_s) > FP16_MAX) | (tl.abs(b_z) > FP16_MAX), FLAG_OVERFLOW, 0)
        b_flag = tl.max(tl.max(tl.max(b_bad, axis=2), axis=1), axis=0) | tl.max(tl.max(b_ovf, axis=1), axis=0)
        tl.store(flags + i_n, b_flag)


@triton.jit
def affine_unpack_channel_kernel(
    # pointers
    codes,  # [n_codes, GROUP_SIZE * ROW_BYTES + 4 * DIM] uint8
    out,  # [n_codes * GROUP_SIZE, DIM] out_dtype, contiguous
    # sizes
    n_codes,
    # settings
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_CODES: tl.constexpr,
    BLOCK_GS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    ROW_BYTES: tl.constexpr = DIM * BITS // 8
    CODE_BYTES: tl.constexpr = GROUP_SIZE * ROW_BYTES + 4 * DIM
    NB: tl.constexpr = BLOCK_D // 8 * (BITS + (BITS == 3))

    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_CODES + tl.arange(0, BLOCK_CODES)
    o_t = tl.arange(0, BLOCK_GS)
    o_d = tl.arange(0, BLOCK_D)
    m_n = o_n < n_codes
    m_x = m_n[:, None, None]
    m_s = m_n[:, None, None]
    m_c = m_n[:, None, None]
    if BLOCK_GS != GROUP_SIZE:
        m_x = m_x & (o_t < GROUP_SIZE)[None, :, None]
        m_c = m_c & (o_t < GROUP_SIZE)[None, :, None]
    if BLOCK_D != DIM:
        m_x = m_x & (o_d < DIM)[None, None, :]
        m_s = m_s & (o_d < DIM)[None, :, None]

    p_c, m_c = _code_lanes(codes + (o_n * CODE_BYTES)[:, None] + (o_t * ROW_BYTES)[None, :], m_c, NB, BITS,
                           ROW_BYTES, BLOCK_D != DIM)
    b_p = tl.load(p_c, mask=m_c, other=0)  # [BLOCK_CODES, BLOCK_GS, NB]
    b_q = _unpack_rows(tl.reshape(b_p, [BLOCK_CODES * BLOCK_GS, NB]), BLOCK_D, BITS)
    b_q = tl.reshape(b_q, [BLOCK_CODES, BLOCK_GS, BLOCK_D]).to(tl.float32)

    o_s = o_n * CODE_BYTES + GROUP_SIZE * ROW_BYTES  # first scale byte of each code
    p_s = codes + o_s[:, None, None] + 2 * o_d[:, None] + tl.arange(0, 2)[None, :]
    b_s = _fp16_from_lanes(tl.load(p_s, mask=m_s, other=0))  # [BLOCK_CODES, BLOCK_D]
    b_z = _fp16_from_lanes(tl.load(p_s + 2 * DIM, mask=m_s, other=0))
    b_y = b_q * b_s[:, None, :] + b_z[:, None, :]

    p_o = out + (o_n * GROUP_SIZE * DIM)[:, None, None] + (o_t * DIM)[:, None] + o_d[None, :]
    tl.store(p_o, b_y.to(out.dtype.element_ty), mask=m_x)
