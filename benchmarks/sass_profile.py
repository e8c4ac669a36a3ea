"""What the compiler makes of kvlab's kernels on the H200 (sm_90), measured on any machine.

Each kernel is launched once at a benchmark-like shape (dim 128, 8 heads) with its default launch
configuration and ``check=False`` (as the benchmarks time them) under the Triton interpreter, which
records the launch: argument types, which pointers and integers are multiples of 16 (Triton
specialises on that), the compile-time constants and the launch options (``num_warps``, and
``num_stages`` and ``enable_fp_fusion`` where the launcher sets them: the decode launch sets its
stages, the affine encoders turn fusion off). The recorded launches are then compiled ahead of time
for sm_90 with Triton's own ``ptxas`` and disassembled with ``nvdisasm`` (both ship with the triton
wheel), and the SASS is counted.

Per kernel: registers per thread, shared memory per program, SASS instructions per program (a static
count; the codec kernels have no loops but the persistent model-space load's, counted once per tile, and
the decode kernels' split loops are counted once per step),
global loads and stores by width, the bytes the program must move (what ``bench_codecs.py`` and
``bench_decode.py`` count, divided by the programs of the launch), and the issue ceiling: the
bandwidth at which the SMs would issue one warp instruction every clock (4 per SM, 132 SMs, 1.98 GHz).

    python -m benchmarks.sass_profile [--out profile.json] [--only affine,mse,decode]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import inspect
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIM, HEADS = 128, 8
TORCH_TYPES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.float64": "fp64",
               "torch.uint8": "u8", "torch.int8": "i8", "torch.int16": "i16", "torch.int32": "i32", "torch.int64": "i64"}

# sm_90 (H200 SXM), per SM: registers, shared memory, resident warps and thread blocks
SM_REGISTERS, SM_SHARED, SM_WARPS, SM_CTAS = 65536, 227 * 1024, 64, 32
# the whole H200: SMs, boost clock, warp instructions an SM issues per clock (the issue ceiling)
SM_COUNT, CLOCK_GHZ, ISSUE_PER_CLOCK = 132, 1.98, 4
# integer and logic opcodes, which run on the integer (ALU) pipe: half a warp instruction a clock per scheduler
# (integer multiplies and multiply-adds, IMAD, run on the FMA pipe)
INTEGER_OPS = {"PRMT", "LOP3", "SHF", "IADD3", "ISETP", "LEA", "SEL", "VIMNMX", "IMNMX"}


# ----------------------------------------------------------------------------- step 1: record launches


def _record(out: str, only: set[str]) -> None:
    """Run the launchers under the interpreter and write the launches to ``out`` (JSON)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    import triton.runtime.interpreter as interp

    import kvlab

    launches = []
    run = interp.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        kw = dict(kwargs)
        opts = {k: kw.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kw}
        bound = dict(zip(params, args)) | kw
        sig, const, aligned = {}, {}, []
        for i, (name, par) in enumerate(params.items()):
            v = bound.get(name, par.default)
            if "constexpr" in str(par.annotation) or v is None:
                sig[name], const[name] = "constexpr", v
            elif isinstance(v, torch.Tensor):
                sig[name] = "*" + TORCH_TYPES[str(v.dtype)]
                aligned += [i] if v.data_ptr() % 16 == 0 else []
            elif isinstance(v, bool):
                sig[name] = "i1"
            elif isinstance(v, int):
                sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
                aligned += [i] if v % 16 == 0 else []
            elif isinstance(v, float):
                sig[name] = "fp32"
            elif type(v).__name__ == "TensorDescriptor":  # a host-built TMA descriptor (the model-space load's output)
                sig[name] = f"tensordesc<{TORCH_TYPES[str(v.base.dtype)]}[{', '.join(map(str, v.block_shape))}]>"
            else:
                raise TypeError(f"{self.fn.__name__}: argument {name} of type {type(v).__name__}")
        g = grid(bound) if callable(grid) else grid
        launches.append(dict(module=self.fn.__module__, kernel=self.fn.__name__, signature=sig, constants=const,
                             aligned=aligned, options=opts, programs=math.prod(g)))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interp.InterpretedFunction.run = recording_run

    def case(name, bits, call, nbytes=None, per_program=None, compiled=None, options=None):
        """Record the kernel launches of ``call()`` as ``name``: the bytes it must move (``nbytes``, or
        a function of its result), shared by its launches (the MSE store launches keys, then values);
        or, for a loop, the bytes of one step (``per_program``, one program counted). ``compiled``:
        constants the compiled launch takes where the interpreter's differs (the fast decode path);
        ``options``: launch options the launcher sets only when compiled (``maxnreg``)."""
        first = len(launches)
        result = call()
        mine = [r for r in launches[first:] if not r["kernel"].startswith(("_merge", "_rotate_rows"))]  # decode: the loop only
        del launches[first:]
        total = nbytes(result) if callable(nbytes) else nbytes
        for r in mine:
            r.update(case=name, bits=bits)
            r["constants"].update(compiled or {})
            r["options"].update(options or {})
            if per_program is not None:
                r.update(bytes=per_program(r), programs=1)
            else:
                r["bytes"] = total / len(mine)
        launches.extend(mine)
        return result

    g = torch.Generator().manual_seed(0)
    rows = 1024  # vectors (token x head) per launch: enough programs for every launch shape
    x = torch.randn(rows, DIM, generator=g).half()
    if "affine" in only:
        for axis in ("token", "channel"):
            for bits in (2, 3, 4, 8):
                codes = case(f"affine_pack {axis}", bits, lambda: kvlab.encode_affine(x, bits, 32, axis, check=False),
                             lambda codes: x.numel() * 2 + codes.numel())
                case(f"affine_unpack {axis}", bits, lambda: kvlab.decode_affine(codes, bits, 32, axis, DIM),
                     codes.numel() + x.numel() * 2)
    if "mse" in only:
        from kvlab.mse import gluon_load, gluon_store

        kv = x.view(rows // HEADS, HEADS, DIM)
        slots = torch.arange(rows // HEADS)
        for bits in (2, 3, 4):
            kc = kvlab.MSECodec(DIM, bits, rotation="hadamard", seed=1)
            vc = kvlab.MSECodec(DIM, bits, rotation="hadamard", seed=2)
            layout = kvlab.MSESlot(DIM, bits, bits)
            cache = torch.zeros(rows // HEADS // 16, 16, HEADS, layout.slot_bytes, dtype=torch.uint8)
            case("mse_store hadamard, K+V", bits, lambda: kvlab.store_mse(kv, kv, slots, cache, kc, vc, check=False),
                 2 * kv.numel() * 2 + rows * layout.slot_bytes, options=kvlab.mse.api._store_compiled_options(bits, 4, DIM))
            # the store as an H200 runs it, compiled for sm_90: the Gluon kernel of kvlab.mse.gluon_store (the interpreter
            # runs the Triton kernel above, so the launch is written here), the values' launch (codes 2 bytes past a
            # word boundary), one program of gluon_store.rows() rows counted
            head = kvlab.mse.api._store_head(cache, layout.value_offset, layout.value_code_bytes)
            constants = dict(D=DIM, NUM_HEADS=HEADS, BLOCK_SIZE=16, BITS=bits, TUPLE=kvlab.mse.api._square_tuple(bits),
                             OFFSET=layout.value_offset, INDEX_BYTES=layout.value_bytes, HEAD=head, NORM_CORRECTION=True,
                             CHECK=False, ROWS=gluon_store.rows(), LA=None, LB=None, LW=None, LT=None, LTA=None)
            runtime = dict(x_ptr="*fp16", sign_ptr="*i16", mid_ptr="*fp64", tie_ptr="*i32", sq_ptr="*fp64", slot_ptr="*i64",
                           cache_ptr="*u8", norm_ptr="*fp32", scale="fp32", stride_x="i32", num_rows="i32", num_slots="i32",
                           stride_slot="i32", stride_block="i32", stride_pos="i32", stride_head="i32")
            # the tensors, the row stride (DIM), the row and slot counts and the block and position strides are
            # multiples of 16 at the benchmark's shapes (Triton specialises on that); the slot and head strides are not
            launches.append(dict(module="kvlab.mse.gluon_store", kernel="store_kernel", case="mse_store hadamard, K+V (Gluon)",
                                 bits=bits, signature=runtime | {k: "constexpr" for k in constants}, constants=constants,
                                 aligned=[0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 13, 14],
                                 options=gluon_store.options(bits), programs=1, bytes=gluon_store.rows() * (2 * DIM + layout.value_code_bytes)))
            case("mse_load value, rotated", bits, lambda: kvlab.load_mse(cache, slots, vc, part="value", check=False),
                 rows * (layout.value_code_bytes + 2 * DIM))
            # model space, compiled for sm_90: the Gluon kernel of kvlab.mse.gluon_load (the interpreter cannot run it, so
            # the launch that load_mse makes on an H200 is written here); persistent, one tile of TILE_ROWS rows a
            # loop step, counted
            offset, index_bytes = kvlab.mse.api._part_layout(vc, "value", layout.slot_bytes)
            align4 = kvlab.mse.api._word_phase(cache, offset) == 0
            constants = dict(D=DIM, NUM_HEADS=HEADS, BLOCK_SIZE=16, BITS=bits, OFFSET=offset, INDEX_BYTES=index_bytes,
                             ALIGN4=align4, WORDS=None, ACC=None, A=None, OUT=None, SLOTS_AHEAD=gluon_load.SLOTS_AHEAD[align4])
            runtime = dict(cache_ptr="*u8", slot_ptr="*i64", b_ptr="*fp16", out_ptr="*fp16") | {
                name: "i32" for name in gluon_load._RUNTIME[4:]}
            # b and out are 16-byte aligned (the launcher allocates them), the cache and the slots are not specialised on
            launches.append(dict(module="kvlab.mse.gluon_load", kernel="model_load_kernel", case="mse_load value, model space",
                                 bits=bits, signature=runtime | {k: "constexpr" for k in constants}, constants=constants,
                                 aligned=[2, 3], options=dict(num_warps=gluon_load.WARPS, maxnreg=gluon_load.MAXNREG), programs=1,
                                 bytes=gluon_load.TILE_ROWS * (layout.value_code_bytes + 2 * DIM)))
    if "decode" in only:
        from kvlab.attention import DecodeLaunch, decode_attention

        hq, block, context = 32, 16, 1024
        for bits in (4, 3, 2):
            kc, vc = kvlab.MSECodec(DIM, bits, seed=1), kvlab.MSECodec(DIM, bits, seed=2)
            layout = kvlab.MSESlot(DIM, bits, bits)
            cache = torch.zeros(context // block, block, HEADS, layout.slot_bytes, dtype=torch.uint8)
            block_table = torch.arange(context // block, dtype=torch.int32)[None]
            q = torch.randn(1, hq, DIM, generator=g).half()
            seq_lens = torch.tensor([context], dtype=torch.int32)
            # one step of the split loop: BLOCK_N keys of one KV head
            plain = dict(block_n=64, prefetch=False, keys_as_rows=False)
            for name, extra in (("decode split step", plain), ("decode split step, keys as rows", dict(plain, keys_as_rows=True)),
                                ("decode split step, keys as rows, 128 keys", dict(plain, keys_as_rows=True, block_n=128))):
                case(name, bits, lambda: decode_attention(q, cache, block_table, seq_lens, kc, vc, check=False, launch=DecodeLaunch(num_splits=1, **extra)),
                     per_program=lambda r: r["constants"]["BLOCK_N"] * layout.slot_bytes, compiled=dict(FAST=True))
        # the loop of kvlab.attention.gluon (MSE keys and values of 2, 3 or 4 bits, Gluon: the interpreter cannot run
        # it, so the launch that decode_attention makes on a GPU is written here); one trip of its loop is two
        # steps of STEP keys
        from kvlab.attention import gluon

        for bits in (4, 3, 2):
            layout = kvlab.MSESlot(DIM, bits, bits)
            runtime = dict(q_ptr="*fp16", cache_ptr="*u8", block_table_ptr="*i32", seq_lens_ptr="*i32", o_part_ptr="*fp32",
                           ml_part_ptr="*fp32") | {name: "i32" for name in gluon._RUNTIME[6:]}
            constants = dict(HQ=hq, HKV=HEADS, BLOCK_SIZE=block, D=DIM, KEY_NORM_OFFSET=layout.key_norm_offset,
                             VALUE_OFFSET=layout.value_offset, VALUE_NORM_OFFSET=layout.value_norm_offset, BG=8,
                             BITS_K=bits, BITS_V=bits, KEY_WORDS="key_words_layout", VALUE_WORDS="value_words_layout")
            keys = 2 * gluon.STEP
            launches.append(dict(module="kvlab.attention.gluon", kernel="decode_mma_kernel", case="decode mma trip", bits=bits,
                                 signature=runtime | {k: "constexpr" for k in constants}, constants=constants, aligned=[],
                                 options=dict(num_warps=1, maxnreg=gluon.num_registers(8)), programs=1,
                                 bytes=keys * layout.slot_bytes, keys_per_trip=keys))
        # the affine cache (token groups of 32): the fp32 dequantization (its default), and the fp16-pair
        # one (fast=True, which the interpreter cannot run without a PTX emulator: the same launch, marked)
        from kvlab.layout import AffineSlot

        for bits in (4, 8):
            kc = vc = kvlab.AffineCodec(bits, 32)
            layout = AffineSlot(DIM, bits, bits, 32)
            cache = torch.zeros(context // block, block, HEADS, layout.slot_bytes, dtype=torch.uint8)
            case("decode split step, affine", bits,
                 lambda: decode_attention(q, cache, block_table, seq_lens, kc, vc, check=False, launch=DecodeLaunch(num_splits=1, block_n=64, fast=False)),
                 per_program=lambda r: r["constants"]["BLOCK_N"] * layout.slot_bytes)
            plain = launches[-1]
            launches.append(dict(plain, case="decode split step, affine, fp16 pairs", constants=dict(plain["constants"], FAST=True)))
    Path(out).write_text(json.dumps(launches, default=str))


# ----------------------------------------------------------------------------- step 2: compile and count


def triton_tool(name: str) -> str:
    """The path of a CUDA tool that ships with the triton wheel (``ptxas``, ``nvdisasm``, ``cuobjdump``)."""
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _sass(launch: dict) -> tuple[str, str, int]:
    """Compile one recorded launch for sm_90 (with the real, not interpreted, kernel): SASS, resource usage and
    the dynamic shared memory a program is launched with (Triton's, which the resource usage does not count)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = dict(launch["constants"])
    for name, value in (("INTERPRETED", False), ("SPLIT_STEPS", None), ("INTERPRETED_TILES", 0), ("BF16_BY_BITS", False)):
        if name in const:
            const[name] = value  # what the launchers pass when compiled
    module = importlib.import_module(launch["module"])
    fn = getattr(module, launch["kernel"])
    attrs = {(i,): [["tt.divisibility", 16]] for i in launch["aligned"]}
    options = {k: v for k, v in launch["options"].items()
               if k in ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion") and v is not None}
    if getattr(fn, "is_gluon", lambda: False)():  # layouts are recorded by the name of the function that builds them
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

        width = dict(KEY_WORDS="BITS_K", VALUE_WORDS="BITS_V")  # a layout of the words of the key or the value codes
        const = {k: getattr(module, v)(const["D"], const[width[k]]) if isinstance(v, str) and v.endswith("_layout") else v
                 for k, v in const.items()}
        if hasattr(module, "layout_constants"):  # kvlab.mse.gluon_load: its layouts follow from D and BITS
            const.update(module.layout_constants(const["D"], const["BITS"]))
    compiled = triton.compile(ASTSource(fn, launch["signature"], const, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([triton_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([triton_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
    return sass, usage, compiled.metadata.shared


def _opcodes(lines: list[str]) -> collections.Counter:
    ops = collections.Counter()
    for line in lines:
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def _loop_body(sass: str) -> list[str]:
    """The lines of the largest loop (a label and the backward branch to it), or all lines."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\.L_x_(\d+):", line))}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`\(\.L_x_(\d+)\)", line)
        if m and labels.get(m.group(1), i) < i and (best is None or i - labels[m.group(1)] > best[1] - best[0]):
            best = (labels[m.group(1)], i)
    return lines[best[0]:best[1] + 1] if best else lines


def _access_bytes(op: str) -> int:
    """Bytes per thread of a global load/store opcode (LDG.E.128 -> 16, LDG.E -> 4, LDG.E.U8 -> 1)."""
    for suffix, n in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1), (".S8", 1)):
        if suffix in op:
            return n
    return 4


def profile(launch: dict) -> dict:
    sass, usage, dynamic_shared = _sass(launch)
    loop = launch["kernel"] in ("_decode_split_kernel", "decode_mma_kernel", "model_load_kernel")
    ops = _opcodes(_loop_body(sass) if loop else sass.splitlines())
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    shared = int(re.search(r"SHARED:(\d+)", usage).group(1)) + dynamic_shared
    warps = launch["options"].get("num_warps", 4)
    instr = sum(ops.values())
    # occupancy: registers are allocated per warp in units of 256, shared memory per CTA (+1 KiB reserved)
    warp_regs = math.ceil(regs * 32 / 256) * 256
    ctas = min(SM_REGISTERS // (warp_regs * warps), SM_WARPS // warps, SM_CTAS,
               SM_SHARED // (shared + 1024) if shared else SM_CTAS)
    loads = {op: n for op, n in ops.items() if op.startswith("LDG")}
    stores = {op: n for op, n in ops.items() if op.startswith("STG")}
    bytes_per_program = launch["bytes"] / launch["programs"]
    return dict(
        case=launch["case"], bits=launch["bits"], kernel=launch["kernel"], num_warps=warps, registers=regs,
        shared_bytes=shared, warps_per_sm=ctas * warps, instructions=instr,
        shared_stores=sum(n for op, n in ops.items() if op.startswith(("STS", "STSM"))),
        barriers=sum(n for op, n in ops.items() if op.startswith("BAR")),
        shuffles=sum(n for op, n in ops.items() if op.startswith("SHFL")),
        integer_instructions=sum(n for op, n in ops.items() if op.split(".")[0] in INTEGER_OPS),
        global_loads=sum(loads.values()), global_stores=sum(stores.values()),
        widest_load=max(map(_access_bytes, loads), default=0), widest_store=max(map(_access_bytes, stores), default=0),
        narrowest_store=min(map(_access_bytes, stores), default=0),
        bytes_per_program=bytes_per_program,
        # warp instructions an SM must issue per byte the kernel moves, and the bandwidth that allows
        # with an instruction issued every clock
        instructions_per_byte=instr * warps / bytes_per_program,
        issue_ceiling_gbps=ISSUE_PER_CLOCK * SM_COUNT * CLOCK_GHZ / (instr * warps / bytes_per_program),
        per=("step of BLOCK_N keys" if launch["kernel"] == "_decode_split_kernel" else
             "trip of two steps" if launch["kernel"] == "decode_mma_kernel" else "tile of TILE_ROWS rows") if loop
        else "program",
        block_n=launch.get("keys_per_trip") or launch["constants"].get("BLOCK_N"),
    )


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="write the profiles here (JSON)")
    ap.add_argument("--only", default="affine,mse,decode")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        rec = Path(tmp) / "launches.json"
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
        subprocess.run([sys.executable, "-m", "benchmarks.sass_profile", "--record-to", str(rec), "--only", args.only],
                       env=env, cwd=ROOT, check=True)
        launches = json.loads(rec.read_text())
    os.environ.pop("TRITON_INTERPRET", None)
    rows = [profile(launch) for launch in launches]
    import triton

    meta = dict(target="sm_90 (H200)", triton=triton.__version__, dim=DIM, heads=HEADS, sm_count=SM_COUNT,
                clock_ghz=CLOCK_GHZ, issue_per_clock=ISSUE_PER_CLOCK)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(meta, profiles=rows), indent=1))
    for r in rows:
        print(f"{r['case']:26s} b={r['bits']} regs {r['registers']:3d} warps/SM {r['warps_per_sm']:2d} "
              f"instr/{r['per'][:4]} {r['instructions']:5d}  {r['instructions_per_byte']:.3f} warp-instr/B  "
              f"ld {r['widest_load']:2d} B st {r['narrowest_store']}-{r['widest_store']} B  STS {r['shared_stores']} BAR {r['barriers']}")
    return rows


if __name__ == "__main__":
    if "--record-to" in sys.argv:
        i = sys.argv.index("--record-to")
        only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else "affine,mse,decode"
        _record(sys.argv[i + 1], set(only.split(",")))
    else:
        main()
