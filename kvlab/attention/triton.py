"""Fused decode attention over kvlab's quantized paged KV cache: the Triton kernels of ``decode_attention``.

The split loop, its kernels and launch helpers; ``kvlab.attention.api`` checks, picks the loop and launches.

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
    value bits may differ; both use the same ``group_size``. ``kvlab.affine.reference.store_affine_reference``
    writes it; ``store_affine`` does the same with the ``encode_affine`` kernel.

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

"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .. import _checks as C
from ..layout import MSESlot
from .._kernels import tables as T  # per-codec device tables (rebuilt when the codec's tensors change), SMs
from .._kernels.mse_tile import mse_tile_fast as _mse_tile_fast, mse_words as _mse_words
from .._kernels.tables import tile_order
from ..layout import AffineSlot
from .triton_tiles import affine_tile_any, load_norm, mse_bytes, mse_tile_generic

__all__ = ["rope_mean_scores", "rotate_rows", "split_spec", "split_tables", "tile_order"]

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # default: a split covers at least this many keys
PROGRAMS_PER_SM = 16  # default number of splits: about this many programs per SM
NEG_BIG = tl.constexpr(-1.0e30)  # running maximum before any key (finite: no inf - inf)


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
        k0, k1, k2 = mse_bytes(cache_ptr, o_slot, m_n, BLOCK_N, D, BITS_K), b_none, b_none
        v0, v1, v2 = mse_bytes(cache_ptr, o_slot + VALUE_OFFSET, m_n, BLOCK_N, D, BITS_V), b_none, b_none
    b_kn = load_norm(cache_ptr, o_slot + KEY_NORM_OFFSET, m_n) * q_unscale
    b_vn = load_norm(cache_ptr, o_slot + VALUE_NORM_OFFSET, m_n)
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
        b_k = mse_tile_generic(k0, key_cent_ptr, BLOCK_N, D, BITS_K)
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
        b_v = mse_tile_generic(v0, value_cent_ptr, BLOCK_N, D, BITS_V)
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
    b_k = affine_tile_any(cache_ptr, o_slot, m_n, BLOCK_N, D, BITS_K, GROUP, FAST)
    b_s = tl.where(_per_key(m_n, KEYS_AS_ROWS), _scores(b_q, b_k, KEYS_AS_ROWS) * q_unscale, float("-inf"))
    b_m, b_alpha, b_p, b_l = _softmax_step(b_s, b_m, b_l, KEYS_AS_ROWS)
    b_v = affine_tile_any(cache_ptr, o_slot + VALUE_OFFSET, m_n, BLOCK_N, D, BITS_V, GROUP, FAST)
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


def rotate_spec(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, scale: torch.Tensor | None = None):
    """The launch of ``_rotate_rows_kernel`` (``kvlab._kernels.replay`` spec): ``out = (x * scale) @ w`` (``x``, ``out``
    contiguous, rows of ``w.shape[0]``)."""
    dim = x.shape[-1]
    rows = x.numel() // dim
    block_c = min(32, dim)
    args = dict(x_ptr=x, s_ptr=w if scale is None else scale, w_ptr=w, out_ptr=out, rows=rows,
                S_ROWS=1 if scale is None else scale.shape[0], D=dim, HAS_SCALE=scale is not None, BLOCK_R=16,
                BLOCK_C=block_c)
    return _rotate_rows_kernel, (C.cdiv(rows, 16), dim // block_c), args, dict(num_warps=4)


def rotate_rows(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``(x * scale) @ w`` over the last dimension of ``x`` in fp32, returned as ``dtype``: one launch of
    ``_rotate_rows_kernel`` (``w`` fp32 ``[dim, dim]``; ``scale`` fp32 ``[n, dim]``, row ``r`` of ``x``'s rows
    taking row ``r % n``). Decode rotates a few rows a call: one small kernel, not a cast, a GEMM and a cast."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel():
        fn, grid, args, options = rotate_spec(x, w, out, scale)
        with on_device(x.device):
            fn[grid](**args, **options)
    return out


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


def on_device(device: torch.device):
    """``device``'s context where it is not the current device (entering one costs host time every call)."""
    other = device.type == "cuda" and device.index not in (None, torch.cuda.current_device())
    return torch.cuda.device(device) if other else _nullcontext()


def partials(batch: int, num_q_heads: int, num_splits: int, dim: int, device):
    """fp32 buffers of a split loop: partial outputs, their running maxima and sums, and the merged output."""
    return (torch.empty(batch, num_q_heads, num_splits, dim, dtype=torch.float32, device=device),
            torch.empty(batch, num_q_heads, num_splits, 2, dtype=torch.float32, device=device),
            torch.empty(batch, num_q_heads, dim, dtype=torch.float32, device=device))


def merge_spec(o_part, ml_part, order, out):
    """The launch of ``_merge_splits_kernel`` (``kvlab._kernels.replay`` spec): ``out`` (natural coordinate order) from
    the splits of ``o_part``."""
    batch, num_q_heads, num_splits, dim = o_part.shape
    # on a GPU, 32 tile positions a program (more programs in flight); the interpreter, whole rows (fewer programs)
    block_d, block_s = (dim if out.device.type == "cpu" else min(32, dim)), min(64, max(2, C.next_power_of_2(num_splits)))
    args = dict(o_part_ptr=o_part, ml_part_ptr=ml_part, coord_ptr=order, out_ptr=out, num_splits=num_splits, D=dim,
                BLOCK_D=block_d, BLOCK_S=block_s, STEPS=C.cdiv(num_splits, block_s))
    return _merge_splits_kernel, (batch * num_q_heads, dim // block_d), args, dict(num_warps=2)


def merge(o_part, ml_part, order, out) -> None:
    """Launch ``_merge_splits_kernel`` (``merge_spec``)."""
    fn, grid, args, options = merge_spec(o_part, ml_part, order, out)
    fn[grid](**args, **options)


def split_tables(kind, key_codec, value_codec, dim: int, q_scale: float, fast: bool, device, centered=None,
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


def split_spec(q_in, cache, block_table, seq_lens, o_part, ml_part, bias, t: dict, key_codec, value_codec,
                split_len: int, num_blocks: int, capacity: int, q_unscale: float, *, kind: str, block_n: int,
                fast: bool, prefetch: bool, keys_as_rows: bool, interpreted: bool, num_warps: int, num_stages,
                max_registers):
    """The launch of ``_decode_split_kernel`` (``kvlab._kernels.replay`` spec)."""
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


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
