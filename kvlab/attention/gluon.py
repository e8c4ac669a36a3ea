"""The decode loop over a 2-, 3- or 4-bit MSE cache on the tensor cores' register operands (Gluon, GPU only).

What
    The split loop of ``kvlab.attention`` for MSE keys and values of 2, 3 or 4 bits each (2-bit values and
    3-bit keys or values: dim 128, so that a thread's code is a whole number of words, or of 3-byte groups
    of 8 indices): one program, one warp,
    attends a query group over a range of keys and writes the unnormalised partial output, its running
    maximum and sum, exactly as ``_decode_split_kernel`` does (``decode_attention`` merges the ranges
    and rotates the output back). It is written in Gluon, Triton's layout-explicit dialect, so that
    each dequantized tile is produced *in* the register layout of an ``mma.sync`` operand: no tile
    goes through shared memory, and no layout conversion moves data (every conversion below is
    checked trivial at compile time).

How (per step of ``BN = 16`` keys)
    * Transposed products, keys as MMA rows: ``S^T = K Q^T`` (A = the key tile ``[16, D]``, B = the
      rotated query group ``Q^T [D, BG]``, ``BG = max(8, group)``: an 8-row group fills the MMA's N
      with no padding) and ``out^T += V^T P^T`` (A = the value tile ``V^T [D, 16]``, B = ``P^T``).
    * A thread of an A fragment holds rows ``g, g + 8`` (``g = lane / 4``) and the column pairs
      ``2 t, 2 t + 1`` and ``2 t + 8, 2 t + 9`` (``t = lane % 4``) of each 16 columns. The order of
      coordinates inside a rotated vector is free, so each thread's data is made contiguous in the
      cache: for ``b``-bit keys, thread ``t`` reads the ``D b / 32`` bytes of a key code that hold
      coordinates ``D/4 t ..`` and the MMA columns take them in the order the lookup writes them
      (``query_order``: at 4 bits column ``32 q + 16 r1 + 8 r0 + 2 t + e`` is coordinate
      ``D/4 t + 8 q + 4 r1 + 2 r0 + e``); for values, thread ``g`` reads the ``D b / 64`` bytes of
      coordinates ``D/8 g ..`` of four keys (``2 t, 2 t + 1, 2 t + 8, 2 t + 9``) and MMA row
      ``g + 8 j`` is coordinate ``D/8 g + j`` (``output_order``, both widths). The query's rotation
      takes the first order, the merge puts the second back.
    * Lookups: the byte-permute lookups of ``kvlab._kernels.lookup`` (``lookup4_ptx``, ``lookup3_ptx``, ``lookup2_ptx``), on two key words at once
      (outputs in the order of two A fragments), and on four value words at once: the words of the
      key pairs are interleaved byte by byte first, so that each fp16 pair holds one coordinate of two
      keys, as an A fragment of ``V^T`` needs.
    * 3 bits: a group of 8 indices is 3 bytes and takes the place of a 4-bit word (same orders). A key
      thread reads 3 words (4 groups); a value thread's 6 bytes start 2 bytes past a word boundary or on
      one (even or odd ``g``), so it reads the two aligned words that hold them and shifts by 16 or 0.
      The value lookup spreads each group's indices into the nibbles of a ``prmt`` selector, then
      interleaves the selectors of a key pair byte by byte, as the 4-bit words are.
    * ``P^T`` comes from ``S^T``'s accumulator (scaled by each key's value norm, rounded to fp16) by
      one small exchange within the warp; the key norm scales ``S^T``'s rows.
    * Reads: a step is a block-table entry (when ``block_size`` is a multiple of 16, one per step; else
      one per key), 4-byte code words (the value code starts 2 bytes past a word boundary: the two
      aligned words around each of its words are read) and the fp16 norms, which the threads of a
      key's words read. A thread's slot addresses are one scalar a step plus offsets computed once;
      keys past the end of the sequence are read at its last key's slot, so that no read is masked
      (with ``block_size`` a multiple of 16). The loop is unrolled by two and each half issues the
      reads of the next step before its arithmetic.

Needs a CUDA GPU of compute capability 8.0 or later (``mma.sync`` m16n8k16); Triton's interpreter
cannot run Gluon, so on a CPU ``decode_attention`` uses the split loop. ``tests/ops/test_attention.py``
compares both loops with the reference on the GPU.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from ..layout import MMA_BITS as BITS, MMA_DIMS as DIMS  # 2-bit values and 3-bit keys or values: dim 128
from .._kernels.lookup import lookup2_ptx, lookup3_ptx, lookup4_ptx, spread3_ptx
from .._kernels.mma_tile import (  # the key operand's words, layout and lookup, shared with the model-space MSE load
    STEP, bit_range as _bits, halves as _halves, join_bits as _join_bits, key_tile as _key_tile, query_order,
)

__all__ = ["DIMS", "STEP", "default_splits", "launch", "output_order", "query_order"]

BN = gl.constexpr(STEP)
# (key, value) widths decode_attention runs here by default: all, each measured faster than the split loop
# (results/decode_attention.csv; on an H200 at batch 8 and 32k tokens, 3-bit keys and values 2.5x the split loop)
DEFAULT_BITS = {(kb, vb) for kb in BITS for vb in BITS}
MAX_GROUP = 16  # query heads per KV head
# The default number of splits of a sequence (results/decode_mma_splits.json: within 4 % of the fastest of
# 2 .. 1024 splits at each grid point measured, K4V4 and K2V2): about KEYS_PER_PROGRAM keys a one-warp program,
KEYS_PER_PROGRAM = 512
MIN_PROGRAMS_PER_SM, MAX_PROGRAMS_PER_SM = 8, 64  # but between these many programs an SM,
MIN_SPLIT_KEYS = 32  # and at least this many keys a split


def default_splits(rows: int, capacity: int, sm_count: int) -> int:
    """The default split count for ``rows`` (batch x KV heads) sequences of ``capacity`` keys on ``sm_count``
    SMs: about ``KEYS_PER_PROGRAM`` keys a program, between ``MIN_PROGRAMS_PER_SM`` and
    ``MAX_PROGRAMS_PER_SM`` programs an SM, at least ``MIN_SPLIT_KEYS`` keys a split. Little work gets
    many short splits (the call's latency is the loop's), much work long ones (fewer partials to merge)."""
    rows = max(1, rows)
    programs = min(max(rows * capacity / KEYS_PER_PROGRAM, MIN_PROGRAMS_PER_SM * sm_count), MAX_PROGRAMS_PER_SM * sm_count)
    return max(1, min(round(programs / rows), -(-capacity // MIN_SPLIT_KEYS)))


def num_registers(group_rows: int) -> int | None:
    """The launch's register cap (``maxnreg``) for 8 query rows: 128 at every width (16 programs an SM, no
    spills; measured on an H200, 2026-12-02: 152, 13 programs an SM, was up to 6 % slower at 3 and 4
    bits, and 120 or 112, 17 or 18 programs an SM and no spills either, 1-8 % slower); none for 16 rows."""
    if group_rows > 8:
        return None
    return 128


MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
OPERAND_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
OPERAND_B = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)

def _four_values() -> str:
    """Four value words (the same 8 coordinates of keys k0, k1 = pair 0 and k2, k3 = pair 1) -> 16 fp16
    pairs: output ``4 a + 2 P + d`` holds coordinate ``2 a + d`` of the two keys of pair ``P``."""
    body = ("{\n.reg .b32 m0lo, m0hi, m1lo, m1hi;\n"
            "prmt.b32 m0lo, $16, $17, 0x5140;\nprmt.b32 m0hi, $16, $17, 0x7362;\n"
            "prmt.b32 m1lo, $18, $19, 0x5140;\nprmt.b32 m1hi, $18, $19, 0x7362;\n")
    for pair, words in enumerate((("m0lo", "m0hi"), ("m1lo", "m1hi"))):
        for half, word in enumerate(words):  # coordinates 4 half .. 4 half + 3
            outs = [f"${4 * ((4 * half + c) // 2) + 2 * pair + c % 2}" for c in range(4)]
            body += lookup4_ptx(word, outs, ("0x6240", "0x7351"), ("$20", "$21", "$22", "$23"))
    return body + "}"


LOOKUP4_FOUR_VALUES = gl.constexpr(_four_values())

def _four_values2(half: int) -> str:
    """2 bit: four value words (keys k0, k1 = pair 0, k2, k3 = pair 1) -> 16 fp16 pairs of coordinates
    ``8 half .. 8 half + 7``: output ``4 a + 2 P + d`` holds coordinate ``8 half + 2 a + d`` of pair ``P``."""
    sel = ("0x5140", "0x7362")[half]
    body = f"{{\n.reg .b32 m0, m1;\nprmt.b32 m0, $16, $17, {sel};\nprmt.b32 m1, $18, $19, {sel};\n"
    for pair, word in enumerate(("m0", "m1")):
        body += lookup2_ptx(word, [f"${4 * (i // 2) + 2 * pair + i % 2}" for i in range(8)], ("$20", "$21"))
    return body + "}"


LOOKUP2_FOUR_VALUES_LO = gl.constexpr(_four_values2(0))
LOOKUP2_FOUR_VALUES_HI = gl.constexpr(_four_values2(1))

def _four_values3() -> str:
    """3 bit: four value groups (the same 8 coordinates of keys k0, k1 = pair 0 and k2, k3 = pair 1) -> 16
    fp16 pairs, in the order of the 4-bit lookup of four value words: each group is spread into the
    nibbles of a selector (``spread3_ptx``), whose bytes are then interleaved as the 4-bit words' are."""
    body = "{\n.reg .b32 x0, x1, x2, x3, m0lo, m0hi, m1lo, m1hi;\n"
    body += "".join(spread3_ptx(f"${16 + k}", f"x{k}") for k in range(4))
    body += ("prmt.b32 m0lo, x0, x1, 0x5140;\nprmt.b32 m0hi, x0, x1, 0x7362;\n"
             "prmt.b32 m1lo, x2, x3, 0x5140;\nprmt.b32 m1hi, x2, x3, 0x7362;\n")
    for pair, words in enumerate((("m0lo", "m0hi"), ("m1lo", "m1hi"))):
        for half, word in enumerate(words):  # coordinates 4 half .. 4 half + 3
            outs = [f"${4 * ((4 * half + c) // 2) + 2 * pair + c % 2}" for c in range(4)]
            body += lookup3_ptx(word, outs, ("0x6240", "0x7351"), ("$20", "$21", "$22", "$23"), spread=False)
    return body + "}"


