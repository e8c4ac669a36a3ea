"""The fused MSE store of Hadamard codecs on a few threads a row (Gluon, NVIDIA GPUs only).

What
    ``store_mse`` for a Hadamard codec at dim 128 on a CUDA GPU (fp16, bf16 or fp32 input; codes 4-byte aligned or
    2 bytes past a word boundary, as every ``MSESlot`` cache has them): the bytes of the Triton kernel of
    ``kvlab.mse`` (the reference's, ``torch.equal``) from a kernel that holds a row on ``LANES`` threads (4) instead
    of one.

Why
    The Triton store holds a whole row in one thread: 128 fp32 values, 166-178 registers, 8-12 warps an SM, too few
    to hide the latency of its long dependent chains (Nsight Compute: 42 % issue activity). Here a thread holds 32
    values of a row at 60-64 registers, so an SM runs 32 warps; on an H200 it is 1.3-1.5x the Triton kernel
    (``results/codec_ab_store_gluon.json``), though it issues more instructions per byte.

How (a row of 128 columns is 16 chunks of 8; ``LANES`` threads a row, ``32 / LANES`` rows a warp)
    * Load layout ``LA``: thread ``j`` of a row holds the ``16 / LANES`` consecutive chunks from ``16 j / LANES``
      (16-byte loads of fp16). It flips the signs and runs the butterflies ``h = 1, 2, 4`` (within a chunk) in
      registers.
    * A layout conversion through shared memory gives layout ``LB``: thread ``j`` holds ``8 / LANES`` columns of
      every chunk, so the butterflies ``h = 8 .. 64`` (across chunks) are in registers too: the same float32
      additions in the same order as ``kvlab.rotation.fwht``, so the rotated row is bit-identical.
    * In ``LB``: the scale, the norm (fp64 squares summed in the thread, then across the row's threads: any order
      rounds to the same float32 but with a probability of order 2**-26 a row), the per-row thresholds
      (``kvlab.mse.triton_store._thresholds``; each thread computes its share, then gets the others), the binary search, the
      sign, and ``|c|^2`` from the squares table of ``kvlab.mse.api._square_sums``.
    * The codes go back to ``LA`` (bytes, through shared memory), where each thread packs its chunks' codes into
      their group words and writes them (4-byte words where the code is word-aligned, else 2-byte halves), with the
      fp16 scale.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..layout import STORE_GLUON_DIMS as DIMS

__all__ = ["DIMS", "layout_constants", "layouts", "options", "rows", "spec", "supports"]

LANES = 4  # threads a row
WARPS = 4
ROWS_PER_THREAD = 1
MAXNREG = {4: 64}  # bits -> registers a thread where capped: 8 programs of 4 warps an SM at 4 bits (77 uncapped)


@functools.lru_cache(maxsize=None)
def layouts(dim: int, bits: int, rows_per_thread: int, warps: int, lanes: int) -> dict:
    """The layouts of a ``[rows, dim // 8, 8]`` tile with ``lanes`` threads a row: ``LA`` (a thread holds
    ``dim // 8 // lanes`` consecutive chunks of 8 columns), ``LB`` (a thread holds ``8 // lanes`` columns of every
    chunk), ``LW`` (``[rows, lanes]``: one thread each), ``LT`` and ``LTA`` (``[rows, 2**(bits - 1)]`` thresholds: a
    thread computes its share, then every thread of a row holds all of them)."""
    nc, half = dim // 8, 1 << (bits - 1)
    rows = 32 // lanes
    return dict(
        LA=gl.BlockedLayout([rows_per_thread, nc // lanes, 8], [rows, lanes, 1], [warps, 1, 1], [2, 1, 0]),
        LB=gl.BlockedLayout([rows_per_thread, nc, 8 // lanes], [rows, 1, lanes], [warps, 1, 1], [2, 1, 0]),
        LW=gl.BlockedLayout([rows_per_thread, 1], [rows, lanes], [warps, 1], [1, 0]),
        LT=gl.BlockedLayout([rows_per_thread, max(1, half // lanes)], [rows, lanes], [warps, 1], [1, 0]),
        LTA=gl.BlockedLayout([rows_per_thread, half], [rows, lanes], [warps, 1], [1, 0]),
    )


def layout_constants(dim: int, bits: int) -> dict:
    """The kernel's layout arguments at the default tiling (``LANES``, ``ROWS_PER_THREAD``, ``WARPS``)."""
    return layouts(dim, bits, ROWS_PER_THREAD, WARPS, LANES)


