"""Run kvlab's inline PTX under Triton's interpreter, so that the decode kernel's fast paths (byte-permute
centroid lookups, affine dequantization in fp16 pairs, in ``tl.inline_asm_elementwise``) are tested on a
CPU as well.

A small emulator of the PTX instructions kvlab's inline assembly uses, element by element over numpy
uint32 arrays: ``shr shl and or xor not mul.lo mad.lo prmt mov`` on 32-bit registers and
``mul.rn.f16x2 sub.rn.f16x2 fma.rn.f16x2`` on fp16 pairs (in fp32, rounded to fp16: the products are exact, so
``mul`` matches the GPU; ``fma`` and ``sub`` can differ from the GPU's fp16 arithmetic in the last bit,
within the decode tests' tolerance). Anything else raises, so an instruction added to a kernel cannot be
emulated silently wrong. ``install()`` makes the interpreter's ``create_inline_asm`` use it.
"""

from __future__ import annotations

import re

import numpy as np
import triton.language as tl
from triton.runtime import interpreter

U32 = np.uint32


def _prmt(a, b, sel):
    """prmt.b32 (default mode): byte i of the result is byte ``sel[4i+2:4i]`` of ``b:a`` (a the low
    word), or its sign replicated when bit ``4i+3`` of ``sel`` is set."""
    src = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=U32)
    for i in range(4):
        nib = (sel >> U32(4 * i)) & U32(0xF)
        byte = ((src >> (8 * (nib & U32(7))).astype(np.uint64)) & np.uint64(0xFF)).astype(U32)
        byte = np.where(nib & U32(8), np.where(byte & U32(0x80), U32(0xFF), U32(0)), byte)
        out |= byte << U32(8 * i)
    return out


def _halves(x):
    lo = (x & U32(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float32)
    hi = (x >> U32(16)).astype(np.uint16).view(np.float16).astype(np.float32)
    return lo, hi


def _pack(lo, hi):
    lo16 = lo.astype(np.float16).view(np.uint16).astype(U32)
    hi16 = hi.astype(np.float16).view(np.uint16).astype(U32)
    return lo16 | (hi16 << U32(16))


def run(asm: str, constraints: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Outputs (uint32, or uint16 for ``=h``) of ``asm`` applied element-wise to ``inputs`` (uint32)."""
    cons = [c.strip() for c in constraints.split(",")]
    outs = [c for c in cons if c.startswith("=")]
    regs: dict[str, np.ndarray] = {}
    shape = np.broadcast_shapes(*(x.shape for x in inputs))
    for i, x in enumerate(inputs):
        regs[f"${len(outs) + i}"] = np.broadcast_to(x, shape).astype(U32)

    def val(op: str) -> np.ndarray:
        op = op.strip()
        if op in regs:
            return regs[op]
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", op):
            return np.full(shape, int(op, 0) & 0xFFFFFFFF, dtype=U32)
        raise ValueError(f"PTX operand {op!r} read before it is written")

    body = asm.replace("{", " ").replace("}", " ")
    for stmt in (s.strip() for s in body.split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        m = re.match(r"(\S+)\s+(.*)", stmt, re.S)
        op, args = m.group(1), m.group(2)
        ops = [a.strip() for a in args.split(",")]
        if op == "mov.b32" and len(ops) == 3:  # mov.b32 {lo, hi}, x: a register into its two halves
            s = val(ops[2])
            regs[ops[0]], regs[ops[1]] = s & U32(0xFFFF), s >> U32(16)
            continue
        if op == "mov.b32":  # mov.b32 d, x
            regs[ops[0]] = val(ops[1]).copy()
            continue
        d = ops[0]
        x = [val(a) for a in ops[1:]]
        with np.errstate(over="ignore"):
            if op == "shr.b32":
                r = np.where(x[1] >= 32, U32(0), x[0] >> (x[1] & U32(31)))
            elif op == "shl.b32":
                r = np.where(x[1] >= 32, U32(0), x[0] << (x[1] & U32(31)))
            elif op == "and.b32":
                r = x[0] & x[1]
            elif op == "or.b32":
                r = x[0] | x[1]
            elif op == "xor.b32":
                r = x[0] ^ x[1]
            elif op == "not.b32":
                r = ~x[0]
            elif op == "mul.lo.u32":
                r = (x[0].astype(np.uint64) * x[1].astype(np.uint64) & np.uint64(0xFFFFFFFF)).astype(U32)
            elif op == "mad.lo.u32":
                r = ((x[0].astype(np.uint64) * x[1].astype(np.uint64) + x[2].astype(np.uint64)) & np.uint64(0xFFFFFFFF)).astype(U32)
            elif op == "prmt.b32":
                r = _prmt(x[0], x[1], x[2])
            elif op == "mul.rn.f16x2":
                (a0, a1), (b0, b1) = _halves(x[0]), _halves(x[1])
                r = _pack(a0 * b0, a1 * b1)
            elif op == "sub.rn.f16x2":
                (a0, a1), (b0, b1) = _halves(x[0]), _halves(x[1])
                r = _pack(a0 - b0, a1 - b1)
            elif op == "fma.rn.f16x2":
                (a0, a1), (b0, b1), (c0, c1) = _halves(x[0]), _halves(x[1]), _halves(x[2])
                r = _pack(a0 * b0 + c0, a1 * b1 + c1)
            else:
                raise NotImplementedError(f"PTX instruction {op!r} is not emulated (tests/ptx.py)")
        regs[d] = np.asarray(r, dtype=U32)
    results = []
    for i, c in enumerate(outs):
        r = regs[f"${i}"]
        results.append(r.astype(np.uint16) if c == "=h" else r)
    return results


class _Call:
    def __init__(self, handles):
        self.handles = handles

    def get_result(self, i):
        return self.handles[i]


def _create_inline_asm(self, inlineAsm, constraints, values, type, isPure, pack):
    if pack != 1:
        raise NotImplementedError("tests/ptx.py emulates pack=1 only")
    inputs = [v.data.astype(np.int64).astype(U32) if v.data.dtype.kind == "i" else v.data.astype(U32) for v in values]
    raw = run(inlineAsm, constraints, inputs)
    handles = []
    for r, ty in zip(raw, type):
        dt = ty.element_ty if isinstance(ty, tl.block_type) else ty
        np_dt = {tl.int32: np.int32, tl.uint32: np.uint32, tl.float16: np.float16, tl.int16: np.int16,
                 tl.uint16: np.uint16}[dt]
        data = r.astype(np.uint16).view(np_dt) if np.dtype(np_dt).itemsize == 2 else r.view(np_dt)
        handles.append(interpreter.TensorHandle(data, dt))
    return _Call(handles)


_create_inline_asm.emulates_ptx = True


def install() -> None:
    """Let the interpreter run ``tl.inline_asm_elementwise`` through this emulator."""
    interpreter.InterpreterBuilder.create_inline_asm = _create_inline_asm
