"""Triton kernels for the MSE codec in the paged KV cache: ``store_mse`` and ``load_mse``.

What
    ``store_mse`` encodes keys and values of a batch and writes their codes into the cache slots of
    ``slot_mapping``: rotate, take the norm (fp64 accumulation, rounded to fp32), quantize each
    normalised coordinate with the codec's odd quantizer (its sign, then the number of positive
    Lloyd-Max boundaries strictly below its magnitude; ``MSECodec.encode``), pack the
    sign-magnitude codes (``kvlab.layout``), append the fp16 scale: the norm, divided (with norm
    correction) by the length of the picked centroid vector, an fp64 sum of the picked centroids'
    squares (gathered from a table of fp64 sums of the squares of the centroids of one or two
    consecutive codes, ``_square_sums``). One launch for the keys, one for the values. The rotation
    depends on the codec:

    * Hadamard codecs (``codec.hadamard_signs`` set): FUSED. The kernel reads the fp16/bf16/fp32
      input rows and computes ``fwht(x * signs) * scale`` itself, with the reference's butterflies
      in the reference's order (``kvlab.rotation.fwht``), so the rotated rows are bit-identical.
    * Haar codecs: the rotation ``y = x.float() @ R`` is one batched torch GEMM per tensor (the
      reference's, so the bytes match), and the kernel reads the fp32 rows ``y``.

    No division: ``fl(y / norm) > b`` is decided as ``y > t`` with a per-row float32 threshold ``t``
    derived exactly from ``norm`` and ``b`` (``_thresholds``; ``fl(|y| / norm) = |fl(y / norm)|``, so
    the magnitude is compared as ``|y| > t``), and a binary search over the ``2**(bits-1) - 1``
    positive thresholds gives the magnitude, the zero boundary's threshold the sign. Bytes equal
    the reference's exactly (``torch.equal``). The store kernel is compiled without FMA contraction
    (``enable_fp_fusion=False``): ``y = z * scale`` must be rounded before it is compared; the only
    fused multiply-adds left are explicit fp64 ones on exact squares (the norm), which round like a
    multiply and an add; the scale is an IEEE division (``tl.div_rn``).

    ``load_mse`` reads the key or the value part of the slots back: unpack the indices, gather the
    centroids (a table of at most 16 floats, one cache line), multiply by the stored fp16 scale (the
    norm correction is in it). ``space="rotated"`` returns that (what attention in
    rotated space consumes). ``space="model"`` rotates back by ``R.T``: for fp16/bf16 outputs (dims up
    to 128) inside the kernel, as ``(c R^T) s``: the fp16 centroid tile ``c`` times an fp16 ``R^T`` on
    the tensor cores (fp32 accumulation), then each row times its scale ``s`` in fp32 (the error is of
    the order of the output's rounding), each tile then written by one bulk (TMA) store from shared
    memory through a tensor descriptor of the output (sm_90 and later, dims of 16 to 128); for fp32
    outputs the kernel writes the rotated rows and one batched fp32 GEMM follows (the reference's product).

Tiling
    Store: one row per thread (``block_rows = 32 * num_warps`` by default); rows longer than
    ``piece`` columns (128 by default; 16, 32 or 64 on request) are cut into pieces on neighbouring
    lanes (dim 256: two threads per row, ``block_rows = 16 * num_warps``), whose last butterfly
    stages pair the pieces through two-term sums across lanes. A row is loaded as 16-byte chunks of
    8 columns, so a thread holds its piece in registers: the butterflies, the norm and the
    2**(bits-1) thresholds of the row cost no data movement (two threads per row cost more
    instructions per byte than the registers of one, 178 at 4 bits: the per-row work is done twice
    and the last stages cross lanes). Compiled at its default launch, the 3- and 4-bit stores are
    capped at 168 registers a thread (``STORE_MAXNREG``): three programs an SM instead of two, for a
    few spilled values. The packed code goes out as 4-byte words through
    a coalesced store (a head and a tail of at most 3 bytes per row when the code is not 4-byte
    aligned; bytes when the cache's strides are not multiples of 4).

    On a CUDA GPU the Hadamard store at dim 128 and its default tiling runs the Gluon kernel of
    ``kvlab.mse_store`` instead (``STORE_GLUON``): a row on four threads, the butterflies within chunks of
    8 columns, one layout conversion through shared memory, the butterflies across chunks; the same bytes,
    with 64 registers a thread and four times the resident warps.

    Load: a thread decodes groups of 8 elements (``bits`` bytes in, 16 bytes of fp16 out, one
    vector store), loading the group's bytes 4, 2 or 1 at a time as the cache's alignment allows;
    consecutive groups of a row sit on consecutive lanes, so loads and stores are coalesced. 3-bit
    codes of dims 32, 64, 128 and 256 that all start on or 2 bytes past a 4-byte boundary are read
    as 32-bit words instead, three words for four groups, as the model-space load reads them.

    Model-space load (16-bit outputs): persistent programs, 4 an SM, each loads ``R^T`` (32 KB at dim
    128) once and loops over tiles of 64 rows, a warpgroup MMA each. Compiled, the centroids come
    from byte permutes of the 32-bit code words (``prmt``, inline PTX, as in ``kvlab.decode``: the fp16
    codebook held as byte planes in registers; 4 bits needs a symmetric codebook), in the lookup's
    tile order, which ``R^T``'s rows follow (``tile_order``); the loop reads the next tile's words
    before computing the current one. Elsewhere (the interpreter, other dims, odd alignments) it
    shifts out each index and gathers its centroid. On sm_90 at the default tile (dims 64 and 128,
    fp16/bf16 out) the same load runs the Gluon kernel of ``kvlab.mse_mma`` instead: the lookups
    produce the centroid tile in the register layout of the warpgroup MMA's A operand and the
    product leaves from registers as 16-byte stores, with no pass through shared memory a tile.

    Eight ``bits``-wide indices make exactly ``bits`` bytes (a "group"): packing sums the eight
    shifted indices of a group into one word, unpacking shifts them back out.

Layout (``kvlab.layout``)
    cache: uint8 ``[num_blocks, block_size, num_heads, slot_bytes]``, one slot of one head is
    ``key indices | key norm (fp16 LE) | value indices | value norm (fp16 LE)``. Token ``i`` goes to
    slot ``slot_mapping[i] = block * block_size + offset``; ``-1`` is padding (not written; read as
    zeros). Indices form a little-endian bit stream, element ``j`` at bit ``bits * j``. Kernels are
    compiled per ``num_heads`` and ``block_size`` (the row and slot divisions become multiplies).

Reference
    ``kvlab.reference.MSECodec.encode`` / ``decode`` with ``write_slots`` / ``read_slots``. This module
    does not import it; ``tests/test_mse_kernels.py`` compares the two (``torch.equal`` on the cache).

Checks
    With ``check=True`` (the default) the launchers also check values, which costs one host sync per
    call: slot numbers in range (before the launch) and, for ``store_mse``, NaN/Inf inputs and stored
    norms outside fp16's normal range, above 65504 or nonzero below 6.1e-05 (the kernel writes each
    row's norm, the launcher checks them after the launch and, if one is bad, puts the call's slots back
    as they were before raising). ``store_mse`` records the key and value codecs that wrote the cache
    and a checked ``load_mse`` refuses a codec of another identity (``kvlab._checks.check_reader``).
    ``check=False`` skips every value check and never syncs; the kernels still skip out-of-range slots
    instead of writing outside the cache.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import _checks as C
from .._kernels import tables as T
from .._kernels.mse_tile import groups3 as _groups3, join_all as _join_all, mse_tile_fast as _mse_tile_fast, mse_words as _mse_words
from .._kernels.tables import tile_order
from ..params import MSEParams
from ..layout import MSE_BITS, NORM_BYTES, MSESlot, code_order, packed_bytes

__all__ = ["load_mse", "store_mse", "unpack_values_model_space", "unpack_values_rotated"]

GROUP = 8  # indices per group: 8 indices of `bits` bits are exactly `bits` bytes
STORE_PIECE = 128  # columns of a row one store thread holds (registers); longer rows are split
# at most 168 registers a thread for the 3- and 4-bit stores (else 173 and 178): 3 programs of 4 warps an SM
# instead of 2, for a few spilled bytes; 1.08x (3 bits) and 1.04x (4 bits) faster on an H200
# (results/codec_ab_store_maxnreg.json); the 2-bit store needs 166 and is slower capped
STORE_MAXNREG = {3: 168, 4: 168}
LOAD_TILE_ELEMENTS = 2048  # default BLOCK_ROWS * BLOCK_D of a load program (16 rows of 128)
LOAD_NUM_WARPS = {2: 2, 3: 1, 4: 1}  # default warps of a load program, by bits
# model-space load: rows per tile (a tensor-core tile of y R^T), warps, persistent programs per SM, one
# stage (the loop prefetches its next tile by hand; Triton's pipelining stages loads through shared
# memory) and at most 128 registers a thread (4 programs an SM); the fastest on an H200
MODEL_TILE_ROWS, MODEL_NUM_WARPS, MODEL_PROGRAMS_PER_SM = 64, 4, 4
MODEL_OPTIONS = dict(num_stages=1, maxnreg=128)
# model-space load: write each tile with a bulk (TMA) store from shared memory (Hopper and later)
MODEL_OUT_DESC = True
# model-space load on Hopper: the Gluon kernel of kvlab.mse_mma (dims 64 and 128, default tiles)
MODEL_MMA = True
# Hadamard store on a CUDA GPU: the Gluon kernel of kvlab.mse_store (a row on 4 threads; dim 128, default tiling)
STORE_GLUON = True



# ----------------------------------------------------------------------------- kernels


# Under TRITON_INTERPRET every call of a @triton.jit helper costs ~0.2 ms, so the helpers below
# loop over tuples instead of recursing.


@triton.jit
def _join_columns(us, H: tl.constexpr, BR: tl.constexpr, N: tl.constexpr, W: tl.constexpr):
    """Tuple of ``N`` ``[H, BR, W]`` tensors -> ``[H, BR, N W]`` (item ``u`` in columns ``u W .. u W + W - 1``).

    Pairwise joins: the new dimension of a join is held by the thread that holds its operands.
    """
    xs = us
    for level in tl.static_range(N.bit_length() - 1):  # pieces of W << level columns
        ys = ()
        for i in tl.static_range(N >> (level + 1)):
            ys = ys + (tl.reshape(tl.permute(tl.join(xs[2 * i], xs[2 * i + 1]), (0, 1, 3, 2)), [H, BR, 2 * W << level]),)
        xs = ys
    return xs[0]


@triton.jit
def _split_columns(x, H: tl.constexpr, BR: tl.constexpr, N: tl.constexpr, W: tl.constexpr):
    """Inverse of ``_join_columns``: ``[H, BR, N W]`` -> tuple of ``N`` ``[H, BR, W]`` (top bit first)."""
    xs = (x,)
    for level in tl.static_range(N.bit_length() - 1):  # pieces of N W >> level columns
        ys = ()
        for i in tl.static_range(1 << level):
            lo, hi = tl.split(tl.permute(tl.reshape(xs[i], [H, BR, 2, N * W // 2 >> level]), (0, 1, 3, 2)))
            ys = ys + (lo, hi)
        xs = ys
    return xs


@triton.jit
def _fwht(x, H: tl.constexpr, BR: tl.constexpr, N: tl.constexpr, STAGES: tl.constexpr):
    """The first ``STAGES`` butterfly stages of ``kvlab.rotation.fwht`` on the rows of ``x [H, BR, N]``.

    Stage ``h``: view the row as ``[N / 2h, 2, h]``, split the middle axis into the pair
    ``(a, b)`` and join ``(a + b, a - b)`` back in its place. Register-to-register: a thread holds
    the ``N`` columns.
    """
    for s in tl.static_range(STAGES):  # h = 1 << s
        a, b = tl.split(tl.permute(tl.reshape(x, [H, BR, N >> (s + 1), 2, 1 << s]), (0, 1, 2, 4, 3)))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 2, 4, 3)), [H, BR, N])
    return x


@triton.jit
def _fwht_across(x, H: tl.constexpr, BR: tl.constexpr, N: tl.constexpr, STAGES: tl.constexpr):
    """The butterfly stages that pair the ``H`` pieces of a row (``x [H, BR, N]``, piece ``q`` is
    columns ``q N .. q N + N - 1``, one thread each): stage ``s`` pairs pieces ``q`` and ``q + s``.

    ``a + b`` is the sum over the pair axis and ``a - b`` the sum of ``(a, -b)``: two-term sums,
    so bit-identical to the butterfly (negation is exact, addition commutes).
    """
    for i in tl.static_range(STAGES):  # pieces 2**i apart
        x5 = tl.reshape(x, [H >> (i + 1), 2, 1 << i, BR, N])
        sign = tl.where(tl.arange(0, 2) == 0, 1.0, -1.0)[None, :, None, None, None]
        a_plus_b = tl.sum(x5, axis=1)
        a_minus_b = tl.sum(x5 * sign, axis=1)
        second = (tl.arange(0, 2) == 1)[None, :, None, None, None]
        x = tl.reshape(tl.where(second, a_minus_b[:, None, :, :, :], a_plus_b[:, None, :, :, :]), [H, BR, N])
    return x


@triton.jit
def _thresholds(n, mid_ptr, tie_ptr, NUM_BOUNDARIES: tl.constexpr):
    """Per-row float32 thresholds ``t_i`` with ``fl(y / n) > b_i  <=>  y > t_i`` for every float32 ``y``.

    ``fl(y / n) > b`` (round to nearest even) holds iff ``y / n > m``, or ``y / n == m`` when the tie
    rounds up, where ``m`` is the midpoint between ``b`` and the next float32 (``mid_ptr``, float64;
    ``tie_ptr``: 1 where a tie rounds up). ``T = m n`` is exact in float64 (25 x 24 bits), so the
    condition is ``y > T`` (or ``y >= T``), i.e. ``y > t`` with ``t`` = ``T`` rounded down to float32
    (or the float32 below ``T`` rounded up). One division-free compare per boundary and element.
    """
    n64 = tl.where(n > 0, n, 1.0).to(tl.float64)  # the reference divides zero vectors by 1
    ts = ()
    for i in tl.static_range(NUM_BOUNDARIES):
        t_exact = n64 * tl.load(mid_ptr + i)
        t = t_exact.to(tl.float32)  # nearest
        back = t.to(tl.float64)
        down = (back > t_exact) | ((back == t_exact) & (tl.load(tie_ptr + i) != 0))
        # the float32 below t: step the integer that orders floats like numbers (+-0 -> 0)
        b = t.to(tl.int32, bitcast=True)
        key = tl.where(b >= 0, b, -(b & 0x7FFFFFFF)) - 1
        below = tl.where(key >= 0, key, (-key) | -2147483648).to(tl.float32, bitcast=True)
        ts = ts + (tl.where(down, below, t)[None, :, None],)  # [1, BR, 1]
    return ts


@triton.jit
def _bucketize(y, ts, shift, BITS: tl.constexpr):
    """Number of thresholds ``ts`` (ascending, ``2**BITS - 1``) strictly below ``y``, shifted left by
    ``shift``: a binary search.

    Each outcome halves the candidate thresholds right away (one select per remaining candidate):
    ``BITS`` compares and ``2**BITS - BITS - 1`` selects. Outcomes are predicates (a compare, then
    one float select per candidate), except at the first of 3 levels, where the 3 selects of each
    element would keep too many predicates live (at 4 bits the store needs 255 registers that way,
    178 this way): there the outcome is an integer mask, the sign of ``t - y`` (exact: a float
    difference is zero only for equal operands, no threshold is ``-0``, and the kernel is compiled
    without FMA contraction), and the selects are bit operations.
    """
    MASK_LEVELS: tl.constexpr = 1 if BITS >= 3 else 0
    idx = tl.zeros(y.shape, dtype=tl.uint32)
    cands = ts
    for level in tl.static_range(BITS):
        # 2 h + 1 candidates, h = 2**(BITS - 1 - level) - 1: the middle one splits them
        t = cands[(1 << (BITS - 1 - level)) - 1]
        picked = ()
        if level < MASK_LEVELS:
            m = (t - y).to(tl.int32, bitcast=True) >> 31  # -1 where y > t, else 0
            idx = idx | (m.to(tl.uint32) & ((1 << (BITS - 1 - level)) << shift))
            for i in tl.static_range((1 << (BITS - 1 - level)) - 1):
                lo = cands[i].to(tl.int32, bitcast=True)
                hi = cands[(1 << (BITS - 1 - level)) + i].to(tl.int32, bitcast=True)
                picked = picked + ((lo ^ ((lo ^ hi) & m)).to(tl.float32, bitcast=True),)
        else:
            up = y > t
            idx = idx + tl.where(up, (1 << (BITS - 1 - level)) << shift, 0)
            for i in tl.static_range((1 << (BITS - 1 - level)) - 1):
                picked = picked + (tl.where(up, cands[(1 << (BITS - 1 - level)) + i], cands[i]),)
        cands = picked
    return idx


@triton.jit
def _code_bits(ws, n16, GROUP_BITS: tl.constexpr, INDEX_BYTES: tl.constexpr, START: tl.constexpr, NBITS: tl.constexpr):
    """Bits ``[START, START + NBITS)`` (``NBITS <= 32``) of a code, as uint32 ``[BR]``.

    The code is a little-endian bit stream: groups of ``GROUP_BITS`` bits (``ws``, 8 indices each;
    the bits past the last index are zero), then from byte ``INDEX_BYTES`` the 16-bit norm ``n16``.
    Compile-time shifts of the pieces that overlap the range.
    """
    v = n16 & 0
    for g in tl.static_range(len(ws) + 1):
        if g < len(ws):
            if g * GROUP_BITS < START + NBITS and (g + 1) * GROUP_BITS > START:
                if g * GROUP_BITS >= START:
                    v = v | (ws[g] << (g * GROUP_BITS - START))
                else:
                    v = v | (ws[g] >> (START - g * GROUP_BITS))
        elif 8 * INDEX_BYTES < START + NBITS and 8 * INDEX_BYTES + 16 > START:
            if 8 * INDEX_BYTES >= START:
                v = v | (n16 << (8 * INDEX_BYTES - START))
            else:
                v = v | (n16 >> (START - 8 * INDEX_BYTES))
    if NBITS < 32:
        v = v & ((1 << NBITS) - 1)
    return v


@triton.jit
def _encode_rows(
    # pointers
    x_ptr,  # HADAMARD: the input rows (fp16/bf16/fp32); else the rotated rows (fp32)
    sign_ptr,  # HADAMARD: int16/int32 [D]: the sign bit of the rotation's sign, per column
    mid_ptr,  # fp64 [2**(BITS-1)]: midpoints between each boundary (0, the positive ones) and the next float32
    tie_ptr,  # int32 [2**(BITS-1)]: 1 where a value at the midpoint rounds up
    sq_ptr,  # fp64: sums of the squares of TUPLE centroids (NORM_CORRECTION; see _square_sums)
    cache_ptr,  # uint8: the cache, addressed by byte offsets
    norm_ptr,  # fp32 [num_rows]: CHECK: the rows' stored scales, checked by the launcher
    # this tile's rows
    o_r,  # [BR] int64: row ids (token * num_heads + head)
    m_r,  # [BR] bool: rows to write (in range, slot valid)
    o_dst,  # [BR] int64: byte offset of this part's code in the row's slot
    stride_x,  # elements between rows of x
    scale,  # fp32: 1 / sqrt(D) (HADAMARD)
    # settings
    D: tl.constexpr,
    C: tl.constexpr,  # chunks of 8 columns (a power of two, 8 C >= D)
    LOG_D: tl.constexpr,  # HADAMARD: log2(D), the number of butterfly stages
    PIECES: tl.constexpr,  # threads per row: 8 C / 128, at least 1
    BLOCK_ROWS: tl.constexpr,
    BITS: tl.constexpr,
    TUPLE: tl.constexpr,  # indices per entry of the squares table (1 or 2, _square_tuple)
    INDEX_BYTES: tl.constexpr,
    HEAD: tl.constexpr,  # bytes before the code's first 4-byte aligned address; -1: alignment unknown
    HADAMARD: tl.constexpr,  # rotate here (fused) instead of reading rotated rows
    NORM_CORRECTION: tl.constexpr,  # store norm / |c| (the length of the picked centroid vector)
    CHECK: tl.constexpr,
):
    BR: tl.constexpr = BLOCK_ROWS
    H: tl.constexpr = PIECES
    NP: tl.constexpr = 8 * C // PIECES  # columns per piece (at most 128: registers)
    CP: tl.constexpr = NP // 8  # chunks of 8 columns per piece
    o_k = tl.arange(0, 8)
    o_q = tl.arange(0, H)  # piece of the row: columns q NP .. q NP + NP - 1, one thread each
    # The rows, as chunks of 8 columns per piece, each one [H, BR, 16 bytes] load: a thread holds
    # its piece of a row (all of it when H == 1), so the butterflies, the norm and the thresholds
    # stay in registers. The signs are loaded in the same shape (one broadcast 16-byte load per
    # chunk) so that they share that layout; the piece axis leads, so that the pieces of a row are
    # on neighbouring lanes.
    W: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth  # columns per 16 bytes
    o_w = tl.arange(0, W)
    o_zero = (o_r * 0)[None, :, None]  # [1, BR, 1] zeros: broadcast loads of the signs
    chunks = ()
    for c in tl.static_range(CP):
        parts = ()
        for p in tl.static_range(8 // W):
            o_d = (o_q * NP)[:, None] + (c * 8 + p * W + o_w)[None, :]  # [H, W] columns
            m_d = (o_d < D)[:, None, :]
            b_x = tl.load(x_ptr + o_r[None, :, None] * stride_x + o_d[:, None, :], mask=m_r[None, :, None] & m_d, other=0.0)
            if HADAMARD:
                # x * signs: flip the sign bits (exact, like the multiplication by +-1)
                b_s = tl.load(sign_ptr + o_zero + o_d[:, None, :], mask=m_d, other=0)
                b_x = (b_x.to(b_s.dtype, bitcast=True) ^ b_s).to(b_x.dtype, bitcast=True)
            parts = parts + (b_x.to(tl.float32),)
        chunks = chunks + (_join_columns(parts, H, BR, 8 // W, W),)
    b_y = _join_columns(chunks, H, BR, CP, 8)  # [H, BR, NP] fp32
    if HADAMARD:
        # stages h < D only: padding columns stay zero
        b_y = _fwht(b_y, H, BR, NP, LOG_D if LOG_D < NP.bit_length() - 1 else NP.bit_length() - 1)
        if LOG_D > NP.bit_length() - 1:
            b_y = _fwht_across(b_y, H, BR, NP, LOG_D - (NP.bit_length() - 1))
        b_y = b_y * scale

    ys = _split_columns(b_y, H, BR, CP, 8)  # CP x [H, BR, 8]: quantized chunk by chunk (registers)

    # norm as in the reference: fp64 sum of squares (each square exact, so a fused multiply-add
    # rounds like the multiply then the add), sqrt in fp64 (tl.sqrt lowers to the IEEE sqrt for
    # fp64), rounded once to fp32
    b_sq = tl.zeros([H, BR, 8], dtype=tl.float64)
    for c in tl.static_range(CP):
        b_y64 = ys[c].to(tl.float64)
        b_sq = tl.fma(b_y64, b_y64, b_sq)
    b_norm = tl.sqrt(tl.sum(tl.sum(b_sq, axis=2), axis=0)).to(tl.float32)  # [BR]

    # code (MSECodec.encode's odd quantizer), without dividing: the magnitude m = the number of
    # positive boundaries strictly below |y| / norm, then m where y / norm > 0, else HALF + m (the
    # sign-magnitude code of kvlab.layout); pack: code k of a chunk (group) sits at bit BITS * k of
    # the group's word
    HALF: tl.constexpr = 1 << (BITS - 1)
    ts_all = _thresholds(b_norm, mid_ptr, tie_ptr, HALF)  # [1, BR, 1] each: the zero boundary, then the positive ones
    t_zero, ts = ts_all[0], ts_all[1:]
    # |c|^2 as in the reference, an fp64 sum of the (exact) squares of the picked centroids: the
    # table holds the fp64 sums of TUPLE consecutive ones (by their packed bits), one gather and
    # one add per TUPLE elements instead of a gather, a conversion and a multiply-add per element
    TB: tl.constexpr = TUPLE * BITS
    o_shift = (o_k * BITS).to(tl.uint32)[None, None, :]  # [1, 1, 8]: where index k sits in its group word
    b_len = tl.zeros([H, BR], dtype=tl.float64)
    piece_words = ()
    for c in tl.static_range(CP):
        # the magnitude m by a binary search of |y| (one compare at 2 bits), then the sign bit
        if BITS == 2:
            b_m = (tl.abs(ys[c]) > ts[0]).to(tl.uint32)
        else:
            b_m = _bucketize(tl.abs(ys[c]), ts, 0, BITS - 1)  # [H, BR, 8] uint32
        b_idx = b_m | tl.where(ys[c] > t_zero, 0, HALF).to(tl.uint32)
        if BITS == 2:  # the indices at their bits in the group word, which is then their sum
            b_idx = b_idx << o_shift
        if 8 * C != D:
            m_pad = ((o_q * NP)[:, None] + c * 8 + o_k[None, :] < D)[:, None, :]  # [H, 1, 8]: real columns
            b_idx = tl.where(m_pad, b_idx, 0)  # padding: zero bits
        if BITS == 2:
            b_word = tl.sum(b_idx, axis=2)  # [H, BR]
        else:
            b_word = tl.sum(b_idx << o_shift, axis=2)  # [H, BR]
        piece_words = piece_words + (b_word,)
        if NORM_CORRECTION and TUPLE == 1:
            if 8 * C != D:
                b_len += tl.sum(tl.load(sq_ptr + b_idx, mask=m_pad, other=0.0), axis=2)
            else:
                b_len += tl.sum(tl.load(sq_ptr + b_idx), axis=2)
        elif NORM_CORRECTION:
            for j in tl.static_range(8 // TUPLE):
                b_t = ((b_word >> (TB * j)) & ((1 << TB) - 1)).to(tl.int32)
                if 8 * C != D:
                    # a tuple that is partly padding: the sums of its first r (real) centroids
                    n_real = tl.minimum(tl.maximum(D - (o_q * NP + c * 8 + TUPLE * j), 0), TUPLE)  # [H]
                    o_sec = tl.where(n_real == TUPLE, 0, (1 << TB) + ((1 << (BITS * n_real)) - (1 << BITS)) // ((1 << BITS) - 1))
                    b_len += tl.load(sq_ptr + (b_t + o_sec[:, None]), mask=(n_real > 0)[:, None], other=0.0)
                else:
                    b_len += tl.load(sq_ptr + b_t)
    ws = ()  # the C group words of each row, in order (every piece's thread gets all of them)
    for q in tl.static_range(H):
        for c in tl.static_range(CP):
            if H == 1:
                ws = ws + (tl.reshape(piece_words[c], [BR]),)
            else:
                ws = ws + (tl.sum(tl.where((o_q == q)[:, None], piece_words[c], 0), axis=0),)

    # the stored scale: norm / |c| (fp64 sqrt of the fp64 sum rounded to fp32, IEEE division, as the reference), or the norm
    if NORM_CORRECTION:
        b_norm = tl.div_rn(b_norm, tl.sqrt(tl.sum(b_len, axis=0)).to(tl.float32))

    # store the code (indices, then the fp16 scale): 4-byte words, coalesced, between a head and a
    # tail of at most 3 bytes each, stored per row
    b_n16 = b_norm.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)  # [BR]
    CODE_BYTES: tl.constexpr = INDEX_BYTES + 2
    if HEAD >= 0:
        NUM_WORDS: tl.constexpr = (CODE_BYTES - HEAD) // 4
        TAIL: tl.constexpr = CODE_BYTES - HEAD - 4 * NUM_WORDS
        BLOCK_W: tl.constexpr = triton.next_power_of_2(NUM_WORDS)
        us = ()
        for i in tl.static_range(BLOCK_W):
            us = us + (_code_bits(ws, b_n16, 8 * BITS, INDEX_BYTES, 8 * (HEAD + 4 * min(i, NUM_WORDS - 1)), 32)[None, :, None],)
        b_w = tl.reshape(_join_columns(us, 1, BR, BLOCK_W, 1), [BR, BLOCK_W])  # [BR, BLOCK_W]: words (the padding repeats the last)
        o_u = tl.arange(0, BLOCK_W)
        p_w = (cache_ptr + o_dst + HEAD).to(tl.pointer_type(tl.uint32))
        tl.store(p_w[:, None] + o_u[None, :], b_w, mask=m_r[:, None] & (o_u < NUM_WORDS)[None, :])
        for j in tl.static_range(HEAD):
            tl.store(cache_ptr + o_dst + j, _code_bits(ws, b_n16, 8 * BITS, INDEX_BYTES, 8 * j, 8).to(tl.uint8), mask=m_r)
        for j in tl.static_range(TAIL):
            b = CODE_BYTES - TAIL + j
            tl.store(cache_ptr + o_dst + b, _code_bits(ws, b_n16, 8 * BITS, INDEX_BYTES, 8 * b, 8).to(tl.uint8), mask=m_r)
    else:
        # alignment unknown: bytes, coalesced
        BLOCK_B: tl.constexpr = triton.next_power_of_2(CODE_BYTES)
        us = ()
        for j in tl.static_range(BLOCK_B):
            us = us + (_code_bits(ws, b_n16, 8 * BITS, INDEX_BYTES, 8 * min(j, CODE_BYTES - 1), 8)[None, :, None],)
        b_b = tl.reshape(_join_columns(us, 1, BR, BLOCK_B, 1), [BR, BLOCK_B])  # [BR, BLOCK_B]
        o_u = tl.arange(0, BLOCK_B)
        tl.store(cache_ptr + o_dst[:, None] + o_u[None, :], b_b.to(tl.uint8), mask=m_r[:, None] & (o_u < CODE_BYTES)[None, :])

    if CHECK:  # the scales of the rows written; the launcher rejects NaN, Inf and fp16 overflow
        tl.store(norm_ptr + o_r, b_norm, mask=m_r)


@triton.jit
def _store_mse_kernel(
    # pointers
    x_ptr,  # rows [num_rows, D]: the input (HADAMARD) or the rotated rows (fp32)
    sign_ptr,  # HADAMARD: int16/int32 [D] sign bits of the rotation's signs
    mid_ptr,  # fp64 [2**(BITS-1)]: midpoints of the zero and the positive boundaries (see _thresholds)
    tie_ptr,  # int32 [2**(BITS-1)]
    sq_ptr,  # fp64: sums of the squares of TUPLE centroids (NORM_CORRECTION)
    slot_ptr,  # int32/int64 [num_tokens]
    cache_ptr,  # uint8 [num_blocks, BLOCK_SIZE, NUM_HEADS, slot_bytes], last dim contiguous
    norm_ptr,  # fp32 [num_rows]: the rows' norms (CHECK only)
    # scalars, sizes and strides
    scale,  # fp32 1 / sqrt(D) (HADAMARD)
    stride_x,  # elements between rows of x_ptr
    num_rows,
    num_slots,  # num_blocks * BLOCK_SIZE
    offset,  # byte of this part's code (key or value) in a slot
    stride_slot,
    stride_block,
    stride_pos,
    stride_head,
    # settings
    D: tl.constexpr,
    C: tl.constexpr,  # chunks of 8 columns (a power of two, 8 C >= D)
    LOG_D: tl.constexpr,
    PIECES: tl.constexpr,
    NUM_HEADS: tl.constexpr,  # compile-time: the row -> (token, head) and slot -> (block, offset)
    BLOCK_SIZE: tl.constexpr,  # divisions become multiplications
    BLOCK_ROWS: tl.constexpr,
    BITS: tl.constexpr,
    TUPLE: tl.constexpr,
    INDEX_BYTES: tl.constexpr,
    HEAD: tl.constexpr,
    HADAMARD: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,
    CHECK: tl.constexpr,
):
    # one part (key or value) per launch: the kernels are half the size (and compile in half the time)
    i_p = tl.program_id(0).to(tl.int64)
    o_r = i_p * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BR] int64 rows
    # rows to write (out-of-range slots are never written) and the byte offset of each row's code
    m_w, o_dst = _row_codes(slot_ptr, o_r, num_rows, num_slots, stride_slot, stride_block, stride_pos, stride_head,
                            NUM_HEADS, BLOCK_SIZE, offset)
    _encode_rows(x_ptr, sign_ptr, mid_ptr, tie_ptr, sq_ptr, cache_ptr, norm_ptr,
                 o_r, m_w, o_dst, stride_x, scale,
                 D, C, LOG_D, PIECES, BLOCK_ROWS, BITS, TUPLE, INDEX_BYTES, HEAD, HADAMARD, NORM_CORRECTION, CHECK)


# ----------------------------------------------------------------------------- lookups (inline PTX)

# ----------------------------------------------------------------------------- load


@triton.jit
def _row_codes(slot_ptr, o_r, num_rows, num_slots, stride_slot, stride_block, stride_pos, stride_head,
               NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, offset):
    """Rows ``o_r`` ([BR] int64, row = token * NUM_HEADS + head) -> (rows whose slot is in the cache,
    byte offset of each row's code: its slot's address plus ``offset``, the part's byte in a slot).
    Rows past the end, padding slots (-1) and slots out of range are neither read (they decode to 0)
    nor written."""
    m_r = o_r < num_rows
    o_t, o_h = o_r // NUM_HEADS, o_r % NUM_HEADS
    b_slot = tl.load(slot_ptr + o_t * stride_slot, mask=m_r, other=-1).to(tl.int64)  # [BR]
    m_s = m_r & (b_slot >= 0) & (b_slot < num_slots)
    return m_s, (b_slot // BLOCK_SIZE) * stride_block + (b_slot % BLOCK_SIZE) * stride_pos + o_h * stride_head + offset


@triton.jit
def _row_scale(cache_ptr, o_src, m_s, INDEX_BYTES: tl.constexpr, NORM_ALIGNED: tl.constexpr):
    """The stored fp16 scale of each row (little-endian, right after the indices), as fp32; 0 for rows not read."""
    p_n = cache_ptr + o_src + INDEX_BYTES
    if NORM_ALIGNED:
        b_n = tl.load(p_n.to(tl.pointer_type(tl.uint16)), mask=m_s, other=0)
    else:
        b_n = tl.load(p_n, mask=m_s, other=0).to(tl.uint16) | (tl.load(p_n + 1, mask=m_s, other=0).to(tl.uint16) << 8)
    return b_n.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _centroid_rows(cache_ptr, cent_ptr, o_src, m_s, D: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_G: tl.constexpr,
                   BITS: tl.constexpr, INDEX_BYTES: tl.constexpr, UNIT: tl.constexpr):
    """The centroids of rows' codes, ``[BR, BG, 8]`` fp32 (padding columns 0), index by index: shifts and a
    gather from the table (``2**BITS`` floats, one cache line)."""
    # A thread decodes groups of 8 elements: BITS bytes of code in, 8 centroids out.
    o_g = tl.arange(0, BLOCK_G)
    o_k = tl.arange(0, 8)
    # the word of group g: code bytes [BITS g, BITS g + BITS), little-endian, loaded UNIT bytes at
    # a time, one load per unit. The addresses are laid out [BG, BR], groups first, so that the
    # compiler puts consecutive groups of a row on consecutive lanes (coalesced, like the output).
    p_g = cache_ptr + o_src[None, :] + (o_g * BITS)[:, None]  # [BG, BR] byte address of each group
    m_g = m_s[None, :] & (o_g * BITS < INDEX_BYTES)[:, None]
    b_word = tl.zeros([BLOCK_G, BLOCK_ROWS], dtype=tl.uint32)
    for j in tl.static_range(BITS // UNIT):
        if UNIT == 4:
            b_u = tl.load((p_g + 4 * j).to(tl.pointer_type(tl.uint32)), mask=m_g, other=0)
        elif UNIT == 2:
            b_u = tl.load((p_g + 2 * j).to(tl.pointer_type(tl.uint16)), mask=m_g, other=0).to(tl.uint32)
        else:
            b_u = tl.load(p_g + j, mask=m_g & (o_g * BITS + j < INDEX_BYTES)[:, None], other=0).to(tl.uint32)
        b_word = b_word | (b_u << (8 * UNIT * j))
    b_idx = (b_word[:, :, None] >> (o_k * BITS).to(tl.uint32)[None, None, :]) & ((1 << BITS) - 1)  # [BG, BR, 8]
    b_c = tl.load(cent_ptr + b_idx)  # [BG, BR, 8]
    if 8 * BLOCK_G != D:
        b_c = tl.where((o_g[:, None] * 8 + o_k[None, :] < D)[:, None, :], b_c, 0.0)
    return tl.permute(b_c, (1, 0, 2))


@triton.jit
def _centroid_words3(cent_ptr, b_w0, b_w1, b_w2, BN: tl.constexpr, D: tl.constexpr):
    """The centroids ``[BN, D]`` fp32 (natural order) of 3-bit codes read as 32-bit words (``_mse_words``):
    three words hold four 24-bit groups of 8 indices; shifts and a gather from the table."""
    b_g = tl.reshape(_join_all(_groups3(b_w0, b_w1, b_w2), 2), [BN, D // 8])  # group g of a row: elements 8 g .. 8 g + 7
    o_k = tl.arange(0, 8)
    b_idx = (b_g[:, :, None] >> (3 * o_k).to(tl.uint32)[None, None, :]) & 7  # [BN, D / 8, 8]
    return tl.reshape(tl.load(cent_ptr + b_idx), [BN, D])


@triton.jit
def _load_mse_kernel(
    # pointers
    cache_ptr,  # uint8 [num_blocks, BLOCK_SIZE, NUM_HEADS, slot_bytes], last dim contiguous
    slot_ptr,  # int32/int64 [num_tokens]
    cent_ptr,  # fp32 [2**BITS]: centroids
    rt_ptr,  # fp16 [8 BLOCK_G, 8 BLOCK_G]: R^T zero-padded, its rows in tile order (MODEL only)
    out_ptr,  # [num_rows, D] out dtype; row = token * NUM_HEADS + head
    t0, t1, t2, t3,  # FAST: the int32 table registers of the prmt lookup (``_prmt_tables``)
    # sizes and strides
    num_rows,
    num_slots,
    stride_slot,
    stride_block,
    stride_pos,
    stride_head,
    num_programs,  # MODEL: the launch's programs; program p decodes tiles p, p + num_programs, ...
    # settings
    D: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,  # groups of 8 elements per row (power of two, 8 * BLOCK_G >= D)
    BITS: tl.constexpr,
    INDEX_BYTES: tl.constexpr,
    OFFSET: tl.constexpr,  # byte of this part's code (key or value) in a slot
    UNIT: tl.constexpr,  # bytes per load of the code (1, 2 or 4): every group starts UNIT-aligned
    NORM_ALIGNED: tl.constexpr,  # every norm starts 2-byte aligned
    BF16_BY_BITS: tl.constexpr,  # round fp32 -> bf16 with integer ops (interpreter only)
    MODEL: tl.constexpr,  # rotate back to model space in the kernel: one fp16 product by R^T per tile
    FAST: tl.constexpr,  # MODEL: centroids by prmt lookups of 32-bit code words (D = 8 BLOCK_G, a multiple of 32)
    ALIGN4: tl.constexpr,  # FAST: every code starts 4-byte aligned (else 2 bytes past a word boundary)
    INTERPRETED_TILES: tl.constexpr,  # MODEL, interpreter only: cdiv(tiles, num_programs); 0 when compiled
    WORDS3: tl.constexpr,  # not MODEL, 3 bit: codes read as 32-bit words (D / 32 a power of two; ALIGN4 as for FAST)
    OUT_DESC: tl.constexpr = False,  # MODEL: out_ptr is a tensor descriptor of out, tiles of [BLOCK_ROWS, D]
):
    i_p = tl.program_id(0)
    if MODEL:
        # persistent: R^T (up to 32 KB of fp16) is loaded once per program, which then loops over
        # the tiles i_p, i_p + num_programs, ... (tiles past the rows are all masked). FAST: the code
        # words and scales of the next tile are read before the current one is computed (software
        # pipelining by hand: Triton's own, num_stages > 1, stages the loads through shared memory).
        o_d = tl.arange(0, 8 * BLOCK_G)
        b_rt = tl.load(rt_ptr + o_d[:, None] * (8 * BLOCK_G) + o_d[None, :])  # [8 BG, 8 BG]
        # (the interpreter needs a trip count it can read: INTERPRETED_TILES steps, the same tiles)
        if FAST:
            b_w0, b_w1, b_w2, b_s = _fetch_words(cache_ptr, slot_ptr, i_p, num_rows, num_slots, stride_slot, stride_block,
                                                 stride_pos, stride_head, D, NUM_HEADS, BLOCK_SIZE, BLOCK_ROWS, BITS,
                                                 INDEX_BYTES, OFFSET, NORM_ALIGNED, ALIGN4)
            if INTERPRETED_TILES:
                for i in range(0, INTERPRETED_TILES):
                    b_w0, b_w1, b_w2, b_s = _model_step_fast(
                        cache_ptr, slot_ptr, b_rt, out_ptr, t0, t1, t2, t3, b_w0, b_w1, b_w2, b_s, i_p + i * num_programs,
                        num_programs, num_rows, num_slots, stride_slot, stride_block, stride_pos, stride_head, D,
                        NUM_HEADS, BLOCK_SIZE, BLOCK_ROWS, BLOCK_G, BITS, INDEX_BYTES, OFFSET, NORM_ALIGNED, ALIGN4,
                        BF16_BY_BITS, OUT_DESC)
            else:
                for i_t in range(i_p, tl.cdiv(num_rows, BLOCK_ROWS), num_programs):
                    b_w0, b_w1, b_w2, b_s = _model_step_fast(
                        cache_ptr, slot_ptr, b_rt, out_ptr, t0, t1, t2, t3, b_w0, b_w1, b_w2, b_s, i_t,
                        num_programs, num_rows, num_slots, stride_slot, stride_block, stride_pos, stride_head, D,
                        NUM_HEADS, BLOCK_SIZE, BLOCK_ROWS, BLOCK_G, BITS, INDEX_BYTES, OFFSET, NORM_ALIGNED, ALIGN4,
                        BF16_BY_BITS, OUT_DESC)
        else:
            if INTERPRETED_TILES:
                for i in range(0, INTERPRETED_TILES):
                    _model_step(cache_ptr, slot_ptr, cent_ptr, b_rt, out_ptr, i_p + i * num_programs, num_rows,
                                num_slots, stride_slot, stride_block, stride_pos, stride_head, D, NUM_HEADS, BLOCK_SIZE,
                                BLOCK_ROWS, BLOCK_G, BITS, INDEX_BYTES, OFFSET, UNIT, NORM_ALIGNED, BF16_BY_BITS,
                                OUT_DESC)
            else:
                for i_t in range(i_p, tl.cdiv(num_rows, BLOCK_ROWS), num_programs):
                    _model_step(cache_ptr, slot_ptr, cent_ptr, b_rt, out_ptr, i_t, num_rows,
                                num_slots, stride_slot, stride_block, stride_pos, stride_head, D, NUM_HEADS, BLOCK_SIZE,
                                BLOCK_ROWS, BLOCK_G, BITS, INDEX_BYTES, OFFSET, UNIT, NORM_ALIGNED, BF16_BY_BITS,
                                OUT_DESC)
    else:
        o_r = i_p.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BR] int64 rows
        m_s, o_src = _row_codes(slot_ptr, o_r, num_rows, num_slots, stride_slot, stride_block, stride_pos, stride_head,
                                NUM_HEADS, BLOCK_SIZE, OFFSET)
        b_s = _row_scale(cache_ptr, o_src, m_s, INDEX_BYTES, NORM_ALIGNED)  # rows not read: 0
        if WORDS3:
            b_w0, b_w1, b_w2 = _mse_words(cache_ptr, o_src, m_s, BLOCK_ROWS, D, BITS, ALIGN4)
            b_y = _centroid_words3(cent_ptr, b_w0, b_w1, b_w2, BLOCK_ROWS, D) * b_s[:, None]
        else:
            b_c = _centroid_rows(cache_ptr, cent_ptr, o_src, m_s, D, BLOCK_ROWS, BLOCK_G, BITS, INDEX_BYTES, UNIT)
            b_y = tl.reshape(b_c * b_s[:, None, None], [BLOCK_ROWS, 8 * BLOCK_G])
        _store_rows(out_ptr, b_y, o_r, num_rows, D, BLOCK_ROWS, BLOCK_G, BF16_BY_BITS)


@triton.jit
def _fetch_words(cache_ptr, slot_ptr, i_t, num_rows, num_slots, stride_slot, stride_block, stride_pos, stride_head,
                 D: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 BITS: tl.constexpr, INDEX_BYTES: tl.constexpr, OFFSET: tl.constexpr, NORM_ALIGNED: tl.constexpr,
                 ALIGN4: tl.constexpr):
    """The code words (``_mse_words``) and fp32 scales of tile ``i_t``'s rows (0 for rows not read)."""
    o_r = i_t.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    m_s, o_src = _row_codes(slot_ptr, o_r, num_rows, num_slots, stride_slot, stride_block, stride_pos, stride_head,
                            NUM_HEADS, BLOCK_SIZE, OFFSET)
    b_w0, b_w1, b_w2 = _mse_words(cache_ptr, o_src, m_s, BLOCK_ROWS, D, BITS, ALIGN4)
    return b_w0, b_w1, b_w2, _row_scale(cache_ptr, o_src, m_s, INDEX_BYTES, NORM_ALIGNED)


@triton.jit
def _model_step_fast(cache_ptr, slot_ptr, b_rt, out_ptr, t0, t1, t2, t3, b_w0, b_w1, b_w2, b_s, i_t, num_programs,
                     num_rows, num_slots, stride_slot, stride_block, stride_pos, stride_head, D: tl.constexpr,
                     NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_G: tl.constexpr,
                     BITS: tl.constexpr, INDEX_BYTES: tl.constexpr, OFFSET: tl.constexpr, NORM_ALIGNED: tl.constexpr,
                     ALIGN4: tl.constexpr, BF16_BY_BITS: tl.constexpr, OUT_DESC: tl.constexpr):
    """Tile ``i_t`` from its prefetched words and scales; returns those of tile ``i_t + num_programs``,
    read before this tile's arithmetic."""
    n_w0, n_w1, n_w2, n_s = _fetch_words(cache_ptr, slot_ptr, i_t + num_programs, num_rows, num_slots, stride_slot,
                                         stride_block, stride_pos, stride_head, D, NUM_HEADS, BLOCK_SIZE, BLOCK_ROWS,
                                         BITS, INDEX_BYTES, OFFSET, NORM_ALIGNED, ALIGN4)
    b_c = _mse_tile_fast(b_w0, b_w1, b_w2, t0, t1, t2, t3, BLOCK_ROWS, D, BITS)  # [BR, D] fp16, tile order
    _model_rows(out_ptr, b_c, b_rt, b_s, i_t, num_rows, D, BLOCK_ROWS, BLOCK_G, BF16_BY_BITS, OUT_DESC)
    return n_w0, n_w1, n_w2, n_s


@triton.jit
def _model_step(cache_ptr, slot_ptr, cent_ptr, b_rt, out_ptr, i_t, num_rows, num_slots, stride_slot, stride_block,
                stride_pos, stride_head, D: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                BLOCK_ROWS: tl.constexpr, BLOCK_G: tl.constexpr, BITS: tl.constexpr, INDEX_BYTES: tl.constexpr,
                OFFSET: tl.constexpr, UNIT: tl.constexpr, NORM_ALIGNED: tl.constexpr, BF16_BY_BITS: tl.constexpr,
                OUT_DESC: tl.constexpr):
    """Tile ``i_t``, index by index (``_centroid_rows``)."""
    o_r = i_t.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    m_s, o_src = _row_codes(slot_ptr, o_r, num_rows, num_slots, stride_slot, stride_block, stride_pos, stride_head,
                            NUM_HEADS, BLOCK_SIZE, OFFSET)
    b_c = _centroid_rows(cache_ptr, cent_ptr, o_src, m_s, D, BLOCK_ROWS, BLOCK_G, BITS, INDEX_BYTES, UNIT)
    b_s = _row_scale(cache_ptr, o_src, m_s, INDEX_BYTES, NORM_ALIGNED)
    _model_rows(out_ptr, tl.reshape(b_c, [BLOCK_ROWS, 8 * BLOCK_G]).to(tl.float16), b_rt, b_s, i_t, num_rows, D,
                BLOCK_ROWS, BLOCK_G, BF16_BY_BITS, OUT_DESC)


@triton.jit
def _model_rows(out_ptr, b_c, b_rt, b_s, i_t, num_rows, D: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                BLOCK_G: tl.constexpr, BF16_BY_BITS: tl.constexpr, OUT_DESC: tl.constexpr):
    """Tile ``i_t`` in model space: ``(c R^T) s``, the fp16 centroid tile ``c`` times ``R^T`` (``b_rt``)
    on the tensor cores (fp32 accumulation), then each row times its fp32 scale ``s`` (rows not read: 0).
    ``OUT_DESC``: ``out_ptr`` is a tensor descriptor of ``out`` and the tile leaves through shared memory
    in one bulk (TMA) store, the rows past ``num_rows`` clipped by the descriptor's shape."""
    b_out = tl.dot(b_c, b_rt) * b_s[:, None]
    if OUT_DESC:
        out_ptr.store([(i_t * BLOCK_ROWS).to(tl.int32), 0], _out_values(b_out, out_ptr.dtype, BF16_BY_BITS))
    else:
        o_r = i_t.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        _store_rows(out_ptr, b_out, o_r, num_rows, D, BLOCK_ROWS, BLOCK_G, BF16_BY_BITS)


@triton.jit
def _out_values(b_out, dtype: tl.constexpr, BF16_BY_BITS: tl.constexpr):
    """fp32 ``b_out`` in the output ``dtype``."""
    if BF16_BY_BITS:
        # round to nearest even by hand: Triton 3.6's interpreter truncates fp32 -> bf16 (the GPU
        # conversion already rounds to nearest even); finite values only
        b_bits = b_out.to(tl.uint32, bitcast=True)
        b_bits = (b_bits + 0x7FFF + ((b_bits >> 16) & 1)) >> 16
        return b_bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return b_out.to(dtype)


@triton.jit
def _store_rows(out_ptr, b_out, o_r, num_rows, D: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_G: tl.constexpr,
                BF16_BY_BITS: tl.constexpr):
    """Write ``b_out [BR, 8 BG]`` (fp32) to the rows ``o_r`` of ``out`` in its dtype: 16-byte vector stores."""
    o_d = tl.arange(0, 8 * BLOCK_G)
    p_out = out_ptr + o_r[:, None] * D + o_d[None, :]
    tl.store(p_out, _out_values(b_out, out_ptr.dtype.element_ty, BF16_BY_BITS),
             mask=(o_r < num_rows)[:, None] & (o_d < D)[None, :])


# ----------------------------------------------------------------------------- launchers


def _rotation(codec, device):
    """The dense rotation ``R`` (float32) on ``device``."""
    return T.cached(codec, ("rotation", device), codec.rotation,
                   lambda r: r.to(device=device, dtype=torch.float32).contiguous())


def _rotation_t16(codec, device, order: bool = False):
    """``R^T`` in fp16, zero-padded to the load tile's width (``8 * _block_g(dim)``), on ``device``;
    ``order``: its rows in the tile order of the prmt lookup (``tile_order``), as the fast tile holds them."""
    def build(r):
        width = 8 * _block_g(codec.dim)
        rt = torch.zeros(width, width, dtype=torch.float16)
        rt[: codec.dim, : codec.dim] = r.detach().to("cpu", torch.float32).T.to(torch.float16)
        if order:
            rt = rt[tile_order(codec.bits, width)]
        return rt.to(device).contiguous()

    return T.cached(codec, ("rotation_t16", device, order), codec.rotation, build)


def _square_tuple(bits: int) -> int:
    """Indices per entry of the store's squares table (``_square_sums``)."""
    return 1 if bits == 4 else 2  # tables of 16, 64 and 16 entries: at most 512 bytes, mostly one cache line


def _square_sums(codec, device):
    """The store's table for ``|c|^2`` (float64): sums of the squares of the centroids of ``E =
    _square_tuple(bits)`` consecutive codes, added in order in float64 (each square is exact).

    Entry ``t < 2**(E bits)`` is the sum for the ``E`` codes that ``t`` packs (code ``i`` in bits
    ``[bits i, bits i + bits)``); then, for tuples that are partly padding, the sums of the first
    ``r`` of them for ``r = 1 .. E - 1``, each section ``2**(r bits)`` entries long.
    """
    def build(centroids):
        c = T.codebook(centroids.detach().to("cpu", torch.float64), codec.bits)
        levels, bits = c.numel(), codec.bits
        sections = []
        for r in [_square_tuple(bits)] + list(range(1, _square_tuple(bits))):
            t = torch.arange(levels**r)
            acc = torch.zeros(levels**r, dtype=torch.float64)
            for i in range(r):
                acc = acc + c[(t >> (bits * i)) & (levels - 1)] ** 2
            sections.append(acc)
        return torch.cat(sections).to(device)

    return T.cached(codec, ("square_sums", device, _square_tuple(codec.bits)), codec.centroids, build)


def _midpoints(codec, device, name: str = "codec"):
    """``(mid, tie)`` on ``device`` for the store's division-free compare (see ``_thresholds``), for
    the boundaries the odd quantizer compares with: the middle one (zero), then the positive ones.

    ``mid[i]`` (float64) is the midpoint between boundary ``i`` (float32) and the next float32 up;
    ``tie[i]`` (int32) is 1 where a value exactly at the midpoint rounds up (to the even neighbour).
    """
    def build(boundaries):
        b = boundaries.detach().to("cpu", torch.float32)
        if not bool(torch.isfinite(b).all()) or bool((b[1:] <= b[:-1]).any()):
            raise ValueError(f"{name}.boundaries must be finite and strictly ascending")
        if b.numel() != (1 << codec.bits) - 1 or not torch.equal(b, -b.flip(0)):
            raise ValueError(f"{name}.boundaries must be 2**bits - 1 = {(1 << codec.bits) - 1} values, antisymmetric "
                             f"(b[i] == -b[-1 - i], the middle one 0), got {b.tolist()}")
        b = b[(1 << (codec.bits - 1)) - 1:]  # 0, then the positive ones
        up = torch.nextafter(b, torch.tensor(float("inf")))
        mid = (b.double() + up.double()) / 2  # exact: a 25-bit significand
        tie = ((up.view(torch.int32) & 1) == 0).to(torch.int32)  # round half to even
        return mid.to(device), tie.to(device)

    return T.cached(codec, ("midpoints", device), codec.boundaries, build)


def _hadamard_signs(codec):
    """``codec.hadamard_signs`` when the codec has a Hadamard rotation the store can fuse, else None."""
    signs = getattr(codec, "hadamard_signs", None)
    if signs is None:
        return None
    dim = codec.dim
    C.check_tensor("codec.hadamard_signs", signs, C.FLOAT_DTYPES)
    if dim & (dim - 1) or tuple(signs.shape) != (dim,):
        raise ValueError(f"hadamard_signs must have shape ({dim},) for a power-of-two dim, got {tuple(signs.shape)} (dim {dim})")
    return signs


def _sign_bits(codec, device, dtype):
    """The sign bit of each of the codec's Hadamard signs, as an int16/int32 [dim] mask for ``dtype`` inputs."""
    def build(signs):
        s = signs.detach().to("cpu", torch.float64)
        if not bool(((s == 1) | (s == -1)).all()):
            raise ValueError("hadamard_signs must hold only +1 and -1")
        if dtype == torch.float32:
            return torch.where(s < 0, -(2**31), 0).to(torch.int32).to(device)
        return torch.where(s < 0, -(2**15), 0).to(torch.int16).to(device)

    return T.cached(codec, ("sign_bits", device, dtype.itemsize), codec.hadamard_signs, build)


def _hadamard_scale(codec) -> float:
    scale = getattr(codec, "hadamard_scale", None)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise TypeError(f"hadamard_scale must be a positive float (1/sqrt(dim)), got {scale!r}")
    return float(scale)


def _alignment(cache, offset: int) -> int:
    """The largest of 1, 2, 4 dividing the address of every slot's byte ``offset`` in ``cache``."""
    g = cache.data_ptr() + offset
    for s in cache.stride()[:3]:
        g = math.gcd(g, s)
    return 4 if g % 4 == 0 else 2 if g % 2 == 0 else 1


def _model_lookup_tables(cache, codec, offset: int):
    """The ``prmt`` table registers of a model-space load of the codes at byte ``offset`` of the slots
    (``_prmt_tables``), or None where the lookup cannot run: a dim other than 32, 64 or 128, a 4-bit
    codebook that is not symmetric, or codes not all 4-byte aligned or all 2 bytes past a word boundary."""
    if codec.dim not in (32, 64, 128) or _word_phase(cache, offset) is None:
        return None
    return T.prmt_tables(codec)


def _store_compiled_options(bits: int, num_warps: int, dim: int, piece: int = STORE_PIECE) -> dict:
    """Launch options of a compiled store: the register cap of ``STORE_MAXNREG`` where it was measured
    (4 warps, a row of 65 to 128 columns in one thread's registers), else none."""
    cap = STORE_MAXNREG.get(bits)
    return {"maxnreg": cap} if cap and num_warps == 4 and _store_block_d(dim) == 128 and piece == 128 else {}


def _model_options() -> dict:
    """Launch options of the model-space load (``maxnreg`` only when compiled)."""
    return {k: v for k, v in MODEL_OPTIONS.items() if k != "maxnreg" or not T.interpreted()}


def _word_phase(cache, offset: int) -> int | None:
    """Bytes past a 4-byte boundary at which every slot's byte ``offset`` in ``cache`` sits (0 or 2), or
    None when that varies between slots or is odd."""
    if any(s % 4 for s in cache.stride()[:3]):
        return None
    phase = (cache.data_ptr() + offset) % 4
    return phase if phase in (0, 2) else None


def _store_head(cache, offset: int, code_bytes: int) -> int:
    """Bytes from every code of this part to its first 4-byte aligned address.

    -1 (store bytes) when that varies between slots or leaves no whole 4-byte word.
    """
    head = -(cache.data_ptr() + offset) % 4
    if any(s % 4 for s in cache.stride()[:3]) or code_bytes - head < 4:
        return -1
    return head


def _store_block_d(dim: int) -> int:
    return max(16, C.next_power_of_2(dim))


def check_codec(name: str, codec) -> None:
    if not isinstance(codec, MSEParams):
        raise TypeError(f"{name} must be an MSE codec (kvlab.MSECodec), got {type(codec).__name__}")
    C.check_int(f"{name}.bits", codec.bits, MSE_BITS)
    C.check_int(f"{name}.dim", codec.dim, minimum=3)
    dim, levels = codec.dim, 1 << codec.bits
    for attr, shape in (("rotation", (dim, dim)), ("boundaries", (levels - 1,)), ("centroids", (levels,))):
        t = getattr(codec, attr)
        C.check_tensor(f"{name}.{attr}", t, C.FLOAT_DTYPES)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}.{attr} must have shape {shape} for dim={dim}, bits={codec.bits}, got {tuple(t.shape)}")


