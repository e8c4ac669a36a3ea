"""Fused decode attention over kvlab's quantized paged KV cache: ``decode_attention``.

What
    One new query token per sequence attends over its cached keys and values, read straight from the
    packed paged cache: ``out[b, i] = softmax(scale * q[b, i] . K[b, :seq_lens[b], h(i)]) @ V[...]``
    with ``h(i) = i // (num_q_heads / num_kv_heads)`` (grouped-query attention). Two codecs share the
    entry point, so that they can be timed side by side:

    * MSE (``kvlab.MSECodec`` keys and values, 2, 3 or 4 bits each): the cache of ``kvlab.layout``,
      exactly what ``store_mse`` writes. Attention runs in rotated space throughout. With ``y = x R``
      the rotation, a key decodes to ``k R = s_k c[i_k]`` (``c`` the Lloyd-Max centroids, ``s_k`` the
      stored fp16 scale, which holds the norm correction ``|y_k| / |c[i_k]|``), so

      .. math:: q \\cdot k = (q R_K) \\cdot (k R_K) = s_k \\sum_j (q R_K)_j\\, c[i_{k,j}],

      and ``sum_t p_t v_t = (sum_t p_t s_t c[i_t]) R_V^T``. The query is rotated once
      (one matrix product for the batch, ``_rotate_rows``), every score is a dot of the rotated query with the *unscaled*
      centroids of a key times one per-token factor, every value enters with its scale folded
      into the attention weight, and the output is rotated back once at the end
      (``rotate_attention_output``). No cached vector is ever rotated.
    * Centred MSE keys (``kvlab.CenteredMSECodec``: ``k = scale * z + mean_n``, ``z`` stored with the MSE
      codec in the same slot) with MSE values: ``q . k = (q * scale) . z + q . mean_n``. The query is
      scaled before its rotation; with RoPE the second term turns with the position and is added per
      key from ``rope_mean_scores`` (one product per call against a per-position cos/sin table); without
      RoPE it is the same for every key and the softmax drops it.
    * Affine (``kvlab.AffineCodec(bits, group_size, axis="token")`` keys and values, 4 or 8 bits):
      the paged affine layout below. Dequantization ``x_j = n_j s_g + z_g`` is linear in the index
      ``n``; the kernel forms ``n s + z`` per group tile and runs the same loop (no rotation). By
      default in fp32; with ``fast=True`` in fp16 pairs (``_AFFINE4``, ``_AFFINE8``): ``0x6400 | n`` is the
      fp16 ``1024 + n``, so a subtraction and an fp16x2 multiply-add give ``n s + z``. At 4 bits that
      tile holds, at position ``2 j + h`` of each 8, coordinate ``j + 4 h`` (``_affine_tile_order``); the
      query is permuted to match and the output put back, as for the MSE tiles.

    Split-KV (flash-decoding): the keys of a sequence are cut into ``num_splits`` ranges; one program
    per (sequence, KV head, range) computes an unnormalised partial output with its running maximum and
    sum (base-2 online softmax), and a second kernel merges the ranges with a log-sum-exp reduction.
    Two loops compute the partial outputs: for MSE keys and values of 2, 3 or 4 bits on a GPU (dim 64 or
    128; 2-bit values and 3-bit keys or values at 128; at most 16 query heads per KV head) by default the one of ``kvlab.attention.gluon`` (Gluon: every tile is
    dequantized in the register layout of an ``mma.sync`` operand, none goes through shared memory),
    otherwise the split loop below (``_decode_split_kernel``); ``mma=`` chooses.

    ``prefill_attention`` is the continuation-prefill path (several new tokens per sequence whose keys
    and values are already in the cache): it materialises model-space K/V of the whole context, the
    inverse rotation as a batched matrix product (``load_mse(space="model")``), and runs torch SDPA.

Layouts
    MSE: ``kvlab.layout`` (one uint8 cache ``[num_blocks, block_size, num_kv_heads, slot_bytes]``, a
    slot of one head is ``key indices | key norm | value indices | value norm``).

    Paged affine cache (``AffineSlot``): one uint8 tensor ``[num_blocks, block_size, num_kv_heads,
    slot_bytes]``; token ``t`` of sequence ``b`` lives in block ``block_table[b, t // block_size]`` at
    position ``t % block_size``, and one slot of one head holds the token-axis affine codes of its key
    and of its value, back to back::

        key indices | key scales | key zeros | value indices | value scales | value zeros

    each part exactly ``AffineCodec(bits, group_size, "token").encode(x)`` (indices packed as
    ``kvlab.layout`` states, then ``dim / group_size`` fp16 scales, then as many fp16 zeros). Key and
    value bits may differ; both use the same ``group_size``. ``kvlab.reference.write_affine_slots``
    writes it; ``store_affine_slots`` does the same with the ``pack_affine`` kernel.

    Both caches: ``block_table`` int32 ``[batch, max_blocks]`` maps logical to physical blocks (entries
    past a sequence's last block are never read), ``seq_lens`` ``[batch]`` counts each sequence's cached
    tokens (1 .. ``max_blocks * block_size``).

How, the split loop (one program: a sequence, a KV head, a range of keys; ``BLOCK_N`` keys per step)
    * The query group of a KV head (``num_q_heads / num_kv_heads`` rows) is padded to 16 rows, so that
      each dequantized ``[BLOCK_N, dim]`` tile feeds one ``tl.dot`` for the scores and one for the
      output, shared by the whole group. ``keys_as_rows=True`` computes the transposed products
      instead (``K q^T``, ``V^T P^T``): their rows are the ``BLOCK_N`` keys and the ``dim`` coordinates,
      64 or more, so that on Hopper they run as warpgroup MMAs; the score tile and the running output
      are then carried transposed.
    * Bytes are read as 32-bit words, a warp's lanes along each code (value codes start 2 bytes past
      a word boundary: the two aligned words around each code word are read and the middle 32 bits
      kept). The centroid lookup is a byte permute (``prmt``, inline PTX): the fp16 centroids are held
      as byte planes in registers (low bytes of the table in two registers, high bytes in two), one
      ``prmt`` looks up four 3-bit indices, two more interleave low and high bytes into fp16 pairs.
      4-bit: the codebook is symmetric and the codes sign-magnitude (``kvlab.layout``), so a code's low
      3 bits index 8 fp16 magnitudes and a sign-replicating ``prmt`` puts its top bit on the sign.
      3-bit: three shift-and-mask steps spread eight 3-bit fields of a 24-bit group into nibbles. 2-bit: four centroids are one 8-byte
      table, so one ``prmt`` turns two indices into an fp16 pair (selector ``2 i * 0x11 + 0x10`` per
      index, one multiply-add for two indices). No per-element gather, shift or conversion, and no
      per-key reduction: the norm correction is in the stored scale.
    * Coordinate order inside a tile is the order those lookups produce: natural for 3 and 4 bits;
      for 2 bits, position ``2 k + h`` of each 16 holds coordinate ``k % 4 + 4 h + 8 (k // 4)``. The
      query's rotated coordinates are permuted to match (``tile_order``) and the output's are put back
      by the merge kernel, so the order is invisible outside.
    * Without a GPU (Triton's interpreter) and with ``fast=False`` the kernel unpacks each index with
      shifts and gathers its centroid from the table instead: same tile order, same result up to fp16
      rounding. (The interpreter cannot run inline PTX; kvlab's tests give it an emulator of these few
      instructions, ``tests/ptx.py``, and run the lookup path on the CPU too.)
    * Code words are addressed as 32-bit pointers plus a word index, so the compiler sees each row's
      words as contiguous and a warp's lanes read along rows (2-byte halves of the value codes, read
      before, put a warp's lanes on 32 keys, a sector each).
    * A step is a read (``_fetch_tile``: block-table entries, code words, norms) and the arithmetic on
      it (``_attend_mse``); ``prefetch=True`` issues step ``i + 1``'s read before step ``i``'s arithmetic.

Reference
    ``kvlab.reference.decode_attention_reference`` / ``prefill_attention_reference``: fp32 attention
    over the cache dequantized by the reference codecs (this module does not import them);
    ``tests/ops/test_attention.py`` compares the two.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _checks as C
from . import gluon as decode_mma
from ..affine.triton import affine_code_bytes, pack_affine, unpack_affine
from ..params import AffineParams, CenteredParams, MSEParams
from ..layout import ATTENTION_AFFINE_BITS as AFFINE_BITS, HEAD_DIMS as DIMS, MSE_BITS, NORM_BYTES, MSESlot, packed_bytes
from ..centered.api import load_centered_mse
from .._kernels import tables as T  # per-codec device tables (rebuilt when the codec's tensors change), SMs
from .._kernels.mse_tile import load_words as _load_words, mse_tile_fast as _mse_tile_fast, mse_words as _mse_words, pairs_to_tile as _pairs_to_tile
from .._kernels.tables import tile_order
from ..mse.api import load_mse

__all__ = [
    "AffineSlot",
    "decode_attention",
    "rope_mean_scores",
    "prefill_attention",
    "rotate_attention_output",
    "store_affine_slots",
    "tile_order",
]

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # default: a split covers at least this many keys
PROGRAMS_PER_SM = 16  # default number of splits: about this many programs per SM
NEG_BIG = tl.constexpr(-1.0e30)  # running maximum before any key (finite: no inf - inf)


@dataclass(frozen=True)
class AffineSlot:
    """Offsets inside one ``[key code | value code]`` slot of the paged affine cache (token-axis codes)."""

    dim: int
    key_bits: int
    value_bits: int
    group_size: int

    @property
    def key_code_bytes(self) -> int:
        return affine_code_bytes(self.dim, self.key_bits, self.group_size, "token")

    @property
    def value_code_bytes(self) -> int:
        return affine_code_bytes(self.dim, self.value_bits, self.group_size, "token")

    @property
    def value_offset(self) -> int:
        return self.key_code_bytes

    @property
    def slot_bytes(self) -> int:
        return self.key_code_bytes + self.value_code_bytes


# ----------------------------------------------------------------------------- lookups (inline PTX)

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
def _mse_bytes(cache_ptr, o_base, m_n, BN: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """For ``_mse_tile_generic``: per tile position, the code's two bytes from the one holding its index
    (int32 ``[BN, D]``; the second is 0 past the code)."""
    o_byte = (_tile_coordinate(D, BITS) * BITS) // 8
    p = cache_ptr + o_base[:, None] + o_byte[None, :]
    m_hi = m_n[:, None] & ((o_byte + 1) < (D * BITS // 8))[None, :]
    return tl.load(p, mask=m_n[:, None], other=0).to(tl.int32) | (tl.load(p + 1, mask=m_hi, other=0).to(tl.int32) << 8)


@triton.jit
def _mse_tile_generic(b_b, cent_ptr, BN: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """As ``_mse_tile_fast``, index by index (from ``_mse_bytes``): shifts, then a gather from the centroid table."""
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
def _affine_tile_any(cache_ptr, o_base, m_n, BN: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                     FAST: tl.constexpr):
    """``_affine_tile_fast`` (``FAST``) or ``_affine_tile``."""
    if FAST:
        return _affine_tile_fast(cache_ptr, o_base, m_n, BN, D, BITS, GROUP)
    else:
        return _affine_tile(cache_ptr, o_base, m_n, BN, D, BITS, GROUP)


@triton.jit
def _load_norm(cache_ptr, o_at, m_n):
    """fp16 norm at byte ``o_at`` (2-byte aligned) of each row, as fp32 ``[BN]``; 0 where masked."""
    b = tl.load((cache_ptr + o_at).to(tl.pointer_type(tl.uint16)), mask=m_n, other=0)
    return b.to(tl.float16, bitcast=True).to(tl.float32)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _slot_offsets(block_table_ptr, o_n, end, i_b, i_h, stride_bt, stride_block, stride_pos, stride_head, num_blocks,
                  BLOCK_SIZE: tl.constexpr):
    """Keys ``o_n`` of sequence ``i_b`` -> (valid below ``end``, byte offset of each one's slot of KV head
    ``i_h`` in the cache, int64), through the block table."""
    m_n = o_n < end
    b_blk = tl.load(block_table_ptr + i_b * stride_bt + o_n // BLOCK_SIZE, mask=m_n, other=0).to(tl.int64)
    b_blk = tl.minimum(tl.maximum(b_blk, 0), num_blocks - 1)  # unchecked tables: never outside the cache
    return m_n, b_blk * stride_block + (o_n % BLOCK_SIZE) * stride_pos + i_h * stride_head


@triton.jit
def _fetch_tile(
    cache_ptr, block_table_ptr, o_n, end, i_b, i_h, stride_bt, stride_block, stride_pos, stride_head, num_blocks, q_unscale,
    BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr,
    KEY_NORM_OFFSET: tl.constexpr, VALUE_OFFSET: tl.constexpr, VALUE_NORM_OFFSET: tl.constexpr,
    VALUE_ALIGN4: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
):
    """The memory reads of one MSE step: keys ``o_n`` ([BLOCK_N] positions, valid below ``end``) ->
    key words (3), key norms, value words (3), value norms, as ``_attend_mse`` takes them."""
    m_n, o_slot = _slot_offsets(block_table_ptr, o_n, end, i_b, i_h, stride_bt, stride_block, stride_pos, stride_head,
                                num_blocks, BLOCK_SIZE)
    if FAST:
        k0, k1, k2 = _mse_words(cache_ptr, o_slot, m_n, BLOCK_N, D, BITS_K, True)
        v0, v1, v2 = _mse_words(cache_ptr, o_slot + VALUE_OFFSET, m_n, BLOCK_N, D, BITS_V, VALUE_ALIGN4)
    else:
        b_none = tl.zeros([BLOCK_N, 1], dtype=tl.int32)
        k0, k1, k2 = _mse_bytes(cache_ptr, o_slot, m_n, BLOCK_N, D, BITS_K), b_none, b_none
        v0, v1, v2 = _mse_bytes(cache_ptr, o_slot + VALUE_OFFSET, m_n, BLOCK_N, D, BITS_V), b_none, b_none
    b_kn = _load_norm(cache_ptr, o_slot + KEY_NORM_OFFSET, m_n) * q_unscale
    b_vn = _load_norm(cache_ptr, o_slot + VALUE_NORM_OFFSET, m_n)
    return k0, k1, k2, b_kn, v0, v1, v2, b_vn


@triton.jit
def _per_key(x, KEYS_AS_ROWS: tl.constexpr):
    """A ``[BN]`` vector (one value per key) broadcast along the score tile's key axis."""
    if KEYS_AS_ROWS:
        return x[:, None]
    else:
        return x[None, :]


