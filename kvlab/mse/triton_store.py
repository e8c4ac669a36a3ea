"""Triton kernels of the MSE store: encode keys and values and write their codes into the paged cache.

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
    ``kvlab.mse.gluon_store`` instead (``kvlab.layout.STORE_GLUON_DIMS``): a row on four threads, the
    butterflies within chunks of 8 columns, one layout conversion through shared memory, the butterflies
    across chunks; the same bytes, with 64 registers a thread and four times the resident warps.

    Eight ``bits``-wide indices make exactly ``bits`` bytes (a "group"): packing sums the eight
    shifted indices of a group into one word, unpacking shifts them back out.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._kernels.mse_tile import row_codes as _row_codes


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
def store_mse_kernel(
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
