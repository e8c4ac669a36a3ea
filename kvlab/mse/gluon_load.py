"""The model-space MSE load on the warpgroup MMA's register operands (Gluon, Hopper GPUs only).

What
    ``load_mse(space="model")`` with a 16-bit output, dims 64 and 128, on a GPU of compute capability 9:
    each row's centroids times ``R^T``, times the row's stored scale, ``(c R^T) s`` (fp16 centroids and
    ``R^T``, fp32 accumulation, the scale in fp32), as the Triton kernel of ``kvlab.mse`` computes it.

How (per tile of ``TILE_ROWS = 64`` rows, one warpgroup of 4 warps, 16 rows a warp)
    * The A operand is made in registers: a thread of an A fragment reads the words of its rows' codes
      that hold its columns (``kvlab._kernels.mma_tile.key_words_layout``), and the byte-permute lookups of the
      decode loop turn them into the fp16 centroid tile *in* the register layout of the operand (its
      columns in ``query_order``). No tile goes through shared memory and no barrier separates the
      lookup from the product.
    * B is ``R^T`` with its rows in ``query_order`` and its columns in ``column_order``, copied into shared
      memory once by each persistent program (``PROGRAMS_PER_SM`` an SM), which then loops over tiles,
      reading the next tile's code words and scales before it computes its own, and the slots that address
      them one step earlier still where the codes sit 2 bytes past a word boundary (``SLOTS_AHEAD``).
    * The accumulator leaves from registers: with B's columns in ``column_order``, the 16 column pairs a
      thread holds of each row are four runs of 8 consecutive output columns, so each thread writes
      16-byte vectors and the four threads of a row fill 64 contiguous bytes a store.

Correctness
    ``tests/ops/test_mse.py`` compares this load with the reference and with the Triton kernel on a GPU
    (Triton's interpreter cannot run Gluon; on a CPU ``load_mse`` uses the Triton kernel).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from ..layout import MMA_BITS as BITS, MMA_DIMS as DIMS  # 3 bit: dim 128 (a thread's code is four whole groups of 8 indices)
from .._kernels.mma_tile import key_tile as _key_tile, key_words_layout, query_order

__all__ = ["DIMS", "TILE_ROWS", "column_order", "launch", "operand_b"]

TILE_ROWS = 64  # rows a tile: one warpgroup MMA, 16 rows a warp
WARPS = 4
ROWS = gl.constexpr(TILE_ROWS)  # the same, for the kernels
NUM_WARPS = gl.constexpr(WARPS)
PROGRAMS_PER_SM = 4
MAXNREG = 128  # registers a thread: 4 programs an SM (no spills)
# steps ahead of its words at which a tile's slots are read, by whether the codes are word-aligned (ALIGN4): the
# faster of 1 and 2 on the H200 (results/codec_ab_model_mma.json)
SLOTS_AHEAD = {True: 1, False: 2}


def column_order(dim: int) -> torch.Tensor:
    """int64 ``[dim]``: the output column at each column of the accumulator. Accumulator column
    ``32 a + 8 b + 2 t + e`` (pair ``4 a + b`` of thread ``t``) holds output column ``32 a + 8 t + 2 b + e``."""
    n = torch.arange(dim)
    a, b, t, e = n // 32, (n // 8) % 4, (n // 2) % 4, n % 2
    return 32 * a + 8 * t + 2 * b + e


@functools.lru_cache(maxsize=None)
def layouts(dim: int) -> tuple:
    """(accumulator, A operand, output) layouts of a ``[ROWS, dim]`` tile. The output layout is the
    accumulator's with its columns in output order (``column_order``) and a thread's 8 consecutive
    columns in consecutive registers (one 16-byte store)."""
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, dim, 16])
    a = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    reg = [[0, 1], [0, 2], [0, 4], [8, 0]] + [[0, 32 << i] for i in range((dim // 32).bit_length() - 1)]
    lanes = [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]]
    out = gl.DistributedLinearLayout(reg, lanes, [[16, 0], [32, 0]], [], [TILE_ROWS, dim])
    return acc, a, out


def supports(dim: int, bits: int) -> bool:
    return dim in DIMS and bits in BITS and (bits != 3 or dim == 128)


def layout_constants(dim: int, bits: int) -> dict:
    """The kernel's layout arguments for ``dim`` and ``bits``."""
    acc, a, out = layouts(dim)
    return dict(WORDS=key_words_layout(dim, bits, WARPS), ACC=acc, A=a, OUT=out)