@triton.jit
def _per_query(x, KEYS_AS_ROWS: tl.constexpr):
    """A ``[BG]`` vector (one value per query row) broadcast along the score tile's query axis."""
    if KEYS_AS_ROWS:
        return x[None, :]
    else:
        return x[:, None]


@triton.jit
def _scores(b_q, b_k, KEYS_AS_ROWS: tl.constexpr):
    """``q K^T`` ``[BG, BN]``, or with ``KEYS_AS_ROWS`` its transpose ``K q^T`` ``[BN, BG]``."""
    if KEYS_AS_ROWS:
        return tl.dot(b_k, tl.trans(b_q))
    else:
        return tl.dot(b_q, tl.trans(b_k))


@triton.jit
def _softmax_step(b_s, b_m, b_l, KEYS_AS_ROWS: tl.constexpr):
    """Online softmax (base 2: log2(e) is folded into q): new maximum, rescale factor, weights, sum."""
    AXIS: tl.constexpr = 0 if KEYS_AS_ROWS else 1
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=AXIS))
    b_alpha = tl.math.exp2(b_m - b_m_new)
    b_p = tl.math.exp2(b_s - _per_query(b_m_new, KEYS_AS_ROWS))  # the shape of b_s
    return b_m_new, b_alpha, b_p, b_l * b_alpha + tl.sum(b_p, axis=AXIS)


@triton.jit
def _accumulate(b_acc, b_alpha, b_p, b_v, KEYS_AS_ROWS: tl.constexpr):
    """``acc alpha + P V`` (``[BG, D]``), or with ``KEYS_AS_ROWS`` its transpose ``acc alpha + V^T P^T`` (``[D, BG]``)."""
    if KEYS_AS_ROWS:
        return b_acc * b_alpha[None, :] + tl.dot(tl.trans(b_v), b_p.to(tl.float16))
    else:
        return b_acc * b_alpha[:, None] + tl.dot(b_p.to(tl.float16), b_v)


@triton.jit
def _attend_mse(
    key_cent_ptr, value_cent_ptr, b_q, b_m, b_l, b_acc, k0, k1, k2, b_kn, v0, v1, v2, b_vn,
    tk0, tk1, tk2, tk3, tv0, tv1, tv2, tv3, o_n, end, bias_ptr, o_bias, m_g,
    D: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
    HAS_BIAS: tl.constexpr, KEYS_AS_ROWS: tl.constexpr,
):
    """The arithmetic of one MSE step, on what ``_fetch_tile`` read: update the running maximum ``b_m``,
    sum ``b_l`` and output ``b_acc`` of the query group ``b_q`` (``HAS_BIAS``: plus a per-row,
    per-position score term read at ``bias_ptr + o_bias[row] + position``; ``KEYS_AS_ROWS``: the
    score tile and ``b_acc`` are transposed)."""
    m_n = o_n < end
    # ---- scores: the rotated query against the centroids, times each key's stored scale
    if FAST:
        b_k = _mse_tile_fast(k0, k1, k2, tk0, tk1, tk2, tk3, BLOCK_N, D, BITS_K)
    else:
        b_k = _mse_tile_generic(k0, key_cent_ptr, BLOCK_N, D, BITS_K)
    b_s = _scores(b_q, b_k, KEYS_AS_ROWS) * _per_key(b_kn, KEYS_AS_ROWS)
    if HAS_BIAS:  # centred keys with a turning mean: q . RoPE_n(mean), one fp32 per query row and position
        b_s += tl.load(bias_ptr + _per_query(o_bias, KEYS_AS_ROWS) + _per_key(o_n, KEYS_AS_ROWS),
                       mask=_per_query(m_g, KEYS_AS_ROWS) & _per_key(m_n, KEYS_AS_ROWS), other=0.0)
    b_s = tl.where(_per_key(m_n, KEYS_AS_ROWS), b_s, float("-inf"))
    b_m, b_alpha, b_p, b_l = _softmax_step(b_s, b_m, b_l, KEYS_AS_ROWS)

    # ---- values: the scale rides on the weight
    if FAST:
        b_v = _mse_tile_fast(v0, v1, v2, tv0, tv1, tv2, tv3, BLOCK_N, D, BITS_V)
    else:
        b_v = _mse_tile_generic(v0, value_cent_ptr, BLOCK_N, D, BITS_V)
    b_acc = _accumulate(b_acc, b_alpha, b_p * _per_key(b_vn, KEYS_AS_ROWS), b_v, KEYS_AS_ROWS)
    return b_m, b_l, b_acc


@triton.jit
def _mse_step(
    cache_ptr, block_table_ptr, key_cent_ptr, value_cent_ptr, b_q, b_m, b_l, b_acc, k0, k1, k2, b_kn, v0, v1, v2, b_vn,
    tk0, tk1, tk2, tk3, tv0, tv1, tv2, tv3, n0, end, i_b, i_h, stride_bt, stride_block, stride_pos, stride_head, num_blocks, q_unscale,
    bias_ptr, o_bias, m_g, BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr,
    KEY_NORM_OFFSET: tl.constexpr, VALUE_OFFSET: tl.constexpr, VALUE_NORM_OFFSET: tl.constexpr, VALUE_ALIGN4: tl.constexpr,
    BLOCK_N: tl.constexpr, FAST: tl.constexpr, HAS_BIAS: tl.constexpr, PREFETCH: tl.constexpr, KEYS_AS_ROWS: tl.constexpr,
):
    """The MSE step at keys ``n0 .. n0 + BLOCK_N``. ``PREFETCH``: attend over the reads passed in (this
    step's), after issuing the next step's, which it returns; else read this step's and attend (the
    reads passed in are not used; the ones returned are this step's)."""
    o_nb = tl.arange(0, BLOCK_N)
    nk0, nk1, nk2, n_kn, nv0, nv1, nv2, n_vn = _fetch_tile(
        cache_ptr, block_table_ptr, n0 + PREFETCH * BLOCK_N + o_nb, end, i_b, i_h, stride_bt, stride_block, stride_pos,
        stride_head, num_blocks, q_unscale, BLOCK_SIZE, D, BITS_K, BITS_V, KEY_NORM_OFFSET, VALUE_OFFSET, VALUE_NORM_OFFSET, VALUE_ALIGN4, BLOCK_N, FAST)
    if not PREFETCH:
        k0, k1, k2, b_kn, v0, v1, v2, b_vn = nk0, nk1, nk2, n_kn, nv0, nv1, nv2, n_vn
    b_m, b_l, b_acc = _attend_mse(
        key_cent_ptr, value_cent_ptr, b_q, b_m, b_l, b_acc, k0, k1, k2, b_kn, v0, v1, v2, b_vn,
        tk0, tk1, tk2, tk3, tv0, tv1, tv2, tv3, n0 + o_nb, end, bias_ptr, o_bias, m_g, D, BITS_K, BITS_V, BLOCK_N, FAST, HAS_BIAS,
        KEYS_AS_ROWS)
    return b_m, b_l, b_acc, nk0, nk1, nk2, n_kn, nv0, nv1, nv2, n_vn


