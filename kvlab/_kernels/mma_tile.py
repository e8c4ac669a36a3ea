"""Gluon device code shared by the MSE model-space load (``kvlab.mse``) and the MMA decode loop
(``kvlab.attention``): the register layout of MSE key words on the A fragments of ``mma`` and the lookup
that turns them into the key operand (``key_tile``, columns in ``query_order``)."""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .lookup import lookup2_ptx, lookup3_ptx, lookup4_ptx

__all__ = ["STEP", "bit_range", "groups3", "halves", "join_bits", "key_tile", "key_words", "key_words_layout", "query_order"]


STEP = 16  # keys per step


# Two key words (the same 8 coordinates of keys a = g and b = g + 8) -> 8 fp16 pairs in the order of
# two A fragments: (a, r0), (b, r0), (a, r1), (b, r1), (a, r2), (b, r2), (a, r3), (b, r3), r the pair.
LOOKUP4_TWO_KEYS = gl.constexpr(
    "{\n" + lookup4_ptx("$8", ("$0", "$2", "$4", "$6"), tables=("$10", "$11", "$12", "$13"))
    + lookup4_ptx("$9", ("$1", "$3", "$5", "$7"), tables=("$10", "$11", "$12", "$13")) + "}")


# 2 bit: two key words (16 coordinates each) -> 16 fp16 pairs, output 2 p + x the pair p of key x
LOOKUP2_TWO_KEYS = gl.constexpr(
    "{\n" + lookup2_ptx("$16", [f"${2 * p}" for p in range(8)], ("$18", "$19"))
    + lookup2_ptx("$17", [f"${2 * p + 1}" for p in range(8)], ("$18", "$19")) + "}")


# 3 bit: two key groups (24 bits each: the same 8 coordinates of keys g and g + 8) -> 8 fp16 pairs, in the
# order of the 4-bit lookup of two key words
LOOKUP3_TWO_KEYS = gl.constexpr(
    "{\n" + lookup3_ptx("$8", ("$0", "$2", "$4", "$6"), tables=("$10", "$11", "$12", "$13"))
    + lookup3_ptx("$9", ("$1", "$3", "$5", "$7"), tables=("$10", "$11", "$12", "$13")) + "}")


def bit_range(n: int) -> range:
    return range(n.bit_length() - 1)


def key_words(dim: int, bits: int) -> tuple[int, int]:
    """(words of a key code a thread of the A fragment reads, the power of two it holds them in): 3-bit
    codes read 3 words (four groups of 8 indices) into 4."""
    n = dim * bits // 128
    return n, 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def key_words_layout(dim: int, bits: int, warps: int = 1) -> gl.DistributedLinearLayout:
    """``[BN warps, 4, key_words(dim, bits)[1]]`` words (key ``16 w + g + 8 j``, thread column ``t``, word ``q``) on the
    threads of the A fragments of ``warps`` warps, 16 keys each."""
    nw = key_words(dim, bits)[1]
    reg = [[0, 0, 1 << i] for i in bit_range(nw)] + [[8, 0, 0]]
    lanes = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    return gl.DistributedLinearLayout(reg, lanes, [[STEP << i, 0, 0] for i in bit_range(warps)], [], [STEP * warps, 4, nw])


