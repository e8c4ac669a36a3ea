"""Triton kernels for the affine codec: asymmetric min/max quantization with a fp16 scale and zero per group.

What
    The kernels behind ``kvlab.affine.api``'s launchers (which check, then launch them): ``encode_affine`` /
    ``decode_affine`` encode and decode exactly what ``kvlab.affine.reference.AffineCodec``
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
    instruction (``scale_and_inverse``): ``range / (2**bits - 1)`` is Brisebarre, Muller and Raina's
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
from .triton_bits import scale_and_inverse, code_lanes, store_words3, pack_rows, unpack_rows, fp16_lanes, fp16_from_lanes, INF


AXES = ("token", "channel")
FP32_MAX = tl.constexpr(3.4028234663852886e38)  # |x| <= FP32_MAX: finite (NaN compares false)
FP16_MAX = tl.constexpr(C.FP16_MAX)
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
    b_s16, b_s, b_inv = scale_and_inverse(b_lo, b_hi, LEVELS)
    b_z16 = tl.where(b_lo == 0.0, 0.0, b_lo).to(tl.float16)  # +0.0 for a minimum of -0.0, as the reference
    b_z = b_z16.to(tl.float32)
    # floor(v) clamped to [0, LEVELS] equals v clamped then truncated: no separate floor.
    # Launched with enable_fp_fusion=False: the multiply and the add round separately, as in torch.
    b_q = (b_x - b_z[:, :, None]) * b_inv[:, :, None] + 0.5
    b_q = tl.clamp(b_q, 0.0, LEVELS * 1.0).to(tl.int32)

    if BITS == 3 and WORDS:  # 32-bit stores, not bytes
        store_words3(codes + o_r[:, None, None] * stride_c + (o_g * GROUP_BYTES)[:, None], b_q, m_s,
                      BLOCK_ROWS, BLOCK_G, BLOCK_GS)
    else:
        # indices: [BLOCK_ROWS * BLOCK_G, BLOCK_GS] -> packed lanes [BLOCK_ROWS, BLOCK_G, NB]
        b_p = tl.reshape(pack_rows(tl.reshape(b_q, [BLOCK_ROWS * BLOCK_G, BLOCK_GS]), BITS), [BLOCK_ROWS, BLOCK_G, NB])
        p_c, m_c = code_lanes(codes + o_r[:, None] * stride_c + (o_g * GROUP_BYTES)[None, :], m_s, NB, BITS,
                               GROUP_BYTES, BLOCK_GS != GROUP_SIZE)
        tl.store(p_c, b_p, mask=m_c)

    # scales then zeros, little-endian fp16: [BLOCK_ROWS, BLOCK_G, 2]
    p_s = codes + o_r[:, None, None] * stride_c + INDEX_BYTES + 2 * o_g[:, None] + tl.arange(0, 2)[None, :]
    tl.store(p_s, fp16_lanes(b_s16), mask=m_s)
    tl.store(p_s + 2 * NUM_GROUPS, fp16_lanes(b_z16), mask=m_s)

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

    p_c, m_c = code_lanes(codes + o_r[:, None] * stride_c + (o_g * GROUP_BYTES)[None, :], m_s, NB, BITS,
                           GROUP_BYTES, BLOCK_GS != GROUP_SIZE)
    b_p = tl.load(p_c, mask=m_c, other=0)  # [BLOCK_ROWS, BLOCK_G, NB]
    b_q = unpack_rows(tl.reshape(b_p, [BLOCK_ROWS * BLOCK_G, NB]), BLOCK_GS, BITS)
    b_q = tl.reshape(b_q, [BLOCK_ROWS, BLOCK_G, BLOCK_GS]).to(tl.float32)

    p_s = codes + o_r[:, None, None] * stride_c + INDEX_BYTES + 2 * o_g[:, None] + tl.arange(0, 2)[None, :]
    b_s = fp16_from_lanes(tl.load(p_s, mask=m_s, other=0))  # [BLOCK_ROWS, BLOCK_G]
    b_z = fp16_from_lanes(tl.load(p_s + 2 * NUM_GROUPS, mask=m_s, other=0))
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
    b_s16, b_s, b_inv = scale_and_inverse(b_lo, b_hi, LEVELS)
    b_z16 = tl.where(b_lo == 0.0, 0.0, b_lo).to(tl.float16)  # +0.0 for a minimum of -0.0, as the reference
    b_z = b_z16.to(tl.float32)
    # floor(v) clamped to [0, LEVELS] equals v clamped then truncated: no separate floor.
    # Launched with enable_fp_fusion=False: the multiply and the add round separately, as in torch.
    b_q = (b_x - b_z[:, None, :]) * b_inv[:, None, :] + 0.5
    b_q = tl.clamp(b_q, 0.0, LEVELS * 1.0).to(tl.int32)

    # each token row packs along the channels: [BLOCK_CODES, BLOCK_GS, NB]
    b_p = tl.reshape(pack_rows(tl.reshape(b_q, [BLOCK_CODES * BLOCK_GS, BLOCK_D]), BITS), [BLOCK_CODES, BLOCK_GS, NB])
    m_c = m_n[:, None, None]
    if BLOCK_GS != GROUP_SIZE:
        m_c = m_c & (o_t < GROUP_SIZE)[None, :, None]
    p_c, m_c = code_lanes(codes + (o_n * CODE_BYTES)[:, None] + (o_t * ROW_BYTES)[None, :], m_c, NB, BITS,
                           ROW_BYTES, BLOCK_D != DIM)
    tl.store(p_c, b_p, mask=m_c)

    # DIM scales then DIM zeros, little-endian fp16: [BLOCK_CODES, BLOCK_D, 2]
    o_s = o_n * CODE_BYTES + GROUP_SIZE * ROW_BYTES  # first scale byte of each code
    p_s = codes + o_s[:, None, None] + 2 * o_d[:, None] + tl.arange(0, 2)[None, :]
    tl.store(p_s, fp16_lanes(b_s16), mask=m_s)
    tl.store(p_s + 2 * DIM, fp16_lanes(b_z16), mask=m_s)

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

    p_c, m_c = code_lanes(codes + (o_n * CODE_BYTES)[:, None] + (o_t * ROW_BYTES)[None, :], m_c, NB, BITS,
                           ROW_BYTES, BLOCK_D != DIM)
    b_p = tl.load(p_c, mask=m_c, other=0)  # [BLOCK_CODES, BLOCK_GS, NB]
    b_q = unpack_rows(tl.reshape(b_p, [BLOCK_CODES * BLOCK_GS, NB]), BLOCK_D, BITS)
    b_q = tl.reshape(b_q, [BLOCK_CODES, BLOCK_GS, BLOCK_D]).to(tl.float32)

    o_s = o_n * CODE_BYTES + GROUP_SIZE * ROW_BYTES  # first scale byte of each code
    p_s = codes + o_s[:, None, None] + 2 * o_d[:, None] + tl.arange(0, 2)[None, :]
    b_s = fp16_from_lanes(tl.load(p_s, mask=m_s, other=0))  # [BLOCK_CODES, BLOCK_D]
    b_z = fp16_from_lanes(tl.load(p_s + 2 * DIM, mask=m_s, other=0))
    b_y = b_q * b_s[:, None, :] + b_z[:, None, :]

    p_o = out + (o_n * GROUP_SIZE * DIM)[:, None, None] + (o_t * DIM)[:, None] + o_d[None, :]
    tl.store(p_o, b_y.to(out.dtype.element_ty), mask=m_x)