def _check_cache(cache) -> None:
    C.check_tensor("cache", cache, (torch.uint8,))
    if cache.dim() != 4:
        raise ValueError(f"cache must have shape [num_blocks, block_size, num_heads, slot_bytes], got {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError(f"cache must be contiguous in its last (byte) dimension, got strides {cache.stride()}")


def _check_tiling(block_rows, num_warps) -> None:
    C.check_int("block_rows", block_rows, minimum=1)
    if block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    C.check_int("num_warps", num_warps, (1, 2, 4, 8, 16, 32))


def _block_g(dim: int) -> int:
    return C.next_power_of_2(C.cdiv(dim, GROUP))


def _default_block_rows(dim: int) -> int:
    return max(1, min(256, LOAD_TILE_ELEMENTS // (GROUP * _block_g(dim))))


def store_mse(
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: torch.Tensor,
    key_codec,
    value_codec,
    *,
    check: bool = True,
    block_rows: int | None = None,
    num_warps: int = 4,
    piece: int = STORE_PIECE,
) -> None:
    """Encode ``key`` and ``value`` ``[num_tokens, num_heads, dim]`` into ``cache`` (in place).

    ``cache`` is uint8 ``[num_blocks, block_size, num_heads, MSESlot(dim, key_bits, value_bits).slot_bytes]``
    (contiguous in its last dimension; other strides are free); token ``i`` goes to slot
    ``slot_mapping[i]``, ``-1`` skips it. The bytes equal ``write_slots(cache, slot_mapping,
    key_codec.encode(key), value_codec.encode(value), layout)``.

    ``check=True`` (default) also checks values, with one host sync: slots in ``[-1, num_slots)``,
    and no NaN/Inf, norm above 65504 or nonzero norm below 6.1e-05 in the written rows of
    ``key``/``value`` (ValueError, raised after the launch, once the call's slots are put back as they
    were). Rows with slot -1 are not checked.
    ``check=False`` skips those checks and never syncs; out-of-range slots are then skipped silently.

    Hadamard codecs (``codec.hadamard_signs`` set) are rotated inside the kernel, from the input
    rows; Haar codecs by a float32 torch GEMM first (see the module docstring). ``num_warps``,
    ``block_rows`` (a power of two) and ``piece`` tune the launch: a thread holds ``piece`` columns of
    a row (16, 32, 64 or 128; default 128: a whole row of up to 128 columns), a row's pieces sit on
    neighbouring lanes and its last butterfly stages pair them, so ``block_rows = 32 * num_warps /
    pieces`` (the default) is the natural tile: fewer rows leave threads computing copies, more rows
    put several rows in a thread's registers (spills). The bytes do not depend on the tiling.
    """
    check_codec("key_codec", key_codec)
    check_codec("value_codec", value_codec)
    C.check_tensor("key", key, C.FLOAT_DTYPES)
    C.check_tensor("value", value, C.FLOAT_DTYPES)
    if key.dim() != 3:
        raise ValueError(f"key must have shape [num_tokens, num_heads, dim], got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value must have the shape of key {tuple(key.shape)}, got {tuple(value.shape)}")
    num_tokens, num_heads, dim = key.shape
    for name, codec in (("key_codec", key_codec), ("value_codec", value_codec)):
        if codec.dim != dim:
            raise ValueError(f"{name}.dim ({codec.dim}) must equal key's last dimension ({dim})")
    _check_cache(cache)
    layout = MSESlot(dim, key_codec.bits, value_codec.bits)
    num_blocks, block_size, cache_heads, slot_bytes = cache.shape
    if (cache_heads, slot_bytes) != (num_heads, layout.slot_bytes):
        raise ValueError(
            f"cache must have shape [num_blocks, block_size, {num_heads}, {layout.slot_bytes}] for {layout}, "
            f"got {tuple(cache.shape)}"
        )
    C.check_tensor("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    C.check_same_device(cache=cache, key=key, value=value, slot_mapping=slot_mapping)
    C.check_kernel_device("cache", cache)
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    num_slots = num_blocks * block_size
    C.check_slot_mapping(slot_mapping, num_tokens, num_slots, cache.device, values=check)
    _check_tiling(32 if block_rows is None else block_rows, num_warps)
    C.check_int("piece", piece, (16, 32, 64, 128))
    default_tiling = block_rows is None and num_warps == 4 and piece == STORE_PIECE
    pieces = max(1, _store_block_d(dim) // piece)  # threads per row
    block_rows = 32 * num_warps // pieces if block_rows is None else block_rows  # default: a piece per thread
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return

    device = cache.device
    parts = []
    for name, x, codec, offset, index_bytes in (("key_codec", key, key_codec, 0, layout.key_bytes),
                                                ("value_codec", value, value_codec, layout.value_offset, layout.value_bytes)):
        signs = _hadamard_signs(codec)
        if signs is not None:  # fused: the kernel rotates the input rows itself
            rows = x.reshape(num_rows, dim)
            rows = rows if rows.stride(1) == 1 else rows.contiguous()
            sign_bits = _sign_bits(codec, device, rows.dtype)
            scale = _hadamard_scale(codec)
        else:  # the reference's rotation, as one GEMM per tensor: [num_rows, dim] fp32, contiguous
            rows = x.reshape(num_rows, dim).float() @ _rotation(codec, device)
            sign_bits, scale = rows, 1.0  # unused
        mid, tie = _midpoints(codec, device, name)
        parts.append(dict(rows=rows, signs=sign_bits, mid=mid, tie=tie, scale=scale, hadamard=signs is not None,
                          squares=_square_sums(codec, device),
                          head=_store_head(cache, offset, index_bytes + NORM_BYTES)))
    # check: every written row's norm (rows not written stay 0); else a placeholder, never accessed
    norms = torch.zeros(2, num_rows if check else 1, dtype=torch.float32, device=device)
    saved = _save_slots(cache, slot_mapping) if check else None  # a failing checked call puts them back
    specs = _store_specs(parts, (key_codec, value_codec), layout, slot_mapping, cache, norms, num_rows, dim,
                         block_rows, pieces, num_warps, piece, check, default_tiling)
    with T.on_device(device):
        for fn, grid, args, options in specs:
            fn[grid](**args, **options)
    if check:
        try:
            for name, part_norms in (("key", norms[0]), ("value", norms[1])):
                C.check_fp16_scales(name, part_norms)
        except ValueError:
            _restore_slots(cache, saved)
            raise
    C.record_writer(cache, key_codec, value_codec)


class MSEStoreStep:
    """``store_mse(key, value, slot_mapping, cache, key_codec, value_codec, check=False)`` repeated on inputs of
    one shape, dtype and layout (a decode step: one token per sequence): the checks, device tables and launch
    arguments are prepared once, and each call replays the two launches (``kvlab._launch.Launch``) with the new
    rows and slots. The bytes are ``store_mse``'s. Inputs of another shape or layout go through ``store_mse``."""

    def __init__(self, key, value, slot_mapping, cache, key_codec, value_codec):
        store_mse(key, value, slot_mapping, cache, key_codec, value_codec, check=False)  # checks shapes; compiles
        from .._kernels.launch import Launch

        self.cache, self.codecs = cache, (key_codec, value_codec)
        self.shape, self.dtype = tuple(key.shape), key.dtype
        num_tokens, num_heads, dim = key.shape
        self.num_rows, self.dim = num_tokens * num_heads, dim
        layout = MSESlot(dim, key_codec.bits, value_codec.bits)
        pieces = max(1, _store_block_d(dim) // STORE_PIECE)
        parts = []
        for name, x, codec, offset, index_bytes in (("key_codec", key, key_codec, 0, layout.key_bytes),
                                                    ("value_codec", value, value_codec, layout.value_offset,
                                                     layout.value_bytes)):
            hadamard = _hadamard_signs(codec) is not None
            rows = self._rows(x, codec, hadamard)
            mid, tie = _midpoints(codec, cache.device, name)
            parts.append(dict(rows=rows, signs=_sign_bits(codec, cache.device, rows.dtype) if hadamard else rows,
                              mid=mid, tie=tie, scale=_hadamard_scale(codec) if hadamard else 1.0, hadamard=hadamard,
                              squares=_square_sums(codec, cache.device),
                              head=_store_head(cache, offset, index_bytes + NORM_BYTES)))
        self.hadamard = (parts[0]["hadamard"], parts[1]["hadamard"])
        self.stride = (parts[0]["rows"].stride(0), parts[1]["rows"].stride(0), slot_mapping.stride(0))
        norms = torch.zeros(2, 1, dtype=torch.float32, device=cache.device)
        specs = _store_specs(parts, self.codecs, layout, slot_mapping, cache, norms, self.num_rows, dim,
                             32 * 4 // pieces, pieces, 4, STORE_PIECE, False, True)
        self.launches = [Launch(fn, grid, args, options, variable=("x_ptr", "slot_ptr"))
                         for fn, grid, args, options in specs]

    def _rows(self, x, codec, hadamard: bool):
        if hadamard:
            return x.reshape(self.num_rows, self.dim)
        return x.reshape(self.num_rows, self.dim).float() @ _rotation(codec, x.device)

    def __call__(self, key, value, slot_mapping) -> None:
        rows = [self._rows(x, codec, h) for x, codec, h in zip((key, value), self.codecs, self.hadamard)]
        if (tuple(key.shape) != self.shape or value.shape != key.shape or key.dtype != self.dtype
                or value.dtype != self.dtype or (rows[0].stride(0), rows[1].stride(0), slot_mapping.stride(0)) != self.stride
                or rows[0].stride(1) != 1 or rows[1].stride(1) != 1):
            store_mse(key, value, slot_mapping, self.cache, *self.codecs, check=False)
            return
        with T.on_device(self.cache.device):
            for launch, x in zip(self.launches, rows):
                launch(x_ptr=x, slot_ptr=slot_mapping)


def _store_specs(parts, codecs, layout, slot_mapping, cache, norms, num_rows: int, dim: int, block_rows: int,
                 pieces: int, num_warps: int, piece: int, check: bool, default_tiling: bool) -> list:
    """The launches of ``store_mse`` (keys, then values) as ``(kernel, grid, arguments by name, options)``."""
    num_blocks, block_size, num_heads, _ = cache.shape
    num_slots = num_blocks * block_size
    device = cache.device
    gluon = STORE_GLUON and device.type == "cuda" and not T.interpreted() and default_tiling
    specs = []
    for p, codec, offset, index_bytes, part_norms in (
        (parts[0], codecs[0], 0, layout.key_bytes, norms[0]),
        (parts[1], codecs[1], layout.value_offset, layout.value_bytes, norms[1]),
    ):
        if gluon and p["hadamard"]:
            from . import gluon_store as mse_store

            if mse_store.supports(dim, p["head"]):
                specs.append(mse_store.spec(
                    (p["rows"], p["signs"], p["mid"], p["tie"], p["squares"], slot_mapping, cache, part_norms,
                     p["scale"], p["rows"].stride(0), num_rows, num_slots, slot_mapping.stride(0), cache.stride(0),
                     cache.stride(1), cache.stride(2)),
                    dict(D=dim, NUM_HEADS=num_heads, BLOCK_SIZE=block_size, BITS=codec.bits,
                         TUPLE=_square_tuple(codec.bits), OFFSET=offset, INDEX_BYTES=index_bytes, HEAD=p["head"],
                         NORM_CORRECTION=bool(codec.norm_correction), CHECK=check)))
                continue
        block_d = _store_block_d(dim)
        args = dict(  # no FMA contraction: y = z * scale must be rounded before t - y
            x_ptr=p["rows"], sign_ptr=p["signs"], mid_ptr=p["mid"], tie_ptr=p["tie"], sq_ptr=p["squares"],
            slot_ptr=slot_mapping, cache_ptr=cache, norm_ptr=part_norms, scale=p["scale"], stride_x=p["rows"].stride(0),
            num_rows=num_rows, num_slots=num_slots, offset=offset, stride_slot=slot_mapping.stride(0),
            stride_block=cache.stride(0), stride_pos=cache.stride(1), stride_head=cache.stride(2),
            D=dim, C=block_d // 8, LOG_D=dim.bit_length() - 1, PIECES=pieces, NUM_HEADS=num_heads,
            BLOCK_SIZE=block_size, BLOCK_ROWS=block_rows, BITS=codec.bits, TUPLE=_square_tuple(codec.bits),
            INDEX_BYTES=index_bytes, HEAD=p["head"], HADAMARD=p["hadamard"],
            NORM_CORRECTION=bool(codec.norm_correction), CHECK=check)
        options = dict(num_warps=num_warps, enable_fp_fusion=False,
                       **({} if T.interpreted() else _store_compiled_options(codec.bits, num_warps, dim, piece)))
        specs.append((_store_mse_kernel, (C.cdiv(num_rows, block_rows),), args, options))
    return specs


def _save_slots(cache: torch.Tensor, slot_mapping: torch.Tensor):
    """The slots ``slot_mapping`` names (in range, checked before) and their bytes, to undo a failed write."""
    slots = slot_mapping[slot_mapping >= 0].long()
    block, pos = slots // cache.shape[1], slots % cache.shape[1]
    return block, pos, cache[block, pos].clone()


def _restore_slots(cache: torch.Tensor, saved) -> None:
    block, pos, data = saved
    cache[block, pos] = data


def _part_layout(codec, part: str, slot_bytes: int):
    """``(offset, index_bytes)`` of ``part``'s code in a slot; the other part's size comes from ``slot_bytes``."""
    code_bytes = packed_bytes(codec.dim, codec.bits) + NORM_BYTES
    other = slot_bytes - code_bytes
    if other not in {packed_bytes(codec.dim, b) + NORM_BYTES for b in MSE_BITS}:
        raise ValueError(
            f"cache's slot_bytes ({slot_bytes}) does not fit a {part} code of {code_bytes} bytes "
            f"(dim={codec.dim}, bits={codec.bits}) plus a code of 2, 3 or 4 bits"
        )
    offset = 0 if part == "key" else other
    return offset, code_bytes - NORM_BYTES


def load_mse(
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    codec,
    part: str = "key",
    space: str = "rotated",
    out_dtype: torch.dtype = torch.float16,
    *,
    check: bool = True,
    block_rows: int | None = None,
    num_warps: int | None = None,
    fast: bool | None = None,
) -> torch.Tensor:
    """Decode the ``part`` ("key" or "value") codes of ``slot_mapping``'s slots: ``[num_tokens, num_heads, dim]``.

    Equals ``codec.decode(codes, space)`` of the codes ``read_slots`` returns, cast to ``out_dtype``
    (``space="rotated"``: ``y = x @ R`` coordinates, for attention in rotated space; ``"model"``:
    times ``R.T``, in the kernel as an fp16 product with fp32 accumulation for 16-bit outputs and dims
    of 9 to 128, else as one batched fp32 GEMM after the kernel). Rows whose slot is
    ``-1`` (or, with ``check=False``, out of range) come out as zeros. The other part's bit width is
    inferred from the cache's ``slot_bytes``. ``check=True`` (default) checks the slot range with
    one host sync, and that ``codec`` is the codec that wrote ``part`` (when ``store_mse`` wrote the
    cache); ``check=False`` does not sync. ``block_rows`` (a power of two; default 2048
    elements per tile, 16 rows of 128; in model space 64 rows) and ``num_warps`` (default one warp,
    two for 2-bit codes; four in model space) tune the launch (the defaults were the fastest on an
    H200, ``benchmarks/bench_launch_configs.py --only mse_load``).
    ``fast`` (model space in the kernel only): look the centroids up with byte permutes of 32-bit
    code words (inline PTX, as the decode kernel does) instead of shifting out and gathering each
    index; ``None`` (default) does when it can: on a GPU, dims of 32, 64 or 128, a symmetric
    4-bit codebook, codes that all start 4-byte aligned or all 2 bytes past a word boundary.
    """
    check_codec("codec", codec)
    C.check_choice("part", part, ("key", "value"))
    C.check_choice("space", space, ("rotated", "model"))
    if out_dtype not in C.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of (float16, bfloat16, float32), got {out_dtype}")
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    _check_cache(cache)
    C.check_kernel_device("cache", cache)
    num_blocks, block_size, num_heads, slot_bytes = cache.shape
    offset, index_bytes = _part_layout(codec, part, slot_bytes)
    C.check_tensor("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D [num_tokens], got shape {tuple(slot_mapping.shape)}")
    num_tokens = slot_mapping.shape[0]
    C.check_slot_mapping(slot_mapping, num_tokens, num_blocks * block_size, cache.device, values=check)
    if check:
        C.check_reader(cache, *((codec, None) if part == "key" else (None, codec)), names=("codec", "codec"))
    # model space: fused (an fp16 product in the kernel) for 16-bit outputs; an exact fp32 GEMM for fp32
    # (tiles of 16 to 128 columns: R^T, at most 32 KB in fp16, is loaded once by every program)
    fused = space == "model" and out_dtype != torch.float32 and 16 <= 8 * _block_g(codec.dim) <= 128
    if block_rows is None:
        block_rows = MODEL_TILE_ROWS if fused else _default_block_rows(codec.dim)
    if num_warps is None:
        num_warps = MODEL_NUM_WARPS if fused else LOAD_NUM_WARPS[codec.bits]
    _check_tiling(block_rows, num_warps)
    if fused and block_rows < 16:
        raise ValueError(f"block_rows must be >= 16 for space='model' with a 16-bit out_dtype (a tensor-core tile), got {block_rows}")

    device, dim, num_rows = cache.device, codec.dim, num_tokens * num_heads
    rot, cent = _rotation(codec, device), T.centroids(codec, device)
    align = _alignment(cache, offset)
    tables = _model_lookup_tables(cache, codec, offset) if fused else None
    can_fast = tables is not None and (not T.interpreted() or T.interpreter_runs_ptx())
    if fast is None:
        fast = can_fast
    elif not isinstance(fast, bool):
        raise TypeError(f"fast must be a bool or None, got {type(fast).__name__}")
    elif fast and not can_fast:
        raise ValueError("fast=True needs space='model' with a 16-bit out_dtype, dim 32, 64 or 128, a symmetric "
                         "4-bit codebook, 2- or 4-byte aligned codes and a CUDA device (inline PTX)")
    # rotated space, 3 bit: the codes as 32-bit words when every code starts on or 2 bytes past a word boundary
    phase = _word_phase(cache, offset)
    words3 = not fused and codec.bits == 3 and dim in (32, 64, 128, 256) and phase is not None
    out = torch.empty(num_rows, dim, dtype=out_dtype if space == "rotated" or fused else torch.float32, device=device)
    major = None if T.interpreted() else torch.cuda.get_device_capability(device)[0]  # compute capability
    # fused, compiled for Hopper at the default tile: the Gluon kernel (centroid tiles made in the MMA's registers)
    mma = (fused and fast and MODEL_MMA and major == 9 and block_rows == MODEL_TILE_ROWS
           and num_warps == MODEL_NUM_WARPS)
    if mma:
        from . import gluon_load as mse_mma

        mma = mse_mma.supports(dim, codec.bits)
    if num_rows and mma:
        grid = (min(C.cdiv(num_rows, mse_mma.TILE_ROWS), mse_mma.PROGRAMS_PER_SM * T.sm_count(device)),)
        b = T.cached(codec, ("mma_b", device), codec.rotation,
                    lambda r: mse_mma.operand_b(r, codec.bits).to(device))
        with T.on_device(device):
            mse_mma.launch(grid, (cache, slot_mapping, b, out, *tables, num_rows, num_blocks * block_size,
                                  slot_mapping.stride(0), cache.stride(0), cache.stride(1), cache.stride(2), grid[0]),
                           dict(D=dim, NUM_HEADS=num_heads, BLOCK_SIZE=block_size, BITS=codec.bits, OFFSET=offset,
                                INDEX_BYTES=index_bytes, ALIGN4=phase == 0))
    elif num_rows:
        rt = _rotation_t16(codec, device, order=fast) if fused else cent  # cent: a placeholder, never read
        # fused: tiles leave by bulk stores through a tensor descriptor of out (rows counted in int32)
        out_desc = (fused and MODEL_OUT_DESC and dim == 8 * _block_g(dim) and block_rows <= 256 and num_rows < 2**31
                    and (major is None or major >= 9))
        tiles = C.cdiv(num_rows, block_rows)
        # fused: persistent programs, a few per SM, each loading R^T once
        grid = (min(tiles, MODEL_PROGRAMS_PER_SM * T.sm_count(device)) if fused else tiles,)
        with T.on_device(device):
            _load_mse_kernel[grid](
                cache, slot_mapping, cent, rt,
                TensorDescriptor.from_tensor(out, [block_rows, dim]) if out_desc else out,
                *(tables if fast else (0, 0, 0, 0)),
                num_rows, num_blocks * block_size,
                slot_mapping.stride(0), cache.stride(0), cache.stride(1), cache.stride(2),
                grid[0],
                D=dim,
                NUM_HEADS=num_heads,
                BLOCK_SIZE=block_size,
                BLOCK_ROWS=block_rows,
                BLOCK_G=_block_g(dim),
                BITS=codec.bits,
                INDEX_BYTES=index_bytes,
                OFFSET=offset,
                UNIT=max(u for u in (1, 2, 4) if codec.bits % u == 0 and align % u == 0),
                NORM_ALIGNED=align % 2 == 0 and index_bytes % 2 == 0,
                BF16_BY_BITS=out.dtype == torch.bfloat16 and T.interpreted(),
                MODEL=fused,
                FAST=fast,
                ALIGN4=(fast or words3) and phase == 0,
                INTERPRETED_TILES=C.cdiv(tiles, grid[0]) if fused and T.interpreted() else 0,
                WORDS3=words3,
                OUT_DESC=out_desc,
                num_warps=num_warps,
                **(_model_options() if fused else {}),
            )
    if space == "model" and not fused:
        out = (out @ rot.T).to(out_dtype)  # the reference's inverse rotation, one GEMM for all rows
    return out.view(num_tokens, num_heads, dim)


def unpack_values_rotated(cache, slot_mapping, value_codec, **kwargs) -> torch.Tensor:
    """Value vectors in rotated space, ``[num_tokens, num_heads, dim]`` (``load_mse(part="value")``)."""
    return load_mse(cache, slot_mapping, value_codec, part="value", space="rotated", **kwargs)


def unpack_values_model_space(cache, slot_mapping, value_codec, **kwargs) -> torch.Tensor:
    """Value vectors in model space: the rotated ones times ``R.T`` in one batched GEMM."""
    return load_mse(cache, slot_mapping, value_codec, part="value", space="model", **kwargs)