@gluon.jit
def _fetch(cache_ptr, slot, tile, o_m, o_w, m_w, num_slots, stride_block, stride_pos, stride_head,
           NUM_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr, OFFSET: gl.constexpr, INDEX_BYTES: gl.constexpr,
           ALIGN4: gl.constexpr, SCALE_LAYOUT: gl.constexpr):
    """Tile ``tile``'s code words ``[ROWS, 4, words]`` and stored scales (fp16 bits, in ``SCALE_LAYOUT``), its rows'
    slots ``slot`` (``_slots``); rows past the end and slots out of range read as zeros (a zero scale)."""
    o_r = tile.to(gl.int64) * ROWS + o_m
    slot = slot.to(gl.int64)
    m_s = (slot >= 0) & (slot < num_slots)
    base = cache_ptr + ((slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_pos
                        + (o_r % NUM_HEADS) * stride_head + OFFSET)
    m = m_s[:, None, None] & m_w
    if ALIGN4:
        w = gl.load(base.to(gl.pointer_type(gl.int32))[:, None, None] + o_w, mask=m, other=0)
    else:  # 2 bytes past a word boundary: the middle 32 bits of the two aligned words around each word
        p = (base - 2).to(gl.pointer_type(gl.int32))[:, None, None] + o_w
        w_a = gl.load(p, mask=m, other=0)
        w_b = gl.load(p + 1, mask=m, other=0)
        w = ((w_a.to(gl.uint32) >> 16) | (w_b.to(gl.uint32) << 16)).to(gl.int32)
    s = gl.load((base + INDEX_BYTES).to(gl.pointer_type(gl.uint16)), mask=m_s, other=0)
    return w, gl.convert_layout(s, SCALE_LAYOUT, assert_trivial=True)


@gluon.jit
def _slots(slot_ptr, tile, o_m, num_rows, stride_slot, NUM_HEADS: gl.constexpr):
    """The slot of each row of tile ``tile`` (-1 past the end)."""
    o_r = tile.to(gl.int64) * ROWS + o_m
    return gl.load(slot_ptr + (o_r // NUM_HEADS) * stride_slot, mask=o_r < num_rows, other=-1)


@gluon.jit
def _tile_out(out_ptr, w, s, b_smem, tile, num_rows, o_ro, o_d, t0, t1, t2, t3, D: gl.constexpr, BITS: gl.constexpr,
              ACC: gl.constexpr, A: gl.constexpr, OUT: gl.constexpr):
    """Tile ``tile`` from its code words ``w`` and scales ``s``: lookups, the product by B, the scale, the stores."""
    a = _key_tile(w, t0, t1, t2, t3, D, BITS, ROWS, A)
    acc = warpgroup_mma(a, b_smem, gl.zeros([ROWS, D], gl.float32, layout=ACC), use_acc=False)
    v = (acc * s.to(gl.float16, bitcast=True).to(gl.float32)[:, None]).to(out_ptr.dtype.element_ty)
    # accumulator column 32 a + 8 b + 2 t + e is output column 32 a + 8 t + 2 b + e
    v = gl.reshape(gl.permute(gl.reshape(v, [ROWS, D // 32, 4, 4, 2]), (0, 1, 3, 2, 4)), [ROWS, D])
    v = gl.convert_layout(v, OUT)
    o_r = tile.to(gl.int64) * ROWS + o_ro
    gl.store(out_ptr + o_r[:, None] * D + o_d[None, :], v, mask=(o_r < num_rows)[:, None])


# Runtime arguments are not specialised on: a compiled kernel depends only on the constants, the options
# and the argument types, so that ``launch`` can reuse it without Triton's per-call argument binding.
_RUNTIME = ["cache_ptr", "slot_ptr", "b_ptr", "out_ptr", "t0", "t1", "t2", "t3", "num_rows", "num_slots", "stride_slot",
            "stride_block", "stride_pos", "stride_head", "num_programs"]


@gluon.jit(do_not_specialize=_RUNTIME[4:], do_not_specialize_on_alignment=_RUNTIME[:2])
def model_load_kernel(
    cache_ptr,  # uint8 [num_blocks, BLOCK_SIZE, NUM_HEADS, slot_bytes]; codes 4-byte aligned or 2 bytes past
    slot_ptr,  # int32/int64 [num_tokens]
    b_ptr,  # fp16 [D, D]: R^T, rows in query_order, columns in column_order (operand_b)
    out_ptr,  # fp16/bf16 [num_rows, D], 16-byte aligned; row = token * NUM_HEADS + head
    t0, t1, t2, t3,  # byte planes of the codebook (kvlab._kernels.tables.prmt_tables)
    num_rows,
    num_slots,
    stride_slot,
    stride_block,
    stride_pos,
    stride_head,
    num_programs,  # program p computes tiles p, p + num_programs, ...
    D: gl.constexpr,
    NUM_HEADS: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    BITS: gl.constexpr,
    OFFSET: gl.constexpr,  # byte of this part's code in a slot
    INDEX_BYTES: gl.constexpr,
    ALIGN4: gl.constexpr,  # every code starts 4-byte aligned (else 2 bytes past a word boundary)
    WORDS: gl.constexpr,  # key_words_layout(D, BITS, NUM_WARPS)
    ACC: gl.constexpr,  # layouts(D)
    A: gl.constexpr,
    OUT: gl.constexpr,
    SLOTS_AHEAD: gl.constexpr,  # 1: a tile's slots read with its words; 2: one step earlier
):
    KW: gl.constexpr = D * BITS // 128  # code words a thread reads a row
    NWT: gl.constexpr = KW if BITS != 3 else 4  # held in a power of two
    # B into shared memory, once
    BL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    o_bk = gl.arange(0, D, layout=gl.SliceLayout(1, BL))
    o_bn = gl.arange(0, D, layout=gl.SliceLayout(0, BL))
    b = gl.load(b_ptr + o_bk[:, None] * D + o_bn[None, :])
    b_smem = gl.allocate_shared_memory(gl.float16, [D, D], gl.NVMMASharedLayout.get_default_for([D, D], gl.float16), b)
    fence_async_shared()

    o_m = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, WORDS)))
    o_t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, WORDS)))
    o_q = gl.arange(0, NWT, layout=gl.SliceLayout(0, gl.SliceLayout(1, WORDS)))
    o_w = (o_t * KW)[None, :, None] + o_q[None, None, :]
    m_w = (o_q < KW)[None, None, :]
    o_d = gl.arange(0, D, layout=gl.SliceLayout(0, OUT))
    o_ro = gl.arange(0, ROWS, layout=gl.SliceLayout(1, OUT))
    SCALE: gl.constexpr = gl.SliceLayout(1, ACC)

    i_p = gl.program_id(0)
    P = num_programs
    w, s = _fetch(cache_ptr, _slots(slot_ptr, i_p, o_m, num_rows, stride_slot, NUM_HEADS), i_p, o_m, o_w, m_w,
                  num_slots, stride_block, stride_pos, stride_head, NUM_HEADS, BLOCK_SIZE, OFFSET, INDEX_BYTES, ALIGN4, SCALE)
    if SLOTS_AHEAD == 1:
        for tile in range(i_p, gl.cdiv(num_rows, ROWS), P):
            n_w, n_s = _fetch(cache_ptr, _slots(slot_ptr, tile + P, o_m, num_rows, stride_slot, NUM_HEADS), tile + P, o_m,
                              o_w, m_w, num_slots, stride_block, stride_pos, stride_head, NUM_HEADS, BLOCK_SIZE, OFFSET,
                              INDEX_BYTES, ALIGN4, SCALE)
            _tile_out(out_ptr, w, s, b_smem, tile, num_rows, o_ro, o_d, t0, t1, t2, t3, D, BITS, ACC, A, OUT)
            w, s = n_w, n_s
    else:  # the slots of a tile read one step before its words
        n_slot = _slots(slot_ptr, i_p + P, o_m, num_rows, stride_slot, NUM_HEADS)
        for tile in range(i_p, gl.cdiv(num_rows, ROWS), P):
            nn_slot = _slots(slot_ptr, tile + 2 * P, o_m, num_rows, stride_slot, NUM_HEADS)
            n_w, n_s = _fetch(cache_ptr, n_slot, tile + P, o_m, o_w, m_w, num_slots, stride_block, stride_pos, stride_head,
                              NUM_HEADS, BLOCK_SIZE, OFFSET, INDEX_BYTES, ALIGN4, SCALE)
            _tile_out(out_ptr, w, s, b_smem, tile, num_rows, o_ro, o_d, t0, t1, t2, t3, D, BITS, ACC, A, OUT)
            w, s, n_slot = n_w, n_s, nn_slot


def operand_b(rotation: torch.Tensor, bits: int) -> torch.Tensor:
    """B: ``R^T`` in fp16, its rows in ``query_order(dim, bits)`` and its columns in ``column_order(dim)``."""
    dim = rotation.shape[0]
    rt = rotation.detach().to("cpu", torch.float32).T.to(torch.float16)
    return rt[query_order(dim, bits)][:, column_order(dim)].contiguous()


_COMPILED = {}  # (device, constants, argument types) -> compiled kernel


def launch(grid, args: tuple, constants: dict) -> None:
    """Launch ``model_load_kernel`` on ``grid`` with the runtime ``args`` (in order) and the ``constants``
    (in the kernel's order, without the layouts): the first launch of a kind compiles through Triton's
    JIT, later ones go straight to the compiled kernel."""
    ahead = SLOTS_AHEAD[bool(constants["ALIGN4"])]
    key = (args[0].device, tuple(constants.items()), ahead,
           tuple(a.dtype if isinstance(a, torch.Tensor) else -(2**31) <= a < 2**31 for a in args))  # int: 32 or 64 bit
    constants = dict(constants, **layout_constants(constants["D"], constants["BITS"]), SLOTS_AHEAD=ahead)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    compiled = _COMPILED.get(key)
    if compiled is None:
        _COMPILED[key] = model_load_kernel[grid](*args, **constants, num_warps=WARPS, maxnreg=MAXNREG)
    else:
        compiled[grid](*args, *constants.values())
