"""Triton kernels of the MSE load: read the key or value codes of the paged cache back as vectors.

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
    Load: a thread decodes groups of 8 elements (``bits`` bytes in, 16 bytes of fp16 out, one
    vector store), loading the group's bytes 4, 2 or 1 at a time as the cache's alignment allows;
    consecutive groups of a row sit on consecutive lanes, so loads and stores are coalesced. 3-bit
    codes of dims 32, 64, 128 and 256 that all start on or 2 bytes past a 4-byte boundary are read
    as 32-bit words instead, three words for four groups, as the model-space load reads them.

    Model-space load (16-bit outputs): persistent programs, 4 an SM, each loads ``R^T`` (32 KB at dim
    128) once and loops over tiles of 64 rows, a warpgroup MMA each. Compiled, the centroids come
    from byte permutes of the 32-bit code words (``prmt``, inline PTX, as in ``kvlab.attention``: the fp16
    codebook held as byte planes in registers; 4 bits needs a symmetric codebook), in the lookup's
    tile order, which ``R^T``'s rows follow (``tile_order``); the loop reads the next tile's words
    before computing the current one. Elsewhere (the interpreter, other dims, odd alignments) it
    shifts out each index and gathers its centroid. On sm_90 at the default tile (dims 64 and 128,
    fp16/bf16 out) the same load runs the Gluon kernel of ``kvlab.mse.gluon_load`` instead: the lookups
    produce the centroid tile in the register layout of the warpgroup MMA's A operand and the
    product leaves from registers as 16-byte stores, with no pass through shared memory a tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._kernels.mse_tile import groups3 as _groups3, join_all as _join_all, mse_tile_fast as _mse_tile_fast, mse_words as _mse_words, row_codes as _row_codes


# ----------------------------------------------------------------------------- load


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
def load_mse_kernel(
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