@triton.jit
def _attend_affine(
    cache_ptr, block_table_ptr, b_q, b_m, b_l, b_acc, o_n, end, i_b, i_h, stride_bt, stride_block, stride_pos, stride_head, num_blocks, q_unscale,
    BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr, GROUP: tl.constexpr,
    VALUE_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, KEYS_AS_ROWS: tl.constexpr, FAST: tl.constexpr,
):
    """One step over token-axis affine codes: dequantize ``n s + z`` per group tile, then the same update
    (``FAST``: in fp16 pairs, ``_affine_tile_fast``)."""
    m_n, o_slot = _slot_offsets(block_table_ptr, o_n, end, i_b, i_h, stride_bt, stride_block, stride_pos, stride_head,
                                num_blocks, BLOCK_SIZE)
    b_k = _affine_tile_any(cache_ptr, o_slot, m_n, BLOCK_N, D, BITS_K, GROUP, FAST)
    b_s = tl.where(_per_key(m_n, KEYS_AS_ROWS), _scores(b_q, b_k, KEYS_AS_ROWS) * q_unscale, float("-inf"))
    b_m, b_alpha, b_p, b_l = _softmax_step(b_s, b_m, b_l, KEYS_AS_ROWS)
    b_v = _affine_tile_any(cache_ptr, o_slot + VALUE_OFFSET, m_n, BLOCK_N, D, BITS_V, GROUP, FAST)
    b_acc = _accumulate(b_acc, b_alpha, b_p, b_v, KEYS_AS_ROWS)
    return b_m, b_l, b_acc


@triton.jit
def _decode_split_kernel(
    # pointers
    q_ptr,  # fp16 [batch, HQ, D]: rotated, in the key tile order, times scale * log2(e)
    cache_ptr,  # uint8 [num_blocks, block_size, HKV, slot_bytes], last dim contiguous
    block_table_ptr,  # int32 [batch, max_blocks]
    seq_lens_ptr,  # int32/int64 [batch]
    key_cent_ptr,  # fp32 [2**BITS_K]: key centroids (generic MSE path)
    value_cent_ptr,  # fp32 [2**BITS_V]
    o_part_ptr,  # fp32 [batch, HQ, num_splits, D]: unnormalised partial outputs (value tile order)
    ml_part_ptr,  # fp32 [batch, HQ, num_splits, 2]: running maximum (base 2) and sum
    bias_ptr,  # fp32 [batch, HQ, stride_bias] (HAS_BIAS): score term per query row and key position
    # byte-plane tables of the fp16 centroids (fast MSE path)
    tk0, tk1, tk2, tk3, tv0, tv1, tv2, tv3,
    # sizes and strides
    split_len,  # keys per split, a multiple of BLOCK_N
    num_splits,
    stride_bt,
    stride_block,
    stride_pos,
    stride_head,
    stride_bias,
    num_blocks,  # the cache's blocks: block-table entries are clamped into [0, num_blocks) (unchecked calls)
    capacity,  # max_blocks * BLOCK_SIZE: lengths are clamped into [0, capacity] (unchecked calls)
    q_unscale,  # the query was divided by this power of two to fit fp16 (1.0 unless it would overflow): scores times it
    # settings
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (compile-time: position -> block is a shift)
    D: tl.constexpr,
    AFFINE: tl.constexpr,
    BITS_K: tl.constexpr,
    BITS_V: tl.constexpr,
    GROUP: tl.constexpr,  # affine group size
    KEY_NORM_OFFSET: tl.constexpr,  # MSE: byte of the key norm in a slot
    VALUE_OFFSET: tl.constexpr,  # byte of the value code in a slot
    VALUE_NORM_OFFSET: tl.constexpr,  # MSE: byte of the value norm
    VALUE_ALIGN4: tl.constexpr,  # the value code starts 4-byte aligned
    BLOCK_G: tl.constexpr,  # query rows per program: the group, padded to 16
    BLOCK_N: tl.constexpr,
    FAST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PREFETCH: tl.constexpr,  # MSE: issue the next step's reads before this step's arithmetic
    KEYS_AS_ROWS: tl.constexpr,  # scores and output transposed (keys, dims as MMA rows: M = BLOCK_N, D)
    INTERPRETED: tl.constexpr,
    SPLIT_STEPS: tl.constexpr,  # interpreter only: split_len // BLOCK_N
):
    G: tl.constexpr = HQ // HKV
    i_bh = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // HKV, i_bh % HKV
    seq_len = tl.load(seq_lens_ptr + i_b).to(tl.int32)  # positions are int32, addresses int64
    seq_len = tl.minimum(tl.maximum(seq_len, 0), capacity)  # unchecked lengths: never past the block table
    start = i_s.to(tl.int32) * split_len
    end = tl.minimum(start + split_len, seq_len)

    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, D)
    m_g = o_g < G
    o_q = (i_b * HQ + i_h * G + o_g).to(tl.int64)  # [BG] query rows of this KV head
    b_q = tl.load(q_ptr + o_q[:, None] * D + o_d[None, :], mask=m_g[:, None], other=0.0)  # [BG, D] fp16
    o_bias = o_q * stride_bias  # [BG] first bias of each query row (HAS_BIAS)

    b_m = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    b_l = tl.zeros([BLOCK_G], dtype=tl.float32)
    if KEYS_AS_ROWS:
        b_acc = tl.zeros([D, BLOCK_G], dtype=tl.float32)  # transposed
    else:
        b_acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    o_nb = tl.arange(0, BLOCK_N)
    # The interpreter needs a trip count it can read: there, steps run over SPLIT_STEPS and do nothing past the end.
    if AFFINE:
        if INTERPRETED:
            for it in range(0, SPLIT_STEPS):
                if start + it * BLOCK_N < end:
                    b_m, b_l, b_acc = _attend_affine(
                        cache_ptr, block_table_ptr, b_q, b_m, b_l, b_acc, start + it * BLOCK_N + o_nb, end, i_b, i_h,
                        stride_bt, stride_block, stride_pos, stride_head, num_blocks, q_unscale, BLOCK_SIZE, D, BITS_K, BITS_V, GROUP, VALUE_OFFSET, BLOCK_N,
                        KEYS_AS_ROWS, FAST)
        else:
            for n0 in range(start, end, BLOCK_N):
                b_m, b_l, b_acc = _attend_affine(
                    cache_ptr, block_table_ptr, b_q, b_m, b_l, b_acc, n0 + o_nb, end, i_b, i_h,
                    stride_bt, stride_block, stride_pos, stride_head, num_blocks, q_unscale, BLOCK_SIZE, D, BITS_K, BITS_V, GROUP, VALUE_OFFSET, BLOCK_N,
                    KEYS_AS_ROWS, FAST)
    else:
        # PREFETCH: software pipelining, the reads of step i + 1 are issued before the arithmetic of step i
        # (the loop carries them); without, every step reads its own (the loop carries nothing more).
        b_none = tl.zeros([BLOCK_N, 1], dtype=tl.int32)
        k0, k1, k2, b_kn, v0, v1, v2, b_vn = b_none, b_none, b_none, b_none, b_none, b_none, b_none, b_none
        if PREFETCH:
            k0, k1, k2, b_kn, v0, v1, v2, b_vn = _fetch_tile(
                cache_ptr, block_table_ptr, start + o_nb, end, i_b, i_h, stride_bt, stride_block, stride_pos, stride_head, num_blocks, q_unscale,
                BLOCK_SIZE, D, BITS_K, BITS_V, KEY_NORM_OFFSET, VALUE_OFFSET, VALUE_NORM_OFFSET, VALUE_ALIGN4, BLOCK_N, FAST)
        if INTERPRETED:
            for it in range(0, SPLIT_STEPS):
                if start + it * BLOCK_N < end:
                    b_m, b_l, b_acc, nk0, nk1, nk2, n_kn, nv0, nv1, nv2, n_vn = _mse_step(
                        cache_ptr, block_table_ptr, key_cent_ptr, value_cent_ptr, b_q, b_m, b_l, b_acc, k0, k1, k2, b_kn, v0, v1,
                        v2, b_vn, tk0, tk1, tk2, tk3, tv0, tv1, tv2, tv3, start + it * BLOCK_N, end, i_b, i_h, stride_bt,
                        stride_block, stride_pos, stride_head, num_blocks, q_unscale, bias_ptr, o_bias, m_g, BLOCK_SIZE, D, BITS_K, BITS_V,
                        KEY_NORM_OFFSET, VALUE_OFFSET, VALUE_NORM_OFFSET, VALUE_ALIGN4, BLOCK_N, FAST, HAS_BIAS, PREFETCH,
                        KEYS_AS_ROWS)
                    if PREFETCH:
                        k0, k1, k2, b_kn, v0, v1, v2, b_vn = nk0, nk1, nk2, n_kn, nv0, nv1, nv2, n_vn
        else:
            for n0 in range(start, end, BLOCK_N):
                b_m, b_l, b_acc, nk0, nk1, nk2, n_kn, nv0, nv1, nv2, n_vn = _mse_step(
                    cache_ptr, block_table_ptr, key_cent_ptr, value_cent_ptr, b_q, b_m, b_l, b_acc, k0, k1, k2, b_kn, v0, v1, v2,
                    b_vn, tk0, tk1, tk2, tk3, tv0, tv1, tv2, tv3, n0, end, i_b, i_h, stride_bt, stride_block, stride_pos,
                    stride_head, num_blocks, q_unscale, bias_ptr, o_bias, m_g, BLOCK_SIZE, D, BITS_K, BITS_V, KEY_NORM_OFFSET, VALUE_OFFSET,
                    VALUE_NORM_OFFSET, VALUE_ALIGN4, BLOCK_N, FAST, HAS_BIAS, PREFETCH, KEYS_AS_ROWS)
                if PREFETCH:
                    k0, k1, k2, b_kn, v0, v1, v2, b_vn = nk0, nk1, nk2, n_kn, nv0, nv1, nv2, n_vn

    o_part = (o_q * num_splits + i_s)  # [BG]
    if KEYS_AS_ROWS:
        tl.store(o_part_ptr + o_part[None, :] * D + o_d[:, None], b_acc, mask=m_g[None, :])
    else:
        tl.store(o_part_ptr + o_part[:, None] * D + o_d[None, :], b_acc, mask=m_g[:, None])
    tl.store(ml_part_ptr + o_part * 2, b_m, mask=m_g)
    tl.store(ml_part_ptr + o_part * 2 + 1, b_l, mask=m_g)