def rows() -> int:
    """Rows a program at the default tiling."""
    return ROWS_PER_THREAD * (32 // LANES) * WARPS


def options(bits: int) -> dict:
    """Compile options of the kernel for ``bits``-bit codes: ``WARPS``, no FMA contraction (``y = z * scale`` is
    rounded before it is compared, as in ``kvlab.mse``), and the register cap of ``MAXNREG`` where there is one."""
    return dict(num_warps=WARPS, enable_fp_fusion=False, **({"maxnreg": MAXNREG[bits]} if bits in MAXNREG else {}))


def supports(dim: int, head: int) -> bool:
    """Whether the kernel stores codes of ``dim`` whose first 4-byte boundary is ``head`` bytes in."""
    return dim in DIMS and head in (0, 2)


@gluon.jit
def _unstack(x, R: gl.constexpr, N: gl.constexpr, K: gl.constexpr):
    """``[R, N, K]`` -> tuple of its ``N`` slices ``[R, K]`` along axis 1 (register renaming: axis 1 is in the thread)."""
    xs = (x,)
    for level in gl.static_range(N.bit_length() - 1):  # pieces of N >> level chunks, halved
        ys = ()
        for i in gl.static_range(1 << level):
            lo, hi = gl.split(gl.permute(gl.reshape(xs[i], [R, 2, N >> (level + 1), K]), (0, 2, 3, 1)))
            ys = ys + (lo, hi)
        xs = ys
    out = ()
    for c in gl.static_range(N):  # the top bit is split first: piece c is chunk c
        out = out + (gl.reshape(xs[c], [R, K]),)
    return out


@gluon.jit
def _stack(xs, R: gl.constexpr, N: gl.constexpr, K: gl.constexpr):
    """Inverse of ``_unstack``: tuple of ``N`` ``[R, K]`` -> ``[R, N, K]``."""
    ys = ()
    for c in gl.static_range(N):
        ys = ys + (gl.reshape(xs[c], [R, 1, K]),)
    for level in gl.static_range(N.bit_length() - 1):  # join neighbours: pieces of 2 << level chunks
        zs = ()
        for i in gl.static_range(N >> (level + 1)):
            zs = zs + (gl.reshape(gl.permute(gl.join(ys[2 * i], ys[2 * i + 1]), (0, 3, 1, 2)), [R, 2 << level, K]),)
        ys = zs
    return ys[0]


@gluon.jit
def _thresholds(n, mid_ptr, tie_ptr, R: gl.constexpr, NUM: gl.constexpr, LT: gl.constexpr, LTA: gl.constexpr):
    """``kvlab.mse.triton_store._thresholds``: per-row float32 ``t_i`` with ``fl(y / n) > b_i <=> y > t_i``, as a tuple of
    ``NUM`` ``[R]`` tensors. Threshold ``i`` of a row is computed by one of its threads (layout ``LT``), then
    every thread of the row gets all of them (``LTA``)."""
    o_i = gl.arange(0, NUM, layout=gl.SliceLayout(0, LT))
    n64 = gl.expand_dims(gl.convert_layout(gl.where(n > 0, n, 1.0), gl.SliceLayout(1, LT)).to(gl.float64), 1)
    t_exact = n64 * gl.expand_dims(gl.load(mid_ptr + o_i), 0)  # [R, NUM]
    t = t_exact.to(gl.float32)
    back = t.to(gl.float64)
    down = (back > t_exact) | ((back == t_exact) & gl.expand_dims(gl.load(tie_ptr + o_i) != 0, 0))
    b = t.to(gl.int32, bitcast=True)
    key = gl.where(b >= 0, b, -(b & 0x7FFFFFFF)) - 1
    below = gl.where(key >= 0, key, (-key) | -2147483648).to(gl.float32, bitcast=True)
    ts = gl.convert_layout(gl.where(down, below, t), LTA)  # [R, NUM], all of a row's in each of its threads
    ts = _unstack(gl.reshape(ts, [R, NUM, 1]), R, NUM, 1)  # NUM x [R, 1]
    out = ()
    for i in gl.static_range(NUM):
        out = out + (gl.reshape(ts[i], [R]),)
    return out


@gluon.jit
def _magnitude(a, ts, BITS_M: gl.constexpr):
    """Number of the ``2**BITS_M - 1`` ascending thresholds ``ts`` (``[R, 1]``) strictly below ``a``: a binary search."""
    t = ts[(1 << (BITS_M - 1)) - 1]
    up = a > t
    idx = gl.where(up, 1 << (BITS_M - 1), 0)
    cands = ts
    for level in gl.static_range(1, BITS_M):
        picked = ()
        for i in gl.static_range((1 << (BITS_M - level)) - 1):
            picked = picked + (gl.where(up, cands[(1 << (BITS_M - level)) + i], cands[i]),)
        cands = picked
        t = cands[(1 << (BITS_M - 1 - level)) - 1]
        up = a > t
        idx = idx | gl.where(up, 1 << (BITS_M - 1 - level), 0)
    return idx


@gluon.jit
def store_kernel(
    x_ptr,  # [num_rows, D] fp16/bf16/fp32, rows stride_x apart, columns contiguous
    sign_ptr,  # int16/int32 [D]: the sign bit of each column's Hadamard sign (as x's width)
    mid_ptr,  # fp64 [HALF]: kvlab.mse.api._midpoints
    tie_ptr,  # int32 [HALF]
    sq_ptr,  # fp64: kvlab.mse.api._square_sums (sums of the squared centroids of TUPLE codes)
    slot_ptr,  # int32/int64 [num_tokens]
    cache_ptr,  # uint8 [num_blocks, BLOCK_SIZE, NUM_HEADS, slot_bytes]
    norm_ptr,  # fp32 [num_rows]: CHECK: the stored scales
    scale,  # fp32 1 / sqrt(D)
    stride_x,
    num_rows,
    num_slots,
    stride_slot,
    stride_block,
    stride_pos,
    stride_head,
    D: gl.constexpr,
    NUM_HEADS: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    BITS: gl.constexpr,
    TUPLE: gl.constexpr,  # codes an entry of the squares table: 1 (16 entries at 4 bits) or 2
    OFFSET: gl.constexpr,  # byte of this part's code in a slot
    INDEX_BYTES: gl.constexpr,
    HEAD: gl.constexpr,  # 0: codes 4-byte aligned; 2: 2 bytes past a word boundary
    NORM_CORRECTION: gl.constexpr,
    CHECK: gl.constexpr,
    ROWS: gl.constexpr,  # rows a program
    LA: gl.constexpr,
    LB: gl.constexpr,
    LW: gl.constexpr,
    LT: gl.constexpr,
    LTA: gl.constexpr,
):
    NC: gl.constexpr = D // 8  # chunks of 8 columns
    LANES: gl.constexpr = LW.threads_per_warp[1]  # threads a row
    GPT: gl.constexpr = NC // LANES  # chunks (groups) a thread holds in LA
    LOG_NC: gl.constexpr = NC.bit_length() - 1
    HALF: gl.constexpr = 1 << (BITS - 1)
    RA: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LA))
    i_t = gl.program_id(0).to(gl.int64)

    # ---- load (LA): GPT chunks of 8 columns a thread, signs flipped, butterflies h = 1, 2, 4
    o_r = i_t * ROWS + gl.arange(0, ROWS, layout=RA)
    o_c = gl.arange(0, NC, layout=gl.SliceLayout(0, gl.SliceLayout(2, LA)))
    o_p = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LA)))
    o_d = gl.expand_dims(gl.expand_dims(o_c * 8, 0), 2) + gl.expand_dims(gl.expand_dims(o_p, 0), 1)  # [1, NC, 8]
    m_r = gl.expand_dims(gl.expand_dims(o_r < num_rows, 1), 2)
    x = gl.load(x_ptr + gl.expand_dims(gl.expand_dims(o_r * stride_x, 1), 2) + o_d, mask=m_r, other=0.0)
    s = gl.load(sign_ptr + o_d)
    x = (x.to(s.dtype, bitcast=True) ^ s).to(x.dtype, bitcast=True).to(gl.float32)
    for i in gl.static_range(3):  # h = 1 << i: the row as [NC, 4 >> i, 2, 1 << i]
        a, b = gl.split(gl.permute(gl.reshape(x, [ROWS, NC, 4 >> i, 2, 1 << i]), (0, 1, 2, 4, 3)))
        x = gl.reshape(gl.permute(gl.join(a + b, a - b), (0, 1, 2, 4, 3)), [ROWS, NC, 8])

    # ---- LB: 8 / LANES columns of every chunk a thread, held as NC tensors [ROWS, 8]; butterflies h = 8 .. D / 2
    xs = _unstack(gl.convert_layout(x, LB), ROWS, NC, 8)
    for i in gl.static_range(LOG_NC):  # h = 8 << i: chunk c pairs with c + (1 << i) in blocks of 2 << i
        ys = ()
        for c in gl.static_range(NC):
            if (c >> i) & 1 == 0:
                ys = ys + (xs[c] + xs[c + (1 << i)],)
            else:
                ys = ys + (xs[c - (1 << i)] - xs[c],)
        xs = ys
    LY: gl.constexpr = xs[0].type.layout
    RY: gl.constexpr = gl.SliceLayout(1, LY)

    # scale; norm: fp64 sum of the (exact) squares, sqrt (IEEE for fp64), rounded once to fp32
    ys = ()
    for c in gl.static_range(NC):
        ys = ys + (xs[c] * scale,)
    y64 = ys[0].to(gl.float64)
    acc = y64 * y64
    for c in gl.static_range(1, NC):
        y64 = ys[c].to(gl.float64)
        acc = gl.fma(y64, y64, acc)
    norm = gl.sqrt(gl.sum(acc, axis=1)).to(gl.float32)  # [ROWS]
    ts = _thresholds(norm, mid_ptr, tie_ptr, ROWS, HALF, LT, LTA)  # the zero boundary's, then the positive ones'
    tb = ()
    for i in gl.static_range(HALF):
        tb = tb + (gl.expand_dims(gl.convert_layout(ts[i], RY), 1),)  # [ROWS, 1]
    codes = ()
    for c in gl.static_range(NC):
        if BITS == 2:
            m = (gl.abs(ys[c]) > tb[1]).to(gl.int32)
        else:
            m = _magnitude(gl.abs(ys[c]), tb[1:], BITS - 1)
        codes = codes + (m | gl.where(ys[c] > tb[0], 0, HALF),)  # sign-magnitude

    if NORM_CORRECTION:  # |c|^2: fp64 sum of the picked centroids' squares (TUPLE codes an entry of the table)
        sq = gl.load(sq_ptr + codes[0]) if TUPLE == 1 else gl.load(sq_ptr + (codes[0] | (codes[1] << BITS)))
        for c in gl.static_range(TUPLE, NC, TUPLE):
            sq += gl.load(sq_ptr + codes[c]) if TUPLE == 1 else gl.load(sq_ptr + (codes[c] | (codes[c + 1] << BITS)))
        length = gl.sqrt(gl.sum(sq, axis=1)).to(gl.float32)
        norm = gl.div_rn(norm, length)

    # ---- codes back to LA (bytes): a thread packs its GPT chunks into group words (index k at bit BITS k)
    code8 = ()
    for c in gl.static_range(NC):
        code8 = code8 + (codes[c].to(gl.uint8),)
    code = gl.convert_layout(_stack(code8, ROWS, NC, 8), LA).to(gl.uint32)
    g = gl.sum(code << gl.expand_dims(gl.expand_dims(o_p * BITS, 0), 1).to(gl.uint32), axis=2)  # [ROWS, NC]
    gs = _unstack(gl.permute(gl.reshape(g, [ROWS, LANES, GPT]), (0, 2, 1)), ROWS, GPT, LANES)  # thread j: j GPT + i
    # its code bytes as 32-bit words (the last one partly filled when GPT BITS is not a multiple of 4)
    GB: gl.constexpr = 8 * BITS  # bits a group
    w = ()
    for k in gl.static_range((GPT * BITS + 3) // 4):
        v = gs[0] & 0
        for i in gl.static_range(GPT):
            if i * GB < 32 * k + 32 and (i + 1) * GB > 32 * k:
                if i * GB >= 32 * k:
                    v = v | (gs[i] << (i * GB - 32 * k))
                else:
                    v = v | (gs[i] >> (32 * k - i * GB))
        w = w + (gl.convert_layout(v, LW),)

    # ---- where each row's code goes; rows past the end and slots out of range are not written
    RW: gl.constexpr = gl.SliceLayout(1, LW)
    o_rw = i_t * ROWS + gl.arange(0, ROWS, layout=RW)
    m_rw = o_rw < num_rows
    slot = gl.load(slot_ptr + (o_rw // NUM_HEADS) * stride_slot, mask=m_rw, other=-1).to(gl.int64)
    m_w = m_rw & (slot >= 0) & (slot < num_slots)
    dst = cache_ptr + ((slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_pos
                       + (o_rw % NUM_HEADS) * stride_head + OFFSET)  # [ROWS] the code's first byte
    o_j = gl.arange(0, LANES, layout=gl.SliceLayout(0, LW))  # the threads of a row
    m = gl.expand_dims(m_w, 1)
    p = gl.expand_dims(dst, 1) + gl.expand_dims(o_j * (GPT * BITS), 0)  # [ROWS, LANES]: a thread's first byte
    if HEAD == 0 and (GPT * BITS) % 4 == 0:  # 4-byte words
        for k in gl.static_range(len(w)):
            gl.store((p + 4 * k).to(gl.pointer_type(gl.uint32)), w[k], mask=m)
    else:  # 2-byte halves
        for k in gl.static_range(GPT * BITS // 2):
            v = (w[k // 2] >> (16 * (k % 2))) & 0xFFFF
            gl.store((p + 2 * k).to(gl.pointer_type(gl.uint16)), v.to(gl.uint16), mask=m)
    norm = gl.convert_layout(norm, RW)
    gl.store((dst + INDEX_BYTES).to(gl.pointer_type(gl.uint16)), norm.to(gl.float16).to(gl.uint16, bitcast=True),
             mask=m_w)
    if CHECK:
        gl.store(norm_ptr + o_rw, norm, mask=m_w)


def spec(args: tuple, constants: dict):
    """``(kernel, grid, arguments by name, options)`` of a launch of ``store_kernel`` over ``args[10]``
    (``num_rows``) rows with the runtime ``args`` (in order) and the ``constants`` (without the layouts and
    ``ROWS``), at the tiling of ``LANES``, ``ROWS_PER_THREAD`` and ``WARPS``."""
    grid = (-(-args[10] // rows()),)
    kwargs = dict(zip(store_kernel.arg_names, args), **constants, ROWS=rows(),
                  **layout_constants(constants["D"], constants["BITS"]))
    return store_kernel, grid, kwargs, options(constants["BITS"])
