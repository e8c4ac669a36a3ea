"""Inline-PTX codebook lookups shared by the MSE loads (Triton) and the decode loops (Triton, Gluon).

Each builder returns the PTX text of one lookup: packed sign-magnitude codes (``kvlab.layout``) in 32-bit
registers -> fp16 pairs, by byte permutes (``prmt``) of the codebook's byte planes
(``kvlab._kernels.tables.prmt_tables``). ``tests/ptx.py`` emulates the instructions on a CPU.
"""

from __future__ import annotations

__all__ = ["lookup2_ptx", "lookup3_ptx", "lookup4_ptx", "spread3_ptx"]


def lookup4_ptx(word: str, outs, pair_selectors=("0x5140", "0x7362"), tables=("$5", "$6", "$7", "$8")) -> str:
    """PTX block of the 4-bit lookup: the eight 4-bit codes of the 32-bit register ``word`` -> four fp16
    pairs ``outs`` (register names), from the byte planes of the 8 codebook magnitudes in ``tables``
    (low bytes of entries 0-3, 4-7, high bytes 0-3, 4-7).

    A code is sign-magnitude (``kvlab.layout``): its low 3 bits, the magnitude, select by one ``prmt``
    per plane and four codes the low and the high byte; a sign-replicating ``prmt`` of the word (and
    the word shifted by 4) puts each code's top bit, the sign, on its high byte. The last four ``prmt``
    interleave low and high bytes into fp16 pairs: with ``pair_selectors`` ``0x5140`` / ``0x7362``
    output ``j`` holds codes ``2 j, 2 j + 1``; with ``0x6240`` / ``0x7351`` it holds codes ``j'`` and
    ``j' + 2`` (``j' = j + 2 (j // 2)``)."""
    T, (s0, s1) = tables, pair_selectors
    return f"""{{
.reg .b32 m, mh, s, sl, sh, l0, h0, l1, h1;
and.b32 m, {word}, 0x77777777;
shr.b32 mh, m, 16;
prmt.b32 l0, {T[0]}, {T[1]}, m;
prmt.b32 h0, {T[2]}, {T[3]}, m;
prmt.b32 l1, {T[0]}, {T[1]}, mh;
prmt.b32 h1, {T[2]}, {T[3]}, mh;
shl.b32 s, {word}, 4;
prmt.b32 sl, s, {word}, 0xD9C8;
prmt.b32 sh, s, {word}, 0xFBEA;
and.b32 sl, sl, 0x80808080;
or.b32 h0, h0, sl;
and.b32 sh, sh, 0x80808080;
or.b32 h1, h1, sh;
prmt.b32 {outs[0]}, l0, h0, {s0};
prmt.b32 {outs[1]}, l0, h0, {s1};
prmt.b32 {outs[2]}, l1, h1, {s0};
prmt.b32 {outs[3]}, l1, h1, {s1};
}}"""


def spread3_ptx(group: str, dst: str) -> str:
    """PTX block: the eight 3-bit fields in the low 24 bits of ``group`` (the bits above are ignored) into
    the eight nibbles of ``dst``, field ``j`` at bits ``4 j`` (a ``prmt`` selector). Three mask-and-shift
    rounds."""
    return f"""{{
.reg .b32 sa, sb, sx;
and.b32 sa, {group}, 0xFFF;
shl.b32 sb, {group}, 4;
and.b32 sb, sb, 0x0FFF0000;
or.b32 sx, sa, sb;
and.b32 sa, sx, 0x003F003F;
shl.b32 sb, sx, 2;
and.b32 sb, sb, 0x3F003F00;
or.b32 sx, sa, sb;
and.b32 sa, sx, 0x07070707;
shl.b32 sb, sx, 1;
and.b32 sb, sb, 0x70707070;
or.b32 {dst}, sa, sb;
}}
"""


def lookup3_ptx(group: str, outs, pair_selectors=("0x5140", "0x7362"), tables=("$5", "$6", "$7", "$8"),
                spread: bool = True) -> str:
    """PTX block of the 3-bit lookup: the eight 3-bit indices in the low 24 bits of ``group`` (the bits
    above are ignored) -> four fp16 pairs ``outs``, from the byte planes of the 8-entry codebook in
    ``tables`` (low bytes of entries 0-3, 4-7, high bytes 0-3, 4-7): ``spread3_ptx`` puts the indices in
    the nibbles of a ``prmt`` selector (``spread=False``: ``group`` is that selector already), one
    ``prmt`` per plane and four indices picks the low and the high bytes, and four ``prmt`` interleave
    them into fp16 pairs: with ``pair_selectors`` ``0x5140`` / ``0x7362`` output ``j`` holds indices
    ``2 j, 2 j + 1``; with ``0x6240`` / ``0x7351`` it holds indices ``j'`` and ``j' + 2``
    (``j' = j + 2 (j // 2)``)."""
    T, (s0, s1) = tables, pair_selectors
    x = "x" if spread else group
    return ("{\n.reg .b32 x, xh, l0, h0, l1, h1;\n" + (spread3_ptx(group, "x") if spread else "") + f"""shr.b32 xh, {x}, 16;
prmt.b32 l0, {T[0]}, {T[1]}, {x};
prmt.b32 h0, {T[2]}, {T[3]}, {x};
prmt.b32 l1, {T[0]}, {T[1]}, xh;
prmt.b32 h1, {T[2]}, {T[3]}, xh;
prmt.b32 {outs[0]}, l0, h0, {s0};
prmt.b32 {outs[1]}, l0, h0, {s1};
prmt.b32 {outs[2]}, l1, h1, {s0};
prmt.b32 {outs[3]}, l1, h1, {s1};
}}""")


# 2 bit: $0..$7 fp16 pairs of sixteen tile positions; inputs: the word, two table registers
def lookup2_ptx(word: str, outs, tables=("$9", "$10")) -> str:
    """PTX block of the 2-bit lookup: the sixteen 2-bit indices of ``word`` -> eight fp16 pairs ``outs``,
    from the 4-entry fp16 codebook in the two registers ``tables``. Index ``i`` is spread to the
    selector nibbles ``2 i, 2 i + 1`` of its byte (one multiply-add for four indices) and one ``prmt``
    turns two bytes' indices into an fp16 pair: output ``j`` (``j < 4``) holds the indices at bits
    ``2 j`` of bytes 0 and 1, output ``j + 4`` those of bytes 2 and 3."""
    body = "{\n.reg .b32 x, y;\n"
    for j in range(4):
        body += (f"shr.b32 x, {word}, {2 * j};\nand.b32 x, x, 0x03030303;\n" if j else f"and.b32 x, {word}, 0x03030303;\n")
        body += (f"mad.lo.u32 y, x, 0x22, 0x10101010;\nprmt.b32 {outs[j]}, {tables[0]}, {tables[1]}, y;\n"
                 f"shr.b32 y, y, 16;\nprmt.b32 {outs[j + 4]}, {tables[0]}, {tables[1]}, y;\n")
    return body + "}"

