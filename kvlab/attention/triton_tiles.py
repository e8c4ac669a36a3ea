"""Triton device functions of the split decode loop that turn a tile of codes into fp16 values: the generic
MSE unpack (shift out each index, gather its centroid), the affine tiles (fp32, or fp16 pairs by inline PTX),
the fp16 norms. The ``prmt`` lookup of MSE tiles is shared with the MSE load (``kvlab._kernels.mse_tile``)."""

from __future__ import annotations

import triton
import triton.language as tl

from .._kernels.mse_tile import load_words as _load_words, pairs_to_tile as _pairs_to_tile


# Affine: fp16 pairs n s + z of a code word, without a conversion instruction: 0x6400 | n is the fp16
# 1024 + n (n < 1024 sits in the mantissa), so one subtraction gives n exactly and one fp16x2 multiply-add
# n s + z. Inputs: the word, then s and z as fp16 pairs (the same value twice).
# 4 bit: $0..$3 = (n_j, n_{j+4}) for j = 0..3 (nibble j at bits 4 j).
_AFFINE4 = tl.constexpr(
    "{\n.reg .b32 a, m;\nmov.b32 m, 0x64006400;\n"
    + "".join(f"shr.b32 a, $4, {4 * j};\nand.b32 a, a, 0x000F000F;\nor.b32 a, a, m;\nsub.rn.f16x2 a, a, m;\n"
              f"fma.rn.f16x2 ${j}, a, $5, $6;\n" for j in range(4))
    + "}")


# 8 bit: $0 = (n_0, n_1), $1 = (n_2, n_3) (byte j of the word): natural order.
_AFFINE8 = tl.constexpr("""{
.reg .b32 a, m, e;
mov.b32 e, 0x64646464;
mov.b32 m, 0x64006400;
prmt.b32 a, $2, e, 0x4140;
sub.rn.f16x2 a, a, m;
fma.rn.f16x2 $0, a, $3, $4;
prmt.b32 a, $2, e, 0x4342;
sub.rn.f16x2 a, a, m;
fma.rn.f16x2 $1, a, $3, $4;
}""")