def query_order(dim: int, bits: int = 4) -> torch.Tensor:
    """int64 ``[dim]``: the rotated coordinate at each column of the key operand (the query is permuted to match)."""
    k = torch.arange(dim)
    e, t = k % 2, (k // 2) % 4
    words = dim // 32 if bits in (3, 4) else dim * bits // 128  # words (3 bits: groups of 8 indices) per thread
    if bits in (3, 4):  # column 32 q + 16 r1 + 8 r0 + 2 t + e: pair r = r0 + 2 r1 of word (group) q
        q, r = k // 32, (k // 8) % 2 + 2 * ((k // 16) % 2)
        return 8 * (t * words + q) + 2 * r + e
    q, p = k // 64, (k // 8) % 2 + 2 * ((k // 16) % 2) + 4 * ((k // 32) % 2)  # 2 bit: pair p of word q
    return 16 * (t * words + q) + p % 4 + 4 * e + 8 * (p // 4)


@gluon.jit
def halves(x):
    """int32 holding an fp16 pair -> (low fp16, high fp16)."""
    return gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [x], dtype=(gl.float16, gl.float16),
                                     is_pure=True, pack=1)


@gluon.jit
def join_bits(xs, LEVELS: gl.constexpr):
    """Tuple of ``2**LEVELS`` same-shape tensors -> one tensor with ``LEVELS`` new trailing axes of 2, the
    first the lowest bit of the tuple index."""
    for _ in gl.static_range(LEVELS):
        ys = ()
        for i in gl.static_range(len(xs) // 2):
            ys = ys + (gl.join(xs[2 * i], xs[2 * i + 1]),)
        xs = ys
    return xs[0]


@gluon.jit
def groups3(w):
    """``[n, m, 4]`` words, the first three a 96-bit code -> ``[n, m, 4]`` its four 24-bit groups (low bits)."""
    n: gl.constexpr = w.shape[0]
    m: gl.constexpr = w.shape[1]
    w_even, w_odd = gl.split(gl.reshape(w.to(gl.uint32), [n, m, 2, 2]))  # words (0, 2), (1, 3)
    w0, w2 = gl.split(w_even)
    w1, _ = gl.split(w_odd)
    g = join_bits((w0, (w0 >> 24) | (w1 << 8), (w1 >> 16) | (w2 << 16), w2 >> 8), 2)  # [n, m, a, b]: group a + 2 b
    return gl.reshape(gl.permute(g, (0, 1, 3, 2)), [n, m, 4]).to(gl.int32)


@gluon.jit
def key_tile(w_k, tk0, tk1, tk2, tk3, D: gl.constexpr, BITS: gl.constexpr, ROWS: gl.constexpr, LAYOUT: gl.constexpr):
    """Key words ``[ROWS, 4, words]`` (``key_words_layout``) -> the A operand K ``[ROWS, D]`` fp16 in ``LAYOUT``
    (columns in ``query_order``); 16 rows a warp."""
    NWT: gl.constexpr = D * BITS // 128 if BITS != 3 else 4
    if BITS == 3:  # three words (the fourth is not read) -> four groups of 8 indices, as 4-bit words are
        w_k = groups3(w_k)
    # words of keys g and g + 8 side by side
    w_ka, w_kb = gl.split(gl.permute(gl.reshape(w_k, [ROWS // 16, 2, 8, 4, NWT]), (0, 2, 3, 4, 1)))
    if BITS != 2:
        ko = gl.inline_asm_elementwise(LOOKUP4_TWO_KEYS if BITS == 4 else LOOKUP3_TWO_KEYS, "=r," * 8 + "r,r,r,r,r,r", [w_ka, w_kb, tk0, tk1, tk2, tk3],
                                       dtype=(gl.int32,) * 8, is_pure=True, pack=1)
        lo, hi = halves(join_bits(ko, 3))
        # axes (m, g, t, q, key b, r0, r1, e) -> rows (m, key b, g), columns (q, r1, r0, t, e)
        b_k = gl.reshape(gl.permute(gl.join(lo, hi), (0, 4, 1, 3, 6, 5, 2, 7)), [ROWS, D])
    else:
        ko = gl.inline_asm_elementwise(LOOKUP2_TWO_KEYS, "=r," * 16 + "r,r,r,r", [w_ka, w_kb, tk0, tk1],
                                       dtype=(gl.int32,) * 16, is_pure=True, pack=1)
        lo, hi = halves(join_bits(ko, 4))
        # axes (m, g, t, q, key b, p0, p1, p2, e) -> rows (m, key b, g), columns (q, p2, p1, p0, t, e)
        b_k = gl.reshape(gl.permute(gl.join(lo, hi), (0, 4, 1, 3, 7, 6, 5, 2, 8)), [ROWS, D])
    return gl.convert_layout(b_k, LAYOUT, assert_trivial=True)