@triton.jit
def _merge_splits_kernel(
    o_part_ptr,  # fp32 [rows, num_splits, D]
    ml_part_ptr,  # fp32 [rows, num_splits, 2]
    coord_ptr,  # int32 [D]: the coordinate each tile position holds
    out_ptr,  # fp32 [rows, D]: rotated output, natural coordinate order
    num_splits,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,  # tile positions per program
    BLOCK_S: tl.constexpr,  # splits per step
    STEPS: tl.constexpr,  # cdiv(num_splits, BLOCK_S) (a trip count the interpreter can read)
):
    """Log-sum-exp merge of the splits of one query row, ``BLOCK_D`` of its tile positions:
    ``sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s``, the splits read ``BLOCK_S`` at a time (any number
    of splits in the same registers)."""
    i_r = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    o_s = tl.arange(0, BLOCK_S)
    p_ml = ml_part_ptr + i_r * num_splits * 2
    b_mx = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for it in range(0, STEPS):
        s0 = it * BLOCK_S
        b_mx = tl.maximum(b_mx, tl.load(p_ml + (s0 + o_s) * 2, mask=s0 + o_s < num_splits, other=float("-inf")))
    b_big = tl.max(b_mx, axis=0)
    b_l = tl.zeros([BLOCK_S], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for it in range(0, STEPS):
        s0 = it * BLOCK_S
        m_s = s0 + o_s < num_splits
        b_w = tl.math.exp2(tl.load(p_ml + (s0 + o_s) * 2, mask=m_s, other=float("-inf")) - b_big)  # 0: padding, no keys
        b_l += b_w * tl.load(p_ml + (s0 + o_s) * 2 + 1, mask=m_s, other=0.0)
        b_o = tl.load(o_part_ptr + ((i_r * num_splits + s0 + o_s) * D)[:, None] + o_d[None, :], mask=m_s[:, None], other=0.0)
        b_acc += tl.sum(b_o * b_w[:, None], axis=0)
    tl.store(out_ptr + i_r * D + tl.load(coord_ptr + o_d), b_acc / tl.sum(b_l, axis=0))


@triton.jit
def _rotate_rows_kernel(
    x_ptr,  # [rows, D], any float dtype
    s_ptr,  # fp32 [S_ROWS, D] (HAS_SCALE): row r is multiplied by row r % S_ROWS first
    w_ptr,  # fp32 [D, D]
    out_ptr,  # [rows, D]
    rows,
    S_ROWS: tl.constexpr,
    D: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """``out = (x * s) @ w`` on ``BLOCK_R`` rows and ``BLOCK_C`` columns, in fp32 (no tf32), stored in ``out``'s dtype."""
    o_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_k = tl.arange(0, D)
    o_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_r = o_r < rows
    b_x = tl.load(x_ptr + o_r[:, None] * D + o_k[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)
    if HAS_SCALE:
        b_x *= tl.load(s_ptr + (o_r % S_ROWS)[:, None] * D + o_k[None, :], mask=m_r[:, None], other=0.0)
    b_o = tl.dot(b_x, tl.load(w_ptr + o_k[:, None] * D + o_c[None, :]), input_precision="ieee")
    tl.store(out_ptr + o_r[:, None] * D + o_c[None, :], b_o.to(out_ptr.dtype.element_ty), mask=m_r[:, None])


# ----------------------------------------------------------------------------- launchers


def _affine_tile_order(bits: int, dim: int) -> torch.Tensor:
    """int64 ``[dim]``: the coordinate held by each position of a ``_affine_tile_fast`` tile (4 bit:
    position ``2 j + h`` of each 8 holds coordinate ``j + 4 h``; 8 bit: natural)."""
    p = torch.arange(dim)
    if bits == 4:
        return (p // 8) * 8 + (p % 8) // 2 + 4 * (p % 2)
    return p


def _device_table(codec, name, device, build):
    source = getattr(codec, name)
    return T.cached(codec, (name, device), source, lambda s: build(s).to(device))


def _is_mse(codec) -> bool:
    return isinstance(codec, MSEParams)


def _is_affine(codec) -> bool:
    return isinstance(codec, AffineParams)


def _is_centered(codec) -> bool:
    return isinstance(codec, CenteredParams) and _is_mse(codec.mse)


def _split_centered(key_codec, position_offset):
    """``(centred codec or None, the MSE codec of the keys' codes)``; checks ``position_offset`` for centred keys."""
    if not _is_centered(key_codec):
        return None, key_codec
    C.check_int("position_offset", position_offset, minimum=0)
    return key_codec, key_codec.mse


def _check_codecs(key_codec, value_codec, dim: int) -> str:
    """``"mse"`` or ``"affine"``; raises for anything else or for a mix."""
    kinds = []
    if _is_centered(key_codec):
        shape = (key_codec.num_heads, dim)
        for attr in ("mean", "scale"):
            t = getattr(key_codec, attr)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                raise ValueError(f"key_codec.{attr} must be a tensor of shape {shape} (num_kv_heads, dim)")
        rope = key_codec.rope
        if rope is not None and getattr(rope, "dim", None) != dim:
            raise ValueError(f"key_codec.rope must rotate {dim} channels, got {getattr(rope, 'dim', None)}")
        key_codec = key_codec.mse
    for name, codec in (("key_codec", key_codec), ("value_codec", value_codec)):
        if _is_mse(codec):
            C.check_int(f"{name}.bits", codec.bits, MSE_BITS)
            if tuple(codec.centroids.shape) != (1 << codec.bits,) or tuple(codec.rotation.shape) != (codec.dim, codec.dim):
                raise ValueError(f"{name} has centroids/rotation of the wrong shape for bits={codec.bits}, dim={codec.dim}")
            kinds.append("mse")
        elif _is_affine(codec):
            C.check_int(f"{name}.bits", codec.bits, AFFINE_BITS)
            if codec.axis != "token":
                raise ValueError(f"{name}.axis must be 'token' (per-token keys and values), got {codec.axis!r}")
            gs = codec.group_size
            if gs < 16 or gs & (gs - 1) or dim % gs:
                raise ValueError(f"{name}.group_size must be a power of two >= 16 dividing dim={dim}, got {gs}")
            kinds.append("affine")
        else:
            allowed = "kvlab.MSECodec, a centred MSE codec (keys) or kvlab.AffineCodec"
            raise TypeError(f"{name} must be a {allowed}, got {type(codec).__name__}")
        if _is_mse(codec) and codec.dim != dim:
            raise ValueError(f"{name}.dim ({codec.dim}) must equal q's last dimension ({dim})")
    if kinds[0] != kinds[1]:
        raise TypeError("key_codec and value_codec must be the same kind of codec (both MSE or both affine), "
                        f"got {type(key_codec).__name__} and {type(value_codec).__name__}")
    if kinds[0] == "affine" and key_codec.group_size != value_codec.group_size:
        raise ValueError(f"key_codec and value_codec must share group_size, got {key_codec.group_size} and {value_codec.group_size}")
    return kinds[0]


def _slot_layout(kind, dim, key_codec, value_codec):
    if kind == "mse":
        return MSESlot(dim, key_codec.bits, value_codec.bits)
    return AffineSlot(dim, key_codec.bits, value_codec.bits, key_codec.group_size)


def _check_paged_inputs(q, cache, block_table, seq_lens, layout, check: bool):
    """Shapes, dtypes, devices (always) and block_table / seq_lens values (``check``: one host sync)."""
    C.check_tensor("cache", cache, (torch.uint8,))
    if cache.dim() != 4 or cache.shape[-1] != layout.slot_bytes:
        raise ValueError(f"cache must have shape [num_blocks, block_size, num_kv_heads, {layout.slot_bytes}] "
                         f"for {layout}, got {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError(f"cache must be contiguous in its last (byte) dimension, got strides {cache.stride()}")
    if cache.data_ptr() % 4 or any(s % 4 for s in cache.stride()[:3]):
        raise ValueError("cache must be 4-byte aligned: its address and its block, position and head strides "
                         f"must be multiples of 4 bytes, got strides {cache.stride()}")
    num_blocks, block_size, num_kv_heads, _ = cache.shape
    batch, num_q_heads = q.shape[0], q.shape[-2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q's number of heads ({num_q_heads}) must be a multiple of the cache's num_kv_heads "
                         f"({num_kv_heads}) (grouped-query attention)")
    if num_q_heads // num_kv_heads > 64:
        raise ValueError(f"at most 64 query heads per KV head are supported, got {num_q_heads // num_kv_heads}")
    C.check_tensor("block_table", block_table, (torch.int32,))
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table must have shape [batch={batch}, max_blocks >= 1], got {tuple(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    C.check_tensor("seq_lens", seq_lens, (torch.int32, torch.int64))
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must have shape ({batch},) (one length per sequence), got {tuple(seq_lens.shape)}")
    C.check_same_device(q=q, cache=cache, block_table=block_table, seq_lens=seq_lens)
    C.check_kernel_device("cache", cache)
    capacity = block_table.shape[1] * block_size
    if check and batch:
        if bool((seq_lens < 1).any()):
            raise ValueError("seq_lens must be >= 1 (every sequence attends over at least one cached token)")
        if bool((seq_lens > capacity).any()):
            raise ValueError(f"seq_lens must be <= max_blocks * block_size = {capacity} (the block table's capacity), "
                             f"got max {int(seq_lens.max())}")
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * block_size < seq_lens[:, None]
        bad = used & ((block_table < 0) | (block_table >= num_blocks))
        if bool(bad.any()):
            raise ValueError(f"block_table entries of used blocks must be in [0, {num_blocks}) (num_blocks of the cache)")
    return num_blocks, block_size, num_kv_heads, capacity


def rotate_attention_output(output: torch.Tensor, value_codec) -> torch.Tensor:
    """Rotated-space attention output ``[..., dim]`` -> model space: ``output @ R_V^T`` in fp32, one kernel.

    The only inverse rotation of the decode path; returns fp32 (cast as needed).
    """
    C.check_tensor("output", output, C.FLOAT_DTYPES, ndim_min=1)
    if not _is_mse(value_codec):
        raise TypeError(f"value_codec must be a kvlab.MSECodec, got {type(value_codec).__name__}")
    if output.shape[-1] != value_codec.dim:
        raise ValueError(f"output's last dimension ({output.shape[-1]}) must equal value_codec.dim ({value_codec.dim})")
    return _to_model_space(output, value_codec)


def _rotate_spec(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, scale: torch.Tensor | None = None):
    """The launch of ``_rotate_rows_kernel`` (``kvlab._kernels.launch`` spec): ``out = (x * scale) @ w`` (``x``, ``out``
    contiguous, rows of ``w.shape[0]``)."""
    dim = x.shape[-1]
    rows = x.numel() // dim
    block_c = min(32, dim)
    args = dict(x_ptr=x, s_ptr=w if scale is None else scale, w_ptr=w, out_ptr=out, rows=rows,
                S_ROWS=1 if scale is None else scale.shape[0], D=dim, HAS_SCALE=scale is not None, BLOCK_R=16,
                BLOCK_C=block_c)
    return _rotate_rows_kernel, (C.cdiv(rows, 16), dim // block_c), args, dict(num_warps=4)


def _rotate_rows(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``(x * scale) @ w`` over the last dimension of ``x`` in fp32, returned as ``dtype``: one launch of
    ``_rotate_rows_kernel`` (``w`` fp32 ``[dim, dim]``; ``scale`` fp32 ``[n, dim]``, row ``r`` of ``x``'s rows
    taking row ``r % n``). Decode rotates a few rows a call: one small kernel, not a cast, a GEMM and a cast."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel():
        fn, grid, args, options = _rotate_spec(x, w, out, scale)
        with _on_device(x.device):
            fn[grid](**args, **options)
    return out


def _to_model_space(output: torch.Tensor, value_codec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    rot_t = T.cached(value_codec, ("rotation_t", output.device), value_codec.rotation,
                    lambda r: r.to(device=output.device, dtype=torch.float32).T.contiguous())
    return _rotate_rows(output, rot_t, dtype)


def _rope_table(key_codec, length: int, offset: int, device) -> torch.Tensor:
    """fp32 ``[length, dim]``: ``[cos | sin]`` of positions ``offset ..`` at the RoPE frequencies (one half each).

    Computed in float64 on the CPU (``RoPE.tables``), cached per codec, device and offset, grown in powers of two.
    """
    def build(_, n):
        cos, sin = key_codec.rope.tables(torch.arange(offset, offset + n))
        half = key_codec.dim // 2
        return torch.cat([cos[:, :half], sin[:, :half]], 1).to(device=device, dtype=torch.float32).contiguous()

    n = max(256, C.next_power_of_2(length))
    return T.cached(key_codec, ("rope_table", device, offset, n), key_codec.mean, lambda m: build(m, n))[:length]


def rope_mean_scores(q: torch.Tensor, key_codec, length: int, position_offset: int = 0) -> torch.Tensor:
    """fp32 ``[batch, num_q_heads, length]``: ``q . RoPE_n(mean[h])`` for positions ``n = position_offset + t``.

    The score term of a centred key codec with ``rope`` that the centred keys leave out (``kvlab.centered``):
    with ``a = q * mean`` and ``b = q * rotate_half(mean)`` folded onto the ``dim / 2`` frequencies, it is
    ``[a | b] @ [cos | sin]^T``, one GEMM against a per-position table shared by all heads. Query head
    ``i`` uses KV head ``i // (num_q_heads / num_heads)``.
    """
    batch, num_q_heads, dim = q.shape
    half = dim // 2
    mean = _device_table(key_codec, "mean", q.device, lambda m: m.to(torch.float32).contiguous())
    mean = mean.repeat_interleave(num_q_heads // key_codec.num_heads, 0)  # [HQ, D]
    rot_half = torch.cat([-mean[:, half:], mean[:, :half]], 1)
    a, b = q.float() * mean, q.float() * rot_half
    ab = torch.cat([a[..., :half] + a[..., half:], b[..., :half] + b[..., half:]], -1)  # [B, HQ, D]
    return ab @ _rope_table(key_codec, length, position_offset, q.device).T


# The launch of the split loop when the caller leaves it to the library: the fastest configuration of
# ``benchmarks/bench_decode.py --sweep`` at batch 8, context 32k, 32 query and 8 KV heads, head dim 128,
# on an H200 (results/decode_attention_sweep.csv, timed before the value codes were read as aligned
# words), by cache kind and the wider of the key and value bit widths. Centred 2- and 3-bit keys use
# the MSE entry. Other shapes and GPUs may prefer others: every field is an argument of
# ``decode_attention``.
LAUNCH_DEFAULTS = {
    ("mse", 4): dict(block_n=64, num_warps=4, num_stages=1, prefetch=True, keys_as_rows=True, fast=True),
    ("mse", 3): dict(block_n=128, num_warps=4, num_stages=1, max_registers=168, keys_as_rows=True, fast=True),
    ("mse", 2): dict(block_n=128, num_warps=4, num_stages=1, keys_as_rows=True, fast=True),
    ("centered", 4): dict(block_n=64, num_warps=4, num_stages=1, fast=True),
    ("affine", 4): dict(block_n=128, num_warps=4, num_stages=1, fast=True),
    ("affine", 8): dict(block_n=64, num_warps=4, num_stages=2, fast=False),
}


def launch_defaults(kind: str, bits: int) -> dict:
    """The split loop's launch arguments for a cache ``kind`` (``"mse"``, ``"centered"``, ``"affine"``) whose
    wider codec has ``bits`` bits: a copy of the ``LAUNCH_DEFAULTS`` entry (``fast`` as measured, before
    the interpreter turns it off)."""
    entry = (kind, bits) if (kind, bits) in LAUNCH_DEFAULTS or kind != "centered" else ("mse", bits)
    if entry not in LAUNCH_DEFAULTS:
        raise ValueError(f"no launch defaults for a {kind!r} cache of {bits} bits; have {sorted(LAUNCH_DEFAULTS)}")
    return dict(LAUNCH_DEFAULTS[entry])


@functools.lru_cache(maxsize=None)
def _mma_splits(batch: int, num_kv_heads: int, capacity: int, device) -> int:
    """The default split count of the loop of ``kvlab.attention.gluon`` (``decode_mma.default_splits``)."""
    return decode_mma.default_splits(batch * num_kv_heads, capacity, T.sm_count(device))


@functools.lru_cache(maxsize=None)
def _default_splits(batch: int, num_kv_heads: int, capacity: int, block_n: int, device) -> int:
    """The split loop's default: about ``PROGRAMS_PER_SM`` programs an SM, each split at least
    ``MIN_SPLIT_TOKENS`` (and ``block_n``) keys."""
    want = C.cdiv(PROGRAMS_PER_SM * T.sm_count(device), max(1, batch * num_kv_heads))
    return max(1, min(want, C.cdiv(capacity, max(MIN_SPLIT_TOKENS, block_n))))


def _on_device(device: torch.device):
    """``device``'s context where it is not the current device (entering one costs host time every call)."""
    other = device.type == "cuda" and device.index not in (None, torch.cuda.current_device())
    return torch.cuda.device(device) if other else _nullcontext()


def _partials(batch: int, num_q_heads: int, num_splits: int, dim: int, device):
    """fp32 buffers of a split loop: partial outputs, their running maxima and sums, and the merged output."""
    return (torch.empty(batch, num_q_heads, num_splits, dim, dtype=torch.float32, device=device),
            torch.empty(batch, num_q_heads, num_splits, 2, dtype=torch.float32, device=device),
            torch.empty(batch, num_q_heads, dim, dtype=torch.float32, device=device))


def _merge_spec(o_part, ml_part, order, out):
    """The launch of ``_merge_splits_kernel`` (``kvlab._kernels.launch`` spec): ``out`` (natural coordinate order) from
    the splits of ``o_part``."""
    batch, num_q_heads, num_splits, dim = o_part.shape
    # on a GPU, 32 tile positions a program (more programs in flight); the interpreter, whole rows (fewer programs)
    block_d, block_s = (dim if out.device.type == "cpu" else min(32, dim)), min(64, max(2, C.next_power_of_2(num_splits)))
    args = dict(o_part_ptr=o_part, ml_part_ptr=ml_part, coord_ptr=order, out_ptr=out, num_splits=num_splits, D=dim,
                BLOCK_D=block_d, BLOCK_S=block_s, STEPS=C.cdiv(num_splits, block_s))
    return _merge_splits_kernel, (batch * num_q_heads, dim // block_d), args, dict(num_warps=2)


def _merge(o_part, ml_part, order, out) -> None:
    """Launch ``_merge_splits_kernel`` (``_merge_spec``)."""
    fn, grid, args, options = _merge_spec(o_part, ml_part, order, out)
    fn[grid](**args, **options)


@functools.lru_cache(maxsize=None)
def _capability(device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _mma_unsupported(q, num_kv_heads, kind, centered, key_codec, value_codec) -> str | None:
    """Why the loop of ``kvlab.attention.gluon`` cannot run this call, or None."""
    if q.device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "a CUDA GPU (Triton's interpreter cannot run Gluon kernels)"
    if _capability(q.device) < (8, 0):
        return "a GPU of compute capability 8.0 or later (mma.sync m16n8k16)"
    if kind != "mse" or centered is not None or key_codec.bits not in decode_mma.BITS or value_codec.bits not in decode_mma.BITS:
        widths = ", ".join(map(str, decode_mma.BITS[:-1])) + f" or {decode_mma.BITS[-1]}"
        return f"MSE key and value codecs of {widths} bits (not centred keys)"
    if q.shape[-1] not in decode_mma.DIMS:
        return f"a head dim in {decode_mma.DIMS}, got {q.shape[-1]}"
    if value_codec.bits * q.shape[-1] < 256:
        return f"a head dim of at least 128 for {value_codec.bits}-bit values, got {q.shape[-1]}"
    if key_codec.bits == 3 and q.shape[-1] != 128:
        return f"a head dim of 128 for 3-bit keys, got {q.shape[-1]}"
    if q.shape[-2] // num_kv_heads > decode_mma.MAX_GROUP:
        return f"at most {decode_mma.MAX_GROUP} query heads per KV head, got {q.shape[-2] // num_kv_heads}"
    if T.prmt_tables(key_codec) is None or T.prmt_tables(value_codec) is None:
        return "symmetric fp16 codebooks (the byte-permute lookup)"
    return None


def _takes_mma_loop(q, num_kv_heads, kind, centered, key_codec, value_codec, mma, given) -> bool:
    """Whether ``decode_attention`` runs the loop of ``kvlab.attention.gluon`` (``mma``: the caller's choice,
    ``given``: the names of the split loop's launch arguments set); ``mma=True`` that cannot run raises."""
    if mma is False:
        return False
    why_not = _mma_unsupported(q, num_kv_heads, kind, centered, key_codec, value_codec)
    if mma and why_not:
        raise ValueError(f"mma=True needs {why_not}")
    if mma and given:
        raise ValueError(f"mma=True takes none of the split loop's launch arguments, got {', '.join(given)}")
    return why_not is None and not given and (mma or (key_codec.bits, value_codec.bits) in decode_mma.DEFAULT_BITS)


def _decode_mma(q, cache, block_table, seq_lens, key_codec, value_codec, scale, num_splits, capacity, check=True):
    """``decode_attention`` through ``kvlab.attention.gluon.decode_mma_kernel`` (inputs checked), then the merge;
    None when ``check`` finds that the pre-scaled query overflows fp16 (the split loop handles it)."""
    batch, num_q_heads, dim = q.shape
    num_kv_heads = cache.shape[2]
    device = q.device
    assert MSESlot(dim, key_codec.bits, value_codec.bits).value_offset % 4 == 2
    rot_k, order_v = _mma_tables(key_codec, value_codec, dim, scale * LOG2E, device)
    q_in = _rotate_rows(q, rot_k, torch.float16)
    if check and not bool(torch.isfinite(q_in).all()):
        return None
    if not check:  # unchecked tables and lengths: clamped, so that no read leaves the cache
        block_table = block_table.clamp(0, cache.shape[0] - 1)
        seq_lens = seq_lens.clamp(0, capacity)
    split_len, num_splits = _mma_split_len(batch, num_kv_heads, capacity, num_splits, device)
    o_part, ml_part, out = _partials(batch, num_q_heads, num_splits, dim, device)
    if batch == 0:
        return out.to(q.dtype)
    grid, args, constants, options = _mma_launch(q_in, cache, block_table, seq_lens, o_part, ml_part, key_codec,
                                                 value_codec, split_len, num_splits)
    with _on_device(device):
        decode_mma.launch(grid, args, constants, options)
        _merge(o_part, ml_part, order_v, out)
    return _to_model_space(out, value_codec, q.dtype)


def _mma_tables(key_codec, value_codec, dim: int, q_scale: float, device):
    """``(rotation of the query times q_scale, its columns in the loop's order; output coordinate order)``."""
    rot_k = T.cached(key_codec, ("mma_query_rotation", device, q_scale), key_codec.rotation,
                    lambda r: (r.to(device=device, dtype=torch.float32)[:, decode_mma.query_order(dim, key_codec.bits).to(device)]
                               * q_scale).contiguous())
    order_v = T.cached(value_codec, ("mma_output_order", device), value_codec.centroids,
                      lambda _: decode_mma.output_order(dim).to(device=device, dtype=torch.int32))
    return rot_k, order_v


def _mma_split_len(batch: int, num_kv_heads: int, capacity: int, num_splits, device) -> tuple[int, int]:
    """``(keys per split, splits)`` of the loop of ``kvlab.attention.gluon`` (``num_splits`` None: the default)."""
    if num_splits is None:
        num_splits = _mma_splits(batch, num_kv_heads, capacity, device)
    split_len = C.cdiv(C.cdiv(capacity, num_splits), decode_mma.STEP) * decode_mma.STEP
    return split_len, C.cdiv(capacity, split_len)


def _mma_launch(q_in, cache, block_table, seq_lens, o_part, ml_part, key_codec, value_codec, split_len, num_splits):
    """``(grid, arguments, constants, options)`` of ``decode_mma.launch`` for the loop of ``_decode_mma``."""
    batch, num_q_heads, dim = q_in.shape
    num_kv_heads = cache.shape[2]
    layout = MSESlot(dim, key_codec.bits, value_codec.bits)
    group_rows = max(8, C.next_power_of_2(num_q_heads // num_kv_heads))
    max_registers = decode_mma.num_registers(group_rows)
    extra = {} if max_registers is None else dict(maxnreg=max_registers)
    args = (q_in, cache, block_table, seq_lens, o_part, ml_part, *T.prmt_tables(key_codec), *T.prmt_tables(value_codec),
            split_len, num_splits, block_table.stride(0), cache.stride(0), cache.stride(1), cache.stride(2))
    constants = dict(HQ=num_q_heads, HKV=num_kv_heads, BLOCK_SIZE=cache.shape[1], D=dim,
                     KEY_NORM_OFFSET=layout.key_norm_offset, VALUE_OFFSET=layout.value_offset,
                     VALUE_NORM_OFFSET=layout.value_norm_offset, BG=group_rows, BITS_K=key_codec.bits,
                     BITS_V=value_codec.bits, KEY_WORDS=decode_mma.key_words_layout(dim, key_codec.bits),
                     VALUE_WORDS=decode_mma.value_words_layout(dim, value_codec.bits))
    return (batch * num_kv_heads, num_splits), args, constants, dict(num_warps=1, **extra)


def _fit_fp16(q32: torch.Tensor):
    """``(q16, f)``: ``q32 / f`` in fp16 and the power of two ``f`` (1.0 when ``q32`` fits) that keeps it finite."""
    peak = float(q32.abs().amax()) if q32.numel() else 0.0
    if not math.isfinite(peak):
        raise ValueError("q * scale overflows float32 (after the rotation); use a smaller q or scale")
    f = 2.0 ** max(0, math.ceil(math.log2(peak / 2.0**15))) if peak > 2.0**15 else 1.0
    return (q32 / f).to(torch.float16).contiguous(), f


def decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    key_codec,
    value_codec,
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_registers: int | None = None,
    fast: bool | None = None,
    check: bool = True,
    position_offset: int = 0,
    prefetch: bool | None = None,
    keys_as_rows: bool | None = None,
    mma: bool | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged quantized cache: ``[batch, num_q_heads, dim]``.

    ``q``: fp16/bf16 ``[batch, num_q_heads, dim]`` (dim 64, 128 or 256), ``num_q_heads`` a multiple of
    the cache's ``num_kv_heads``. ``cache``: the paged MSE cache of ``kvlab.layout`` (``MSECodec``
    key and value codecs, 2/3/4 bits) or the paged affine cache of ``AffineSlot``
    (``AffineCodec`` key and value codecs, token axis, 4/8 bits). ``block_table`` int32 ``[batch,
    max_blocks]``, ``seq_lens`` int32/int64 ``[batch]`` (1 .. ``max_blocks * block_size``).
    ``scale``: softmax scale (default ``dim ** -0.5``). Returns ``q.dtype``.

    ``num_splits`` (default: for the split loop about 16 programs per SM, splits of at least 256 keys; for
    the loop of ``kvlab.attention.gluon``, ``decode_mma.default_splits``), ``block_n`` (keys
    per step, a power of two 16..256), ``num_warps``, ``num_stages`` and ``max_registers`` (a cap on
    registers per thread, 32..255, so that more warps fit on an SM; ignored by the interpreter) tune
    the launch; ``fast`` picks, for MSE caches, the ``prmt`` lookup over the generic unpack, and for
    affine caches the dequantization in fp16 pairs (``_AFFINE4``, ``_AFFINE8``: no int-to-float
    conversion, no exchange of scales between threads) over the fp32 one. Every launch argument left
    at ``None`` comes from ``launch_defaults`` (the fastest configuration measured for the cache's
    kind and widest bit width; ``fast`` only when compiled for a GPU). ``prefetch`` (MSE caches) pipelines the split loop by hand: each step issues the
    next step's block-table, code and norm reads before its own arithmetic (more registers, more reads
    in flight). ``keys_as_rows`` computes the transposed products, ``K q^T`` and ``V^T P^T``: the keys (and
    the dims) are the rows of the matrix products, 64 or more, so that on Hopper Triton can issue them as
    warpgroup MMAs (``wgmma``, at least 64 rows) instead of padding the query group to 16-row ``mma``
    tiles; the result is the same up to float rounding.
    ``check=True`` also checks ``seq_lens`` and the used ``block_table`` entries (one host sync), that
    the codecs are those that wrote the cache (where a launcher recorded them), and whether the
    pre-scaled fp16 query overflows (a large ``scale`` or ``q``: it is then divided by a power of two
    and the scores multiplied back); ``check=False`` never syncs, clamps block-table entries into
    ``[0, num_blocks)`` and lengths into ``[0, max_blocks * block_size]`` so that no read leaves the
    cache (such inputs give unspecified numbers), and needs ``q * scale`` within fp16 after the rotation.

    ``mma`` picks the loop: ``True`` the loop of ``kvlab.attention.gluon`` (MSE keys and values of 2, 3 or 4
    bits, dim 64 or 128 (2-bit values, 3-bit keys or values: 128), at most 16 query heads per KV head, a CUDA GPU of compute capability 8.0 or later; the
    tiles are dequantized in the tensor cores' register operands), ``False`` the split loop above
    (``_decode_split_kernel``). ``None`` (the default) takes the first wherever it applies and no
    launch argument of the split loop (``block_n``, ``num_warps``, ``num_stages``, ``max_registers``,
    ``fast``, ``prefetch``, ``keys_as_rows``) is given; ``num_splits`` applies to both.

    Centred keys (``key_codec`` a ``kvlab.centered.reference.CenteredMSECodec`` with ``num_heads =
    num_kv_heads``, MSE values): the cache is the same MSE cache (``store_centered_mse`` writes it). The
    query is scaled by the key scale of its KV head before its rotation; with ``rope`` every score also
    gets ``q . RoPE_n(mean)`` (``rope_mean_scores``, one GEMM per call, read by the kernel per key),
    token ``t`` of a sequence being at position ``n = position_offset + t``; without ``rope`` the mean's
    term is the same for every key, and the softmax drops it.
    """
    C.check_tensor("q", q, (torch.float16, torch.bfloat16))
    if q.dim() != 3:
        raise ValueError(f"q must have shape [batch, num_q_heads, dim], got {tuple(q.shape)}")
    batch, num_q_heads, dim = q.shape
    if dim not in DIMS:
        raise ValueError(f"q's last dimension (head dim) must be one of {DIMS}, got {dim}")
    kind = _check_codecs(key_codec, value_codec, dim)
    centered, key_codec = _split_centered(key_codec, position_offset)
    split_args = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages, max_registers=max_registers, fast=fast,
                      prefetch=prefetch, keys_as_rows=keys_as_rows)
    tuned = launch_defaults("centered" if centered is not None else kind, max(key_codec.bits, value_codec.bits))
    block_n = tuned["block_n"] if block_n is None else block_n
    num_warps = tuned["num_warps"] if num_warps is None else num_warps
    num_stages = tuned.get("num_stages") if num_stages is None else num_stages
    max_registers = tuned.get("max_registers") if max_registers is None else max_registers
    prefetch = tuned.get("prefetch", False) if prefetch is None else prefetch
    keys_as_rows = tuned.get("keys_as_rows", False) if keys_as_rows is None else keys_as_rows
    layout = _slot_layout(kind, dim, key_codec, value_codec)
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    num_blocks, block_size, num_kv_heads, capacity = _check_paged_inputs(q, cache, block_table, seq_lens, layout, check)
    if centered is not None and centered.num_heads != num_kv_heads:
        raise ValueError(f"key_codec.num_heads ({centered.num_heads}) must equal the cache's num_kv_heads ({num_kv_heads})")
    if check:
        C.check_reader(cache, key_codec, value_codec)
        C.check_finite("q", q)
    if scale is None:
        scale = dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    if mma is not None and not isinstance(mma, bool):
        raise TypeError(f"mma must be a bool or None, got {type(mma).__name__}")
    given = [k for k, v in split_args.items() if v is not None]
    if _takes_mma_loop(q, num_kv_heads, kind, centered, key_codec, value_codec, mma, given):
        if num_splits is not None:
            C.check_int("num_splits", num_splits, minimum=1)
        out = _decode_mma(q, cache, block_table, seq_lens, key_codec, value_codec, scale, num_splits, capacity, check)
        if out is not None:
            return out
    C.check_int("block_n", block_n, (16, 32, 64, 128, 256))
    C.check_int("num_warps", num_warps, (1, 2, 4, 8, 16))
    if num_stages is not None:
        C.check_int("num_stages", num_stages, minimum=1)
    if max_registers is not None:
        C.check_int("max_registers", max_registers, minimum=32)
        if max_registers > 255:
            raise ValueError(f"max_registers must be at most 255 (registers per thread), got {max_registers}")
    if num_splits is None:
        num_splits = _default_splits(batch, num_kv_heads, capacity, block_n, q.device)
    C.check_int("num_splits", num_splits, minimum=1)
    interpreted = q.device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if fast is None:  # inline PTX: only when compiled for a GPU
        fast = not interpreted and tuned["fast"]
    if not isinstance(fast, bool):
        raise TypeError(f"fast must be a bool or None, got {type(fast).__name__}")
    if not isinstance(prefetch, bool):
        raise TypeError(f"prefetch must be a bool, got {type(prefetch).__name__}")
    if not isinstance(keys_as_rows, bool):
        raise TypeError(f"keys_as_rows must be a bool, got {type(keys_as_rows).__name__}")
    if prefetch and kind != "mse":
        raise ValueError("prefetch=True applies to MSE caches (the affine path is not pipelined)")
    if fast and interpreted and not T.interpreter_runs_ptx():
        raise ValueError("fast=True needs a CUDA device (inline PTX); use fast=False or None on the CPU")

    device = q.device
    split_len = C.cdiv(C.cdiv(capacity, num_splits), block_n) * block_n
    num_splits = C.cdiv(capacity, split_len)  # no empty trailing splits
    q_scale = scale * LOG2E  # base-2 exponentials: log2(e) rides on the softmax scale
    q_unscale = 1.0
    t = _split_tables(kind, key_codec, value_codec, dim, q_scale, fast, device, centered, num_q_heads // num_kv_heads)
    if kind == "mse":
        q_in = _rotate_rows(q, t["rot_q"], torch.float16, t["key_scale"])
        if check and not bool(torch.isfinite(q_in).all()):  # q * scale beyond fp16: scaled down, scores scaled back
            q_in, q_unscale = _fit_fp16(_rotate_rows(q, t["rot_q"], torch.float32, t["key_scale"]))
    else:
        q_in = q.float()
        if fast:  # tiles in _affine_tile_order: the query's coordinates permuted to match, the output's put back
            q_in = q_in[..., t["order_q"]]
        q_in = q_in * q_scale
        q_in, q_unscale = _fit_fp16(q_in) if check else (q_in.to(torch.float16).contiguous(), 1.0)
    bias = None
    if centered is not None and centered.rope is not None:
        bias = (rope_mean_scores(q, centered, capacity, position_offset) * q_scale).contiguous()

    o_part, ml_part, out = _partials(batch, num_q_heads, num_splits, dim, device)
    if batch == 0:
        return out.to(q.dtype)
    fn, grid, args, options = _split_spec(
        q_in, cache, block_table, seq_lens, o_part, ml_part, bias, t, key_codec, value_codec, split_len, num_blocks,
        capacity, q_unscale, kind=kind, block_n=block_n, fast=fast, prefetch=prefetch, keys_as_rows=keys_as_rows,
        interpreted=interpreted, num_warps=num_warps, num_stages=num_stages, max_registers=max_registers)
    with _on_device(device):
        fn[grid](**args, **options)
        _merge(o_part, ml_part, t["order_v"], out)
    if kind == "mse":
        return _to_model_space(out, value_codec, q.dtype)
    return out.to(q.dtype)


def _split_tables(kind, key_codec, value_codec, dim: int, q_scale: float, fast: bool, device, centered=None,
                  group: int = 1) -> dict:
    """Device tables of the split loop for a cache ``kind``: the query's rotation (``rot_q``, MSE: times
    ``q_scale``, its columns in the key tile order) or coordinate order (``order_q``, affine with ``fast``),
    the output's coordinate order ``order_v``, centroids, byte-plane tables and the slot offsets."""
    t = dict(tables_k=(0, 0, 0, 0), tables_v=(0, 0, 0, 0), key_scale=None)
    if kind == "mse":
        if fast:
            t["tables_k"], t["tables_v"] = T.prmt_tables(key_codec), T.prmt_tables(value_codec)
            if t["tables_k"] is None or t["tables_v"] is None:
                raise ValueError("fast=True needs a symmetric fp16 codebook for 4-bit codecs; use fast=False")
        # the rotation with its columns in the key tile order, times q_scale: q R[:, order] is the
        # permuted rotated query, ready for base-2 exponentials
        t["rot_q"] = T.cached(key_codec, ("query_rotation", device, q_scale), key_codec.rotation,
                             lambda r: (r.to(device=device, dtype=torch.float32)[:, tile_order(key_codec.bits, dim).to(device)]
                                        * q_scale).contiguous())
        t["order_v"] = T.cached(value_codec, ("tile_order", device), value_codec.centroids,
                               lambda _: tile_order(value_codec.bits, dim).to(device=device, dtype=torch.int32))
        if centered is not None:  # q . (scale * z) = (q * scale) . z: scale the query, not the keys
            t["key_scale"] = T.cached(centered, ("scale_rows", device, group), centered.scale,
                                     lambda s: s.to(device=device, dtype=torch.float32).repeat_interleave(group, 0).contiguous())
        t["cent_k"] = T.centroids(key_codec, device)  # the codebooks: the centroid of each code
        t["cent_v"] = T.centroids(value_codec, device)
        layout = MSESlot(dim, key_codec.bits, value_codec.bits)
        assert layout.value_offset % 2 == 0, layout  # words of the value code: 4- or 2-byte aligned (_load_words)
        t["offsets"] = dict(KEY_NORM_OFFSET=layout.key_norm_offset, VALUE_OFFSET=layout.value_offset,
                            VALUE_NORM_OFFSET=layout.value_norm_offset, VALUE_ALIGN4=layout.value_offset % 4 == 0,
                            GROUP=16)
    else:
        if fast:
            t["order_q"] = T.cached(key_codec, ("affine_query_order", device, dim), key_codec.bits,
                                   lambda b: _affine_tile_order(b, dim).to(device))
            t["order_v"] = T.cached(value_codec, ("affine_tile_order", device, dim), value_codec.bits,
                                   lambda b: _affine_tile_order(b, dim).to(device=device, dtype=torch.int32))
        else:
            t["order_q"] = None
            t["order_v"] = T.cached(key_codec, ("natural_order", device, dim), key_codec.bits,
                                   lambda _: torch.arange(dim, dtype=torch.int32, device=device))
        t["cent_k"] = t["cent_v"] = t["order_v"]  # unused
        layout = AffineSlot(dim, key_codec.bits, value_codec.bits, key_codec.group_size)
        t["offsets"] = dict(KEY_NORM_OFFSET=0, VALUE_OFFSET=layout.value_offset, VALUE_NORM_OFFSET=0,
                            VALUE_ALIGN4=True, GROUP=key_codec.group_size)
    return t


def _split_spec(q_in, cache, block_table, seq_lens, o_part, ml_part, bias, t: dict, key_codec, value_codec,
                split_len: int, num_blocks: int, capacity: int, q_unscale: float, *, kind: str, block_n: int,
                fast: bool, prefetch: bool, keys_as_rows: bool, interpreted: bool, num_warps: int, num_stages,
                max_registers):
    """The launch of ``_decode_split_kernel`` (``kvlab._kernels.launch`` spec)."""
    batch, num_q_heads, num_splits, dim = o_part.shape
    num_kv_heads = cache.shape[2]
    group = num_q_heads // num_kv_heads
    tk, tv = t["tables_k"], t["tables_v"]
    args = dict(
        q_ptr=q_in, cache_ptr=cache, block_table_ptr=block_table, seq_lens_ptr=seq_lens, key_cent_ptr=t["cent_k"],
        value_cent_ptr=t["cent_v"], o_part_ptr=o_part, ml_part_ptr=ml_part,
        bias_ptr=o_part if bias is None else bias,  # not read without a bias
        tk0=tk[0], tk1=tk[1], tk2=tk[2], tk3=tk[3], tv0=tv[0], tv1=tv[1], tv2=tv[2], tv3=tv[3],
        split_len=split_len, num_splits=num_splits, stride_bt=block_table.stride(0), stride_block=cache.stride(0),
        stride_pos=cache.stride(1), stride_head=cache.stride(2), stride_bias=0 if bias is None else bias.stride(1),
        num_blocks=num_blocks, capacity=capacity, q_unscale=q_unscale,
        HQ=num_q_heads, HKV=num_kv_heads, BLOCK_SIZE=cache.shape[1], D=dim, AFFINE=kind == "affine",
        BITS_K=key_codec.bits, BITS_V=value_codec.bits, **t["offsets"],
        BLOCK_G=max(16, C.next_power_of_2(group)), BLOCK_N=block_n, FAST=fast, HAS_BIAS=bias is not None,
        PREFETCH=prefetch, KEYS_AS_ROWS=keys_as_rows, INTERPRETED=interpreted,
        SPLIT_STEPS=split_len // block_n if interpreted else 0,
    )  # fmt: skip
    options = dict(num_warps=num_warps)
    if num_stages is not None:
        options["num_stages"] = num_stages
    if max_registers is not None and not interpreted:
        options["maxnreg"] = max_registers
    return _decode_split_kernel, (batch * num_kv_heads, num_splits), args, options


class DecodeStep:
    """``decode_attention(q, cache, block_table, seq_lens, key_codec, value_codec, scale=scale, check=False)``
    repeated on one cache, block table and lengths tensor (read in place at every call: their owner advances
    them and keeps them valid) for queries of one shape and dtype — one layer of a ``PagedKVCache`` in a decode
    step. The checks, device tables, buffers and launch arguments are prepared once; a call replays the
    launches (``kvlab._kernels.launch``): the query's rotation, the loop, the merge and the output's rotation. Returns
    the same output as ``decode_attention``, in a buffer that the next call overwrites. MSE and affine caches
    (not centred keys); the loop is ``decode_attention``'s default for the shape."""

    def __init__(self, q, cache, block_table, seq_lens, key_codec, value_codec, *, scale=None):
        from .._kernels.launch import Launch

        decode_attention(q, cache, block_table, seq_lens, key_codec, value_codec, scale=scale, check=False)  # checks
        batch, num_q_heads, dim = q.shape
        kind = _check_codecs(key_codec, value_codec, dim)
        if _is_centered(key_codec):
            raise ValueError("the decode step reads MSE and affine caches, not centred keys")
        device, self.shape, self.dtype = q.device, tuple(q.shape), q.dtype
        num_blocks, block_size, num_kv_heads, _ = cache.shape
        capacity = block_table.shape[1] * block_size
        q_scale = (dim**-0.5 if scale is None else scale) * LOG2E
        interpreted = device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        if _takes_mma_loop(q, num_kv_heads, kind, None, key_codec, value_codec, None, []):
            rot_q, order_v = _mma_tables(key_codec, value_codec, dim, q_scale, device)
            split_len, num_splits = _mma_split_len(batch, num_kv_heads, capacity, None, device)
            q_in = torch.empty(q.shape, dtype=torch.float16, device=device)
            o_part, ml_part, out = _partials(batch, num_q_heads, num_splits, dim, device)
            loop = decode_mma.spec(*_mma_launch(q_in, cache, block_table, seq_lens, o_part, ml_part, key_codec,
                                                value_codec, split_len, num_splits))
        else:
            tuned = launch_defaults(kind, max(key_codec.bits, value_codec.bits))
            fast = not interpreted and tuned["fast"]
            num_splits = _default_splits(batch, num_kv_heads, capacity, tuned["block_n"], device)
            split_len = C.cdiv(C.cdiv(capacity, num_splits), tuned["block_n"]) * tuned["block_n"]
            num_splits = C.cdiv(capacity, split_len)
            t = _split_tables(kind, key_codec, value_codec, dim, q_scale, fast, device)
            if kind == "mse":
                rot_q = t["rot_q"]
            else:  # the coordinate order times q_scale, as a matrix: one launch (the product is exact)
                eye = torch.eye(dim, dtype=torch.float32, device=device)
                rot_q = ((eye if t["order_q"] is None else eye[:, t["order_q"]]) * q_scale).contiguous()
            order_v = t["order_v"]
            q_in = torch.empty(q.shape, dtype=torch.float16, device=device)
            o_part, ml_part, out = _partials(batch, num_q_heads, num_splits, dim, device)
            loop = _split_spec(q_in, cache, block_table, seq_lens, o_part, ml_part, None, t, key_codec, value_codec,
                               split_len, num_blocks, capacity, 1.0, kind=kind, block_n=tuned["block_n"], fast=fast,
                               prefetch=tuned.get("prefetch", False), keys_as_rows=tuned.get("keys_as_rows", False),
                               interpreted=interpreted, num_warps=tuned["num_warps"],
                               num_stages=tuned.get("num_stages"), max_registers=tuned.get("max_registers"))
        self.device, self.out = device, out
        self.result = torch.empty(q.shape, dtype=q.dtype, device=device)
        self.rotate_q = Launch(*_rotate_spec(q.contiguous(), rot_q, q_in), variable=("x_ptr",))
        self.loop = Launch(*loop)
        self.merge = Launch(*_merge_spec(o_part, ml_part, order_v, out))
        self.rotate_out = None
        if kind == "mse":
            rot_t = T.cached(value_codec, ("rotation_t", device), value_codec.rotation,
                            lambda r: r.to(device=device, dtype=torch.float32).T.contiguous())
            self.rotate_out = Launch(*_rotate_spec(out, rot_t, self.result))

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        if tuple(q.shape) != self.shape or q.dtype != self.dtype:
            raise ValueError(f"q must be {self.dtype} of shape {list(self.shape)}, got {q.dtype} {list(q.shape)}")
        q = q if q.is_contiguous() else q.contiguous()
        with _on_device(self.device):
            self.rotate_q(x_ptr=q)
            self.loop()
            self.merge()
            if self.rotate_out is None:
                self.result.copy_(self.out)
            else:
                self.rotate_out()
        return self.result


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- affine store, prefill


def store_affine_slots(key, value, slot_mapping, cache, key_codec, value_codec, *, check: bool = True) -> None:
    """Encode ``key``/``value`` ``[num_tokens, num_kv_heads, dim]`` into the paged affine cache (in place).

    The bytes equal ``kvlab.reference.write_affine_slots``: ``pack_affine`` codes (token axis), then one
    indexed copy into the slots of ``slot_mapping`` (``-1``: skipped).
    """
    for name, codec in (("key_codec", key_codec), ("value_codec", value_codec)):
        if not _is_affine(codec):
            raise TypeError(f"{name} must be a kvlab.AffineCodec, got {type(codec).__name__}")
    C.check_tensor("key", key, C.FLOAT_DTYPES)
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, dim], got {tuple(key.shape)} and {tuple(value.shape)}")
    dim = key.shape[-1]
    _check_codecs(key_codec, value_codec, dim)
    layout = AffineSlot(dim, key_codec.bits, value_codec.bits, key_codec.group_size)
    C.check_tensor("cache", cache, (torch.uint8,))
    if cache.dim() != 4 or cache.shape[2:] != (key.shape[1], layout.slot_bytes):
        raise ValueError(f"cache must have shape [num_blocks, block_size, {key.shape[1]}, {layout.slot_bytes}] for {layout}, "
                         f"got {tuple(cache.shape)}")
    num_slots = cache.shape[0] * cache.shape[1]
    C.check_same_device(cache=cache, key=key, value=value, slot_mapping=slot_mapping)
    C.check_kernel_device("cache", cache)
    C.check_slot_mapping(slot_mapping, key.shape[0], num_slots, cache.device, values=check)
    codes = torch.cat([pack_affine(key, key_codec.bits, key_codec.group_size, "token", check=check),
                       pack_affine(value, value_codec.bits, value_codec.group_size, "token", check=check)], -1)
    keep = slot_mapping >= 0
    cache.view(num_slots, key.shape[1], layout.slot_bytes)[slot_mapping[keep].long()] = codes[keep]
    C.record_writer(cache, key_codec, value_codec)


class AffineStoreStep:
    """``store_affine_slots(key, value, slot_mapping, cache, key_codec, value_codec, check=False)`` repeated on
    inputs of one shape and dtype whose slots are all written (a decode step): each call encodes the keys and
    values into one staging slot per row (two launches prepared once, ``kvlab._kernels.launch``), then copies the rows
    into their slots. The bytes are ``store_affine_slots``'s; other inputs go through it."""

    def __init__(self, key, value, slot_mapping, cache, key_codec, value_codec):
        from .._kernels.launch import Launch
        from ..affine.triton import pack_token_spec

        store_affine_slots(key, value, slot_mapping, cache, key_codec, value_codec, check=False)  # checks
        num_tokens, num_heads, dim = key.shape
        self.cache, self.codecs, self.shape, self.dtype = cache, (key_codec, value_codec), tuple(key.shape), key.dtype
        layout = AffineSlot(dim, key_codec.bits, value_codec.bits, key_codec.group_size)
        self.staging = torch.zeros(num_tokens, num_heads, layout.slot_bytes, dtype=torch.uint8, device=cache.device)
        rows = self.staging.view(num_tokens * num_heads, layout.slot_bytes)
        self.launches = []
        for x, codec, start, size in ((key, key_codec, 0, layout.key_code_bytes),
                                      (value, value_codec, layout.value_offset, layout.value_code_bytes)):
            spec = pack_token_spec(x.reshape(-1, dim), rows[:, start:start + size], codec.bits, codec.group_size)
            self.launches.append(Launch(*spec, variable=("x",)))

    def __call__(self, key, value, slot_mapping) -> None:
        if (tuple(key.shape) != self.shape or value.shape != key.shape or key.dtype != self.dtype
                or value.dtype != self.dtype or not key.is_contiguous() or not value.is_contiguous()):
            store_affine_slots(key, value, slot_mapping, self.cache, *self.codecs, check=False)
            return
        num_tokens, num_heads, dim = key.shape
        with _on_device(self.cache.device):
            for launch, x in zip(self.launches, (key, value)):
                launch(x=x.view(-1, dim))
        self.cache.view(-1, num_heads, self.cache.shape[-1]).index_copy_(0, slot_mapping, self.staging)


def _slot_mapping(block_table, seq_lens, block_size: int, length: int) -> torch.Tensor:
    """``[batch, length]`` slots of positions ``0 .. length - 1`` (-1 past each sequence's end)."""
    t = torch.arange(length, device=block_table.device)
    blocks = block_table.long().gather(1, (t // block_size).expand(block_table.shape[0], -1))
    slots = blocks * block_size + t % block_size
    return torch.where(t[None, :] < seq_lens[:, None], slots, -1)


def prefill_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    key_codec,
    value_codec,
    *,
    scale: float | None = None,
    check: bool = True,
    position_offset: int = 0,
) -> torch.Tensor:
    """Continuation prefill: ``q`` ``[batch, q_len, num_q_heads, dim]`` are the last ``q_len`` tokens of
    each sequence (already in the cache); causal attention over the whole cached context.

    Materialises model-space K/V of all ``max(seq_lens)`` positions (MSE: ``load_mse(space="model")``,
    the inverse rotation as a batched matrix product, in the load kernel for 16-bit ``q``; centred
    keys: ``load_centered_mse``, token ``t`` at position ``position_offset + t``; affine:
    ``unpack_affine``) and runs torch SDPA with a causal, length-masked boolean mask. Returns
    ``q.dtype`` ``[batch, q_len, num_q_heads, dim]``.
    """
    C.check_tensor("q", q, (torch.float16, torch.bfloat16))
    if q.dim() != 4:
        raise ValueError(f"q must have shape [batch, q_len, num_q_heads, dim], got {tuple(q.shape)}")
    batch, q_len, num_q_heads, dim = q.shape
    if dim not in DIMS:
        raise ValueError(f"q's last dimension (head dim) must be one of {DIMS}, got {dim}")
    kind = _check_codecs(key_codec, value_codec, dim)
    centered, key_codec = _split_centered(key_codec, position_offset)
    layout = _slot_layout(kind, dim, key_codec, value_codec)
    num_blocks, block_size, num_kv_heads, capacity = _check_paged_inputs(q, cache, block_table, seq_lens, layout, True)
    if check:
        C.check_reader(cache, key_codec, value_codec)
        C.check_finite("q", q)
    if bool((seq_lens < q_len).any()):
        raise ValueError(f"seq_lens must be >= q_len ({q_len}): the new tokens are the last ones of each cached sequence")
    if scale is None:
        scale = dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    length = int(seq_lens.max())
    slots = _slot_mapping(block_table, seq_lens, block_size, length).reshape(-1)
    if kind == "mse":
        if centered is not None:
            positions = torch.arange(length, device=q.device).repeat(batch) + position_offset if centered.rope is not None else None
            k = load_centered_mse(cache, slots, centered, space="model", out_dtype=q.dtype, positions=positions)
        else:
            k = load_mse(cache, slots, key_codec, part="key", space="model", out_dtype=q.dtype)
        v = load_mse(cache, slots, value_codec, part="value", space="model", out_dtype=q.dtype)
    else:
        flat = cache.view(num_blocks * block_size, num_kv_heads, layout.slot_bytes)[slots.clamp_min(0)]
        gs = key_codec.group_size
        k = unpack_affine(flat[..., : layout.key_code_bytes].contiguous(), key_codec.bits, gs, "token", dim, q.dtype)
        v = unpack_affine(flat[..., layout.key_code_bytes:].contiguous(), value_codec.bits, gs, "token", dim, q.dtype)
    k = k.view(batch, length, num_kv_heads, dim).transpose(1, 2)
    v = v.view(batch, length, num_kv_heads, dim).transpose(1, 2)
    t = torch.arange(length, device=q.device)
    pos = seq_lens[:, None].long() - q_len + torch.arange(q_len, device=q.device)[None, :]  # [batch, q_len]
    mask = (t[None, None, :] <= pos[:, :, None]) & (t[None, None, :] < seq_lens[:, None, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=float(scale), enable_gqa=num_q_heads != num_kv_heads)
    return out.transpose(1, 2)