@triton.jit
def _tile_coordinate(D: tl.constexpr, BITS: tl.constexpr):
    """The coordinate each tile position holds (``tile_order``), ``[D]``."""
    o_p = tl.arange(0, D)
    if BITS == 2:
        return (o_p // 16) * 16 + (o_p % 8) // 2 + 4 * (o_p % 2) + 8 * ((o_p % 16) // 8)
    else:
        return o_p


@triton.jit
def mse_bytes(cache_ptr, o_base, m_n, BN: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """For ``mse_tile_generic``: per tile position, the code's two bytes from the one holding its index
    (int32 ``[BN, D]``; the second is 0 past the code)."""
    o_byte = (_tile_coordinate(D, BITS) * BITS) // 8
    p = cache_ptr + o_base[:, None] + o_byte[None, :]
    m_hi = m_n[:, None] & ((o_byte + 1) < (D * BITS // 8))[None, :]
    return tl.load(p, mask=m_n[:, None], other=0).to(tl.int32) | (tl.load(p + 1, mask=m_hi, other=0).to(tl.int32) << 8)


@triton.jit
def mse_tile_generic(b_b, cent_ptr, BN: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """As ``_mse_tile_fast``, index by index (from ``mse_bytes``): shifts, then a gather from the centroid table."""
    o_bit = _tile_coordinate(D, BITS) * BITS
    b_i = (b_b >> (o_bit % 8)[None, :]) & ((1 << BITS) - 1)
    return tl.load(cent_ptr + b_i).to(tl.float16)  # [BN, D]


@triton.jit
def _affine_tile(cache_ptr, o_base, m_n, BN: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """Dequantized tile ``n s + z`` ``[BN, D]`` fp16 (natural order) of token-axis affine codes."""
    PER: tl.constexpr = 32 // BITS
    NG: tl.constexpr = D // GROUP
    b_w = _load_words(cache_ptr, o_base, tl.arange(0, D // PER), m_n, True)  # [BN, D/PER]
    o_k = tl.arange(0, PER) * BITS
    b_n = (b_w[:, :, None] >> o_k[None, None, :].to(tl.uint32)) & ((1 << BITS) - 1)
    # index -> fp32 without a conversion instruction: 2**23 + n has n in its low mantissa bits
    b_n = tl.reshape(b_n | 0x4B000000, [BN, D]).to(tl.float32, bitcast=True) - 8388608.0
    o_g = tl.arange(0, NG)
    p_s = (cache_ptr + o_base[:, None] + D * BITS // 8 + 2 * o_g[None, :]).to(tl.pointer_type(tl.uint16))
    b_s = tl.load(p_s, mask=m_n[:, None], other=0).to(tl.float16, bitcast=True).to(tl.float32)  # [BN, NG]
    b_z = tl.load(p_s + NG, mask=m_n[:, None], other=0).to(tl.float16, bitcast=True).to(tl.float32)
    b_s = tl.reshape(tl.broadcast_to(b_s[:, :, None], [BN, NG, GROUP]), [BN, D])
    b_z = tl.reshape(tl.broadcast_to(b_z[:, :, None], [BN, NG, GROUP]), [BN, D])
    return (b_n * b_s + b_z).to(tl.float16)


@triton.jit
def _affine_tile_fast(cache_ptr, o_base, m_n, BN: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """``_affine_tile`` by fp16-pair arithmetic (``_AFFINE4`` / ``_AFFINE8``), in the tile order of
    ``_affine_tile_order``: each word's scale and zero are read for that word (cached reads), so the
    tile needs no exchange between threads before its product."""
    PER: tl.constexpr = 32 // BITS
    NG: tl.constexpr = D // GROUP
    o_w = tl.arange(0, D // PER)
    b_w = _load_words(cache_ptr, o_base, o_w, m_n, True)  # [BN, W]
    p_s = (cache_ptr + o_base[:, None] + D * BITS // 8 + 2 * (o_w // (GROUP // PER))[None, :]).to(tl.pointer_type(tl.uint16))
    b_s = tl.load(p_s, mask=m_n[:, None], other=0).to(tl.uint32)  # [BN, W] the scale of each word's group
    b_z = tl.load(p_s + NG, mask=m_n[:, None], other=0).to(tl.uint32)
    b_s, b_z = b_s | (b_s << 16), b_z | (b_z << 16)  # fp16 pairs
    if BITS == 4:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(_AFFINE4, "=r,=r,=r,=r,r,r,r", [b_w, b_s, b_z],
                                                   dtype=(tl.int32,) * 4, is_pure=True, pack=1)
        return _pairs_to_tile((o0, o1, o2, o3), BN, D, 2)
    else:
        o0, o1 = tl.inline_asm_elementwise(_AFFINE8, "=r,=r,r,r,r", [b_w, b_s, b_z], dtype=(tl.int32,) * 2,
                                           is_pure=True, pack=1)
        return _pairs_to_tile((o0, o1), BN, D, 1)


@triton.jit
def affine_tile_any(cache_ptr, o_base, m_n, BN: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                     FAST: tl.constexpr):
    """``_affine_tile_fast`` (``FAST``) or ``_affine_tile``."""
    if FAST:
        return _affine_tile_fast(cache_ptr, o_base, m_n, BN, D, BITS, GROUP)
    else:
        return _affine_tile(cache_ptr, o_base, m_n, BN, D, BITS, GROUP)


@triton.jit
def load_norm(cache_ptr, o_at, m_n):
    """fp16 norm at byte ``o_at`` (2-byte aligned) of each row, as fp32 ``[BN]``; 0 where masked."""
    b = tl.load((cache_ptr + o_at).to(tl.pointer_type(tl.uint16)), mask=m_n, other=0)
    return b.to(tl.float16, bitcast=True).to(tl.float32)
