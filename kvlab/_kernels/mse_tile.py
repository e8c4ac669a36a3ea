"""Triton device functions that turn MSE code words into fp16 centroid tiles, shared by the MSE load
(``kvlab.mse``) and the split decode loop (``kvlab.attention``): word reads (``load_words``, ``mse_words``)
and the ``prmt`` lookup of a tile (``mse_tile_fast``, in ``kvlab.mse``'s tile order)."""

from __future__ import annotations

import triton
import triton.language as tl

from .lookup import lookup2_ptx, lookup3_ptx, lookup4_ptx

__all__ = ["row_codes", "groups3", "halves", "join_all", "load_words", "mse_tile_fast", "mse_words", "pairs_to_tile"]


# Each block: $0..$3 fp16 pairs of eight consecutive tile positions; inputs: the packed word, then
# four table registers.
_LOOKUP4 = tl.constexpr(lookup4_ptx("$4", ("$0", "$1", "$2", "$3")))


_LOOKUP3 = tl.constexpr(lookup3_ptx("$4", ("$0", "$1", "$2", "$3")))


_LOOKUP2 = tl.constexpr(lookup2_ptx("$8", [f"${j}" for j in range(8)]))


@triton.jit
def halves(x):
    """int32 holding an fp16 pair -> (low fp16, high fp16)."""
    return tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [x], dtype=(tl.float16, tl.float16),
                                     is_pure=True, pack=1)


@triton.jit
def join_all(xs, LEVELS: tl.constexpr):
    """Tuple of ``2**LEVELS`` same-shape tensors -> one tensor ``[..., 2, ..., 2]`` whose flattened
    trailing axes index the tuple in order (join ``x_i`` with ``x_{i + n/2}`` at each level)."""
    for _ in tl.static_range(LEVELS):
        ys = ()
        for i in tl.static_range(len(xs) // 2):
            ys = ys + (tl.join(xs[i], xs[i + len(xs) // 2]),)
        xs = ys
    return xs[0]


@triton.jit
def pairs_to_tile(words, BN: tl.constexpr, D: tl.constexpr, LEVELS: tl.constexpr):
    """Tuple of int32 ``[BN, W]`` fp16-pair words (in tile order) -> fp16 tile ``[BN, D]``."""
    b_lo, b_hi = halves(join_all(words, LEVELS))
    return tl.reshape(tl.join(b_lo, b_hi), [BN, D])


@triton.jit
def load_words(cache_ptr, o_base, o_w, m_n, ALIGN4: tl.constexpr):
    """uint32 words ``[BN, W]``: word ``o_w`` of the code starting at byte ``o_base`` of each row (``ALIGN4``:
    ``o_base`` a multiple of 4; else 2 more than one, as the value code of an MSE slot always is)."""
    # Offsets in words, not bytes, so that the compiler sees a row's words as contiguous and
    # spreads a warp's lanes along the row (coalesced) rather than one lane per row.
    if ALIGN4:
        p = (cache_ptr + o_base).to(tl.pointer_type(tl.uint32))
        return tl.load(p[:, None] + o_w[None, :], mask=m_n[:, None], other=0)
    # The code starts 2 bytes past a word boundary (a value code, after the key's fp16 norm): read the
    # aligned words w and w + 1 around each code word, both as coalesced as the key's, and take the
    # middle 32 bits. (Reading 2-byte halves instead makes the compiler put a warp's lanes on 32 keys.)
    p = (cache_ptr + o_base - 2).to(tl.pointer_type(tl.uint32))[:, None] + o_w[None, :]
    b_a = tl.load(p, mask=m_n[:, None], other=0)
    b_b = tl.load(p + 1, mask=m_n[:, None], other=0)
    return (b_a >> 16) | (b_b << 16)


@triton.jit
def mse_words(cache_ptr, o_base, m_n, BN: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, ALIGN4: tl.constexpr):
    """The code words of ``BN`` rows for ``mse_tile_fast``: three uint32 tensors (4 and 2 bit: the words, then
    two ``[BN, 1]`` placeholders; 3 bit: words ``3 t``, ``3 t + 1``, ``3 t + 2``, ``[BN, D / 32]`` each)."""
    if BITS == 3:
        o_t = tl.arange(0, D // 32)
        return (load_words(cache_ptr, o_base, 3 * o_t, m_n, ALIGN4), load_words(cache_ptr, o_base, 3 * o_t + 1, m_n, ALIGN4),
                load_words(cache_ptr, o_base, 3 * o_t + 2, m_n, ALIGN4))
    else:  # every branch returns: Triton also compiles a return that follows a compile-time branch
        b_none = tl.zeros([BN, 1], dtype=tl.uint32)
        return load_words(cache_ptr, o_base, tl.arange(0, D * BITS // 32), m_n, ALIGN4), b_none, b_none


@triton.jit
def groups3(b_w0, b_w1, b_w2):
    """3 bit: three code words -> their four 24-bit groups of 8 indices (in the low 24 bits; the bits above
    are not masked)."""
    return (b_w0, (b_w0 >> 24) | (b_w1 << 8), (b_w1 >> 16) | (b_w2 << 16), b_w2 >> 8)


@triton.jit
def mse_tile_fast(b_w0, b_w1, b_w2, t0, t1, t2, t3, BN: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Centroid tile ``[BN, D]`` fp16 (tile order), by ``prmt``, from the words of ``mse_words``."""
    if BITS == 4:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(
            _LOOKUP4, "=r,=r,=r,=r,r,r,r,r,r", [b_w0, t0, t1, t2, t3],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
        return pairs_to_tile((o0, o1, o2, o3), BN, D, 2)
    elif BITS == 2:
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            _LOOKUP2, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [b_w0, t0, t1],
            dtype=(tl.int32,) * 8, is_pure=True, pack=1)
        return pairs_to_tile((o0, o1, o2, o3, o4, o5, o6, o7), BN, D, 3)
    else:
        groups = groups3(b_w0, b_w1, b_w2)
        words = ()
        for g in tl.static_range(4):
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                _LOOKUP3, "=r,=r,=r,=r,r,r,r,r,r", [groups[g], t0, t1, t2, t3],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
            words = words + (o0, o1, o2, o3)
        return pairs_to_tile(words, BN, D, 4)


@triton.jit
def row_codes(slot_ptr, o_r, num_rows, num_slots, stride_slot, stride_block, stride_pos, stride_head,
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