LOOKUP3_FOUR_VALUES = gl.constexpr(_four_values3())


@functools.lru_cache(maxsize=None)
def value_words_layout(dim: int, bits: int) -> gl.DistributedLinearLayout:
    """``[BN, 8, dim bits / 256]`` words (key ``16 c + 8 h + 2 t + e``, thread row ``g``, word ``w``); 3 bits
    (dim 128): one, the first of the two aligned words that hold the thread's 6 bytes."""
    nw = dim * bits // 256
    reg = [[1, 0, 0], [8, 0, 0]] + [[0, 0, 1 << i] for i in _bits(nw)]
    return gl.DistributedLinearLayout(reg, [[2, 0, 0], [4, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]], [], [], [STEP, 8, nw])


def output_order(dim: int) -> torch.Tensor:
    """int64 ``[dim]``: the rotated coordinate at each row of the output (``V^T``'s rows)."""
    n = torch.arange(dim)
    return (dim // 8) * (n % 8) + n // 8


@gluon.jit
def _block_of(block_table_ptr, i_b, stride_bt, n0, end, BLOCK_SIZE: gl.constexpr):
    """The physical block of key ``n0`` (clamped to the last key: the reads past the end are masked)."""
    return gl.load(block_table_ptr + i_b * stride_bt + gl.minimum(n0, end - 1) // BLOCK_SIZE).to(gl.int64)


@gluon.jit
def _slots(cache_ptr, block_table_ptr, blk, n0, o_n, off, h_off, end, i_b, stride_bt, stride_block, stride_pos,
           BLOCK_SIZE: gl.constexpr):
    """Keys ``n0 + o_n`` -> (valid below ``end``, the address of each one's slot of the program's KV head).
    ``off`` is ``o_n * stride_pos + h_off`` (computed once), ``h_off`` the head's offset in a position.

    A step that lies in one block (``blk``, that of key ``min(n0, end - 1)``) reads each key past the last
    (``end - 1``) at the last one's slot: every read is in a written slot, no read is masked (a masked read
    also zeroes its registers), and the keys past the end get scores of -inf from the mask."""
    m = o_n < end - n0
    if BLOCK_SIZE % BN == 0:
        n_first = gl.minimum(n0, end - 1)
        last = (end - 1 - n_first) * stride_pos + h_off  # ``off`` of the last key
        return m, (cache_ptr + (blk * stride_block + (n_first % BLOCK_SIZE) * stride_pos)) + gl.minimum(off, last)
    else:  # a block per key; the reads past the end are masked
        b = gl.load(block_table_ptr + i_b * stride_bt + (n0 + o_n) // BLOCK_SIZE, mask=m, other=0).to(gl.int64)
        return m, cache_ptr + (b * stride_block + ((n0 + o_n) % BLOCK_SIZE) * stride_pos + h_off)


@gluon.jit
def _fetch(cache_ptr, block_table_ptr, blk, n0, end, i_b, o_nk, off_k, o_wk, m_wk, o_nv, off_v, o_wv, h_off, stride_bt,
           stride_block, stride_pos, BLOCK_SIZE: gl.constexpr, KEY_NORM_OFFSET: gl.constexpr,
           VALUE_OFFSET: gl.constexpr, VALUE_NORM_OFFSET: gl.constexpr, KW: gl.constexpr, NWT: gl.constexpr):
    """The reads of the step at keys ``n0 .. n0 + BN``: key words (the first ``KW`` of ``NWT``, ``m_wk``), the
    two aligned words around each value word, key and value norms (raw fp16 bits, read by the threads of
    each key's words, which hold the same keys as the rows of ``S^T``)."""
    m_k, p_k = _slots(cache_ptr, block_table_ptr, blk, n0, o_nk, off_k, h_off, end, i_b, stride_bt, stride_block, stride_pos,
                      BLOCK_SIZE)
    m_v, p_v = _slots(cache_ptr, block_table_ptr, blk, n0, o_nv, off_v, h_off, end, i_b, stride_bt, stride_block, stride_pos,
                      BLOCK_SIZE)
    p_k32 = p_k.to(gl.pointer_type(gl.int32))[:, None, None] + o_wk
    p_v = (p_v + (VALUE_OFFSET - 2)).to(gl.pointer_type(gl.int32))[:, None, None] + o_wv
    p_kn = (p_k + KEY_NORM_OFFSET).to(gl.pointer_type(gl.uint16))
    p_vn = (p_k + VALUE_NORM_OFFSET).to(gl.pointer_type(gl.uint16))
    if BLOCK_SIZE % BN == 0:  # every read in a written slot (a 3-bit key's fourth word: its norm and the value's first bytes)
        w_k = gl.load(p_k32)
        w_a = gl.load(p_v)
        w_b = gl.load(p_v + 1)
        kn = gl.load(p_kn)
        vn = gl.load(p_vn)
    else:
        w_k = gl.load(p_k32, mask=m_k[:, None, None] & m_wk, other=0)
        w_a = gl.load(p_v, mask=m_v[:, None, None], other=0)
        w_b = gl.load(p_v + 1, mask=m_v[:, None, None], other=0)
        kn = gl.load(p_kn, mask=m_k, other=0)
        vn = gl.load(p_vn, mask=m_k, other=0)
    rows: gl.constexpr = gl.SliceLayout(1, MMA)
    return (w_k, w_a, w_b, gl.convert_layout(kn, rows, assert_trivial=True),
            gl.convert_layout(vn, rows, assert_trivial=True))


@gluon.jit
def _value_tile(w_a, w_b, v_shift, tv0, tv1, tv2, tv3, D: gl.constexpr, BITS: gl.constexpr):
    """The two aligned words around each value word -> the A operand V^T ``[D, BN]`` fp16 (rows in
    ``output_order``). 3 bits: the two aligned words that hold a thread's 6 bytes, from bit ``v_shift``."""
    if BITS == 3:  # two groups of 8 indices, as the two words of a 4-bit code
        NWV: gl.constexpr = 2
        x = ((w_b.to(gl.uint32).to(gl.uint64) << 32) | w_a.to(gl.uint32).to(gl.uint64)) >> v_shift
        w_v = gl.reshape(gl.join(x.to(gl.uint32), (x >> 24).to(gl.uint32)), [BN, 8, 2]).to(gl.int32)
    else:
        NWV: gl.constexpr = D * BITS // 256
        # the middle 32 bits of each pair of aligned words
        w_v = ((w_a.to(gl.uint32) >> 16) | (w_b.to(gl.uint32) << 16)).to(gl.int32)
    # keys (2t, 2t+1) and (2t+8, 2t+9)
    e0, e1 = gl.split(gl.permute(gl.reshape(w_v, [BN // 16, 2, 4, 2, 8, NWV]), (0, 2, 4, 5, 1, 3)))
    v_0, v_2 = gl.split(e0)
    v_1, v_3 = gl.split(e1)
    if BITS != 2:
        vo = gl.inline_asm_elementwise(LOOKUP4_FOUR_VALUES if BITS == 4 else LOOKUP3_FOUR_VALUES, "=r," * 16 + "r,r,r,r,r,r,r,r",
                                       [v_0, v_1, v_2, v_3, tv0, tv1, tv2, tv3], dtype=(gl.int32,) * 16, is_pure=True, pack=1)
        lo, hi = _halves(_join_bits(vo, 4))
        # axes (c, t, g, w, d, P, a0, a1, e) -> rows (w, a1, a0, d, g), columns (c, P, t, e)
        b_vt = gl.reshape(gl.permute(gl.join(lo, hi), (3, 7, 6, 4, 2, 0, 5, 1, 8)), [D, BN])
    else:
        v_lo = gl.inline_asm_elementwise(LOOKUP2_FOUR_VALUES_LO, "=r," * 16 + "r,r,r,r,r,r", [v_0, v_1, v_2, v_3, tv0, tv1],
                                         dtype=(gl.int32,) * 16, is_pure=True, pack=1)
        v_hi = gl.inline_asm_elementwise(LOOKUP2_FOUR_VALUES_HI, "=r," * 16 + "r,r,r,r,r,r", [v_0, v_1, v_2, v_3, tv0, tv1],
                                         dtype=(gl.int32,) * 16, is_pure=True, pack=1)
        lo, hi = _halves(gl.join(_join_bits(v_lo, 4), _join_bits(v_hi, 4)))
        # axes (c, t, g, w, d, P, a0, a1, half, e) -> rows (w, half, a1, a0, d, g), columns (c, P, t, e)
        b_vt = gl.reshape(gl.permute(gl.join(lo, hi), (3, 8, 7, 6, 4, 2, 0, 5, 1, 9)), [D, BN])
    return gl.convert_layout(b_vt, OPERAND_A, assert_trivial=True)


@gluon.jit
def _attend(b_qt, acc, m_i, l_i, w_k, w_a, w_b, v_shift, kn, vn, n0, end, o_nc, tk0, tk1, tk2, tk3, tv0, tv1, tv2, tv3,
            D: gl.constexpr, BG: gl.constexpr, BITS_K: gl.constexpr, BITS_V: gl.constexpr):
    """One step on what ``_fetch`` read: scores, online softmax (base 2), output update."""
    b_k = _key_tile(w_k, tk0, tk1, tk2, tk3, D, BITS_K, BN, OPERAND_A)
    s = mma_v2(b_k, b_qt, gl.full([BN, BG], 0.0, gl.float32, layout=MMA))  # S^T [BN, BG]
    m_c = o_nc < end - n0
    s = gl.where(m_c[:, None], s * kn.to(gl.float16, bitcast=True).to(gl.float32)[:, None], float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + gl.sum(p, axis=0)
    acc = acc * alpha[None, :]
    b_vt = _value_tile(w_a, w_b, v_shift, tv0, tv1, tv2, tv3, D, BITS_V)
    b_pt = gl.convert_layout((p * vn.to(gl.float16, bitcast=True).to(gl.float32)[:, None]).to(gl.float16), OPERAND_B)
    return mma_v2(b_vt, b_pt, acc), m_new, l_i


# Runtime arguments are not specialised on (values, divisibility, alignment): a compiled kernel depends
# only on the constants, the launch options and the argument types, so that ``launch`` can reuse it
# without Triton's per-call argument binding.
_RUNTIME = ["q_ptr", "cache_ptr", "block_table_ptr", "seq_lens_ptr", "o_part_ptr", "ml_part_ptr", "tk0", "tk1", "tk2", "tk3",
            "tv0", "tv1", "tv2", "tv3", "split_len", "num_splits", "stride_bt", "stride_block", "stride_pos", "stride_head"]


@gluon.jit(do_not_specialize=_RUNTIME[6:], do_not_specialize_on_alignment=_RUNTIME[:6])
def decode_mma_kernel(
    q_ptr,  # fp16 [batch, HQ, D]: rotated, in query_order, times scale * log2(e)
    cache_ptr,  # uint8 [num_blocks, block_size, HKV, slot_bytes], 4-byte aligned
    block_table_ptr,  # int32 [batch, max_blocks]
    seq_lens_ptr,  # int32/int64 [batch]
    o_part_ptr,  # fp32 [batch, HQ, num_splits, D]: unnormalised partial outputs (output_order)
    ml_part_ptr,  # fp32 [batch, HQ, num_splits, 2]: running maximum (base 2) and sum
    tk0, tk1, tk2, tk3, tv0, tv1, tv2, tv3,  # byte planes of the key and value codebook magnitudes
    split_len,  # keys per split, a multiple of BN
    num_splits,
    stride_bt,
    stride_block,
    stride_pos,
    stride_head,
    HQ: gl.constexpr,
    HKV: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    D: gl.constexpr,
    KEY_NORM_OFFSET: gl.constexpr,
    VALUE_OFFSET: gl.constexpr,  # 2 more than a multiple of 4
    VALUE_NORM_OFFSET: gl.constexpr,
    BG: gl.constexpr,  # query rows per program: the group, at least 8
    BITS_K: gl.constexpr,  # 2, 3 or 4 (3: D == 128)
    BITS_V: gl.constexpr,  # 2, 3 or 4 (2 or 3: D == 128)
    KEY_WORDS: gl.constexpr,  # key_words_layout(D, BITS_K)
    VALUE_WORDS: gl.constexpr,  # value_words_layout(D, BITS_V)
):
    G: gl.constexpr = HQ // HKV
    KW: gl.constexpr = D * BITS_K // 128  # key code words a thread reads
    NWT: gl.constexpr = KW if BITS_K != 3 else 4  # held in a power of two
    NWV: gl.constexpr = D * BITS_V // 256
    i_bh = gl.program_id(0).to(gl.int64)
    i_s = gl.program_id(1)
    i_b = i_bh // HKV
    i_h = i_bh % HKV
    seq_len = gl.load(seq_lens_ptr + i_b).to(gl.int32)
    start = i_s * split_len
    end = gl.minimum(start + split_len, seq_len)

    # Q^T [D, BG], the B operand of every step
    QL: gl.constexpr = gl.BlockedLayout([4, 1], [8, 4], [1, 1], [0, 1])
    o_dq = gl.arange(0, D, layout=gl.SliceLayout(1, QL))
    o_gq = gl.arange(0, BG, layout=gl.SliceLayout(0, QL))
    rows_q = (i_b * HQ + i_h * G + o_gq).to(gl.int64)
    b_qt = gl.load(q_ptr + rows_q[None, :] * D + o_dq[:, None], mask=(o_gq < G)[None, :], other=0.0)
    b_qt = gl.convert_layout(b_qt, OPERAND_B)

    # the word each thread reads: keys and values of a step, and the keys (rows of S^T) of the norms
    o_nk = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, KEY_WORDS)))
    o_tk = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, KEY_WORDS)))
    o_qk = gl.arange(0, NWT, layout=gl.SliceLayout(0, gl.SliceLayout(1, KEY_WORDS)))
    o_wk = (o_tk * KW)[None, :, None] + o_qk[None, None, :]
    m_wk = (o_qk < KW)[None, None, :]
    o_nv = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, VALUE_WORDS)))
    o_gv = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, VALUE_WORDS)))
    o_qv = gl.arange(0, NWV, layout=gl.SliceLayout(0, gl.SliceLayout(1, VALUE_WORDS)))
    if BITS_V == 3:  # thread g's 6 bytes start at byte 6 g of the value code, 2 bytes past a word boundary if g is even
        o_wv = ((6 * o_gv + 2) // 4)[None, :, None] + o_qv[None, None, :]
        v_shift = (16 * (1 - o_gv % 2)).to(gl.uint64)[None, :, None]
    else:
        o_wv = (o_gv * NWV)[None, :, None] + o_qv[None, None, :]
        v_shift = 0
    o_nc = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    h_off = i_h.to(gl.int32) * stride_head
    off_k = o_nk * stride_pos + h_off  # the slots of a step's keys, past its first key's
    off_v = o_nv * stride_pos + h_off

    m_i = gl.full([BG], -1.0e30, gl.float32, layout=gl.SliceLayout(0, MMA))  # finite: no inf - inf
    l_i = gl.full([BG], 0.0, gl.float32, layout=gl.SliceLayout(0, MMA))
    acc = gl.full([D, BG], 0.0, gl.float32, layout=MMA)  # out^T
    if end > start:  # an empty split reads nothing (not even the block table)
        blk = _block_of(block_table_ptr, i_b, stride_bt, start, end, BLOCK_SIZE)
        blk_b = _block_of(block_table_ptr, i_b, stride_bt, start + BN, end, BLOCK_SIZE)
        a_k, a_a, a_b, a_kn, a_vn = _fetch(cache_ptr, block_table_ptr, blk, start, end, i_b, o_nk, off_k, o_wk, m_wk, o_nv, off_v,
                                           o_wv, h_off, stride_bt, stride_block, stride_pos, BLOCK_SIZE, KEY_NORM_OFFSET,
                                           VALUE_OFFSET, VALUE_NORM_OFFSET, KW, NWT)
        # two steps a trip, on two sets of reads (no copies between them); past the end the reads repeat the
        # last key (or are masked) and the step changes nothing (its scores are -inf)
        for n0 in range(start, end, 2 * BN):
            blk_a = _block_of(block_table_ptr, i_b, stride_bt, n0 + 2 * BN, end, BLOCK_SIZE)
            b_k, b_a, b_b, b_kn, b_vn = _fetch(cache_ptr, block_table_ptr, blk_b, n0 + BN, end, i_b, o_nk, off_k, o_wk, m_wk, o_nv,
                                               off_v, o_wv, h_off, stride_bt, stride_block, stride_pos, BLOCK_SIZE,
                                               KEY_NORM_OFFSET, VALUE_OFFSET, VALUE_NORM_OFFSET, KW, NWT)
            acc, m_i, l_i = _attend(b_qt, acc, m_i, l_i, a_k, a_a, a_b, v_shift, a_kn, a_vn, n0, end, o_nc, tk0, tk1, tk2, tk3,
                                    tv0, tv1, tv2, tv3, D, BG, BITS_K, BITS_V)
            blk_b = _block_of(block_table_ptr, i_b, stride_bt, n0 + 3 * BN, end, BLOCK_SIZE)
            a_k, a_a, a_b, a_kn, a_vn = _fetch(cache_ptr, block_table_ptr, blk_a, n0 + 2 * BN, end, i_b, o_nk, off_k, o_wk, m_wk,
                                               o_nv, off_v, o_wv, h_off, stride_bt, stride_block, stride_pos, BLOCK_SIZE,
                                               KEY_NORM_OFFSET, VALUE_OFFSET, VALUE_NORM_OFFSET, KW, NWT)
            acc, m_i, l_i = _attend(b_qt, acc, m_i, l_i, b_k, b_a, b_b, v_shift, b_kn, b_vn, n0 + BN, end, o_nc, tk0, tk1, tk2, tk3,
                                    tv0, tv1, tv2, tv3, D, BG, BITS_K, BITS_V)

    o_d = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    o_g = gl.arange(0, BG, layout=gl.SliceLayout(0, MMA))
    rows = (i_b * HQ + i_h * G + o_g).to(gl.int64) * num_splits + i_s
    gl.store(o_part_ptr + rows[None, :] * D + o_d[:, None], acc, mask=(o_g < G)[None, :])
    gl.store(ml_part_ptr + rows * 2, m_i, mask=o_g < G)
    gl.store(ml_part_ptr + rows * 2 + 1, l_i, mask=o_g < G)


def spec(grid, args: tuple, constants: dict, options: dict):
    """``launch``'s arguments as a ``kvlab._kernels.replay`` spec: ``(kernel, grid, arguments by name, options)``."""
    return decode_mma_kernel, tuple(grid), dict(zip(decode_mma_kernel.arg_names, args), **constants), dict(options)


_COMPILED = {}  # (device, constants, options, argument types) -> compiled kernel


def launch(grid, args: tuple, constants: dict, options: dict) -> None:
    """Launch ``decode_mma_kernel`` on ``grid`` with the runtime ``args`` (in order) and the ``constants``
    (in the kernel's order): the first launch of a kind compiles through Triton's JIT, later ones go
    straight to the compiled kernel (decode runs once per generated token: the host's share counts)."""
    grid = tuple(grid) + (1,) * (3 - len(grid))
    kinds = tuple(a.dtype if isinstance(a, torch.Tensor) else -(2**31) <= a < 2**31 for a in args)  # int: 32 or 64 bit
    key = (args[0].device, tuple(constants.items()), tuple(options.items()), kinds)
    compiled = _COMPILED.get(key)
    if compiled is None:
        _COMPILED[key] = decode_mma_kernel[grid](*args, **constants, **options)
    else:
        compiled[grid](*args, *constants.values())
