"""Fingerprints of the device code the GPU benchmarks time, made on any machine (no GPU needed).

Every launch that ``bench_decode`` (its batch x context grid), ``bench_generate`` (the attention of its decode steps,
``DecodeStep``), ``bench_codecs`` (store, load, encode, decode at 1 and 4 M vectors) and ``bench_transform`` (its
decode points) time with the library's defaults is compiled for
an H100/H200 (sm_90) by ``benchmarks.compile_only`` and recorded: the kernel, its grid, its launch options, a
hash of its runtime arguments (scalars' values, tensors' dtypes, shapes and strides) and a hash of its SASS
(``nvdisasm``, with the instructions' encodings, so scheduling too; addresses and the kernel's name left out);
between the launches, the torch operations that do device work (a clamp, a cast, a copy), by name.

Two checkouts with the same fingerprint at a point run the same instructions on the same grid there, so a GPU
timing of one is a timing of the other, on any sm_90 GPU. A change that should leave the kernels alone can be
checked without a GPU; one that changes a kernel names the committed timings (``results/``) to measure again.
One build differs from a GPU's: the merge of ``decode_attention``'s splits picks its tile by the device of its
output, here the CPU's (whole rows), so its fingerprint follows its source and launch, not the GPU's tile.

    python -m benchmarks.kernel_fingerprint --out before.json          # on one checkout
    python -m benchmarks.kernel_fingerprint --against before.json      # on another: exit 1 where a launch differs
    python -m benchmarks.kernel_fingerprint --only decode --quick      # one grid point per codec (seconds)
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # compiled, never interpreted: before triton is imported

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.utils._python_dispatch  # noqa: E402
import triton  # noqa: E402

from benchmarks import compile_only  # noqa: E402
from benchmarks.sass_profile import triton_tool  # noqa: E402

GROUPS = ("decode", "step", "codecs", "transform")
_sass_of: dict[str, tuple[str, int]] = {}


def sass_hash(kernel) -> tuple[str, int]:
    """(hash, instruction count) of a compiled kernel's SASS, its name and the instructions' addresses left out."""
    cubin = kernel.asm["cubin"]
    key = hashlib.sha256(cubin).hexdigest()
    if key not in _sass_of:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "k.cubin"
            path.write_bytes(cubin)
            text = subprocess.run([triton_tool("nvdisasm"), "-c", str(path)], capture_output=True, text=True,
                                  check=True).stdout
        lines = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", ln).replace(kernel.metadata.name, "KERNEL").rstrip()
                 for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("//")]
        _sass_of[key] = (hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16], sum(";" in ln for ln in lines))
    return _sass_of[key]


def _arg(v):
    if isinstance(v, torch.Tensor):
        return [str(v.dtype), list(v.shape), list(v.stride())]
    return v if isinstance(v, (int, float, bool, str, type(None))) else type(v).__name__


# torch operations that launch no device work: allocations and views
_NO_DEVICE_WORK = {"empty", "empty_like", "empty_strided", "view", "_unsafe_view", "reshape", "as_strided", "t",
                   "transpose", "permute", "expand", "slice", "select", "unsqueeze", "squeeze", "detach", "alias",
                   "lift_fresh", "split", "unbind", "chunk", "narrow", "diagonal", "view_as_real", "view_as_complex",
                   "_reshape_alias", "unflatten", "flatten", "resize_", "set_", "is_same_size", "_local_scalar_dense"}


class _TorchOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The torch operations run between the launches (a clamp, a cast, a copy: device work a GPU runs too)."""

    def __init__(self, rec):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.rec.current is not None and name not in _NO_DEVICE_WORK:
            self.rec.current.append(dict(torch=name))
        return func(*args, **(kwargs or {}))


class Recorder:
    """The launches of each point, in order, with the torch operations between them."""

    def __init__(self):
        self.points: dict[str, list[dict]] = {}
        self.current: list[dict] | None = None

    def __call__(self, fn, kernel, grid, args, seconds) -> None:
        if self.current is None:  # a launch outside the points (a step's preparation)
            return
        sass, instructions = sass_hash(kernel)
        md = kernel.metadata
        self.current.append(dict(
            kernel=fn.fn.__qualname__, grid=list(grid) + [1] * (3 - len(grid)),
            options=dict(num_warps=md.num_warps, num_stages=md.num_stages, maxnreg=getattr(md, "maxnreg", None),
                         shared=md.shared),
            args=hashlib.sha256(json.dumps({k: _arg(v) for k, v in args.items()}, default=str).encode()).hexdigest()[:16],
            sass=sass, instructions=instructions))

    def point(self, label: str, call, warm: bool = True) -> None:
        """Record ``call``; with ``warm``, a call made before it fills the caches (device tables, compiled kernels)
        first, so that what is recorded is every later call's work."""
        if warm:
            call()
        self.current = self.points[label] = []
        with _TorchOps(self):
            call()
        print(f"{label}: " + ", ".join(f"{x['kernel']} {x['sass']}" if "kernel" in x else x["torch"]
                                       for x in self.current), flush=True)
        self.current = None


def decode_points(rec: Recorder, quick: bool) -> None:
    from benchmarks import bench_decode as B
    from kvlab.attention import decode_attention

    grid = [B.HEADLINE] if quick else [(b, L) for b in B.BATCHES for L in B.CONTEXTS]
    for kind, kb, vb in B.CODECS:
        kc, vc, layout = B.codecs(kind, kb, vb)
        for b, L in grid:
            blocks = b * L // B.BLOCK
            cache = torch.empty(blocks, B.BLOCK, B.HKV, layout.slot_bytes, dtype=torch.uint8)  # never read
            table = torch.randperm(blocks).to(torch.int32).view(b, L // B.BLOCK)
            lens = torch.full((b,), L, dtype=torch.int32)
            q = torch.randn(b, B.HQ, B.DIM, dtype=torch.float16)
            rec.point(f"decode_attention {kind} k{kb}v{vb} batch {b} context {L}",
                      lambda: decode_attention(q, cache, table, lens, kc, vc, check=False))


def step_points(rec: Recorder, quick: bool) -> None:
    """The attention of ``bench_generate``'s decode steps: a ``DecodeStep`` per format and grid point (its first call,
    which compiles; later calls replay the same kernels), at the benchmark model's attention shape."""
    from transformers import LlamaConfig

    from benchmarks import bench_generate as G
    from benchmarks.bench_decode import BLOCK, DIM, HKV, HQ
    from kvlab import PagedKVCache
    from kvlab.attention.api import DecodeStep

    config = LlamaConfig(num_hidden_layers=1, hidden_size=HQ * DIM, num_attention_heads=HQ, num_key_value_heads=HKV,
                         head_dim=DIM)
    for name, fmt in G.FORMATS.items():
        paged = PagedKVCache(fmt, config=config, batch_size=1, max_length=BLOCK, device="cpu", backend="reference")
        kc, vc = paged.key_codec, paged.value_codec  # the codecs and slot layout a PagedKVCache of the format makes
        for b, context in [(8, 32768)] if quick else G.GRID:
            blocks = b * (context + BLOCK) // BLOCK
            cache = torch.empty(blocks, BLOCK, HKV, paged.slot_bytes, dtype=torch.uint8)
            table = torch.randperm(blocks).to(torch.int32).view(b, -1)
            lens = torch.full((b,), context, dtype=torch.int32)
            q = torch.randn(b, HQ, DIM, dtype=torch.float16)
            step = DecodeStep(q, cache, table, lens, kc, vc)
            rec.point(f"decode step {name} batch {b} context {context}", lambda: step(q), warm=False)  # later: replays


def codec_points(rec: Recorder, quick: bool) -> None:
    import kvlab
    from benchmarks.bench_codecs import DIM, HEADS
    from benchmarks.bench_decode import codecs
    from kvlab.affine import MixedAffineLayout, decode_affine_mixed, encode_affine_mixed, store_affine
    from kvlab.centered import store_centered_mse

    for n_m in (1,) if quick else (1, 4):
        n = n_m << 20
        tokens = n // HEADS
        x = torch.empty(tokens, HEADS, DIM, dtype=torch.float16)
        v = torch.empty(tokens, HEADS, DIM, dtype=torch.float16)
        slots = torch.randperm(tokens).to(torch.int32)
        for rotation in ("haar", "hadamard"):
            for bits in (4,) if quick else (2, 3, 4):
                kc = kvlab.MSECodec(DIM, bits, rotation=rotation, seed=0)
                vc = kvlab.MSECodec(DIM, bits, rotation=rotation, seed=1)
                cache = torch.empty(tokens // 16, 16, HEADS, kvlab.MSESlot(DIM, bits, bits).slot_bytes, dtype=torch.uint8)
                rec.point(f"store_mse {rotation} {bits} bits {n_m}M", lambda: kvlab.store_mse(x, v, slots, cache, kc, vc, check=False))
                for space in ("rotated", "model"):
                    rec.point(f"load_mse {rotation} {space} {bits} bits {n_m}M",
                              lambda: kvlab.load_mse(cache, slots, vc, part="value", space=space, check=False))
        by_head = torch.empty(HEADS, tokens, DIM, dtype=torch.float16)
        for axis in ("token", "channel"):
            for bits in (4,) if quick else (2, 3, 4, 8):
                codes = []
                rec.point(f"encode_affine {axis} {bits} bits {n_m}M", lambda: codes.append(
                    kvlab.encode_affine(x.view(n, DIM) if axis == "token" else by_head, bits, 32, axis, check=False)))
                rec.point(f"decode_affine {axis} {bits} bits {n_m}M", lambda: kvlab.decode_affine(codes[0], bits, 32, axis, DIM))
        mixed, codes = MixedAffineLayout([4, 8] * (HEADS // 2), DIM, 32), []
        rec.point(f"encode_affine_mixed {n_m}M", lambda: codes.append(encode_affine_mixed(x, mixed, check=False)))
        rec.point(f"decode_affine_mixed {n_m}M", lambda: decode_affine_mixed(codes[0], mixed))
        for kind, bits in (("centered", 4), ("affine", 4), ("affine", 8)):
            kc, vc, layout = codecs(kind, bits, bits)
            cache = torch.empty(tokens // 16, 16, HEADS, layout.slot_bytes, dtype=torch.uint8)
            if kind == "centered":
                rec.point(f"store_centered_mse k{bits}v{bits} {n_m}M", lambda: store_centered_mse(
                    x, v, slots, cache, kc, vc, positions=torch.arange(tokens), check=False))
            else:
                rec.point(f"store_affine k{bits}v{bits} {n_m}M", lambda: store_affine(x, v, slots, cache, kc, vc, check=False))


def transform_points(rec: Recorder, quick: bool) -> None:
    from benchmarks import bench_transform as B
    from kvlab import RoPE
    from kvlab.transform.attention import decode_attention

    for shape, (heads, q_heads, dim, groups) in B.SHAPES.items():
        kc, vc = B.random_codec(heads * dim, groups, 1, "cpu"), B.random_codec(heads * dim, groups, 2, "cpu")
        rope = RoPE(1e4 ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        for context in B.CONTEXTS[:1] if quick else B.CONTEXTS:
            q = torch.randn(B.BATCH, q_heads, dim)
            lens = torch.full((B.BATCH,), context, dtype=torch.int32)
            table = torch.randperm(B.BATCH * context // B.BLOCK).int().view(B.BATCH, -1)
            k_cache = torch.zeros(B.BATCH * context // B.BLOCK, B.BLOCK, kc.row_bytes, dtype=torch.uint8)
            v_cache = torch.zeros(B.BATCH * context // B.BLOCK, B.BLOCK, vc.row_bytes, dtype=torch.uint8)
            for mode, r in (("keys before RoPE", rope), ("keys after RoPE", None)):
                rec.point(f"transform decode {shape} context {context} {mode}", lambda: decode_attention(
                    q, k_cache, v_cache, table, lens, kc, vc, scale=dim**-0.5, rope=r))


def compare(old: dict, new: dict) -> list[str]:
    """Lines naming each point whose launches differ (or that one of the two lacks)."""
    out = []
    for label in list(old["points"]) + [p for p in new["points"] if p not in old["points"]]:
        a, b = old["points"].get(label), new["points"].get(label)
        if a is None or b is None:
            out.append(f"{label}: only in the {'new' if a is None else 'old'} fingerprint")
            continue
        names = [[x.get("kernel") or "torch." + x["torch"] for x in p] for p in (a, b)]
        if names[0] != names[1]:
            out.append(f"{label}: launches {', '.join(names[0])} -> {', '.join(names[1])}")
            continue
        for x, y in zip(a, b):
            what = [k for k in ("sass", "grid", "options", "args") if x.get(k) != y.get(k)]
            if what:
                out.append(f"{label}: {x['kernel']} differs in {', '.join(what)}"
                           + (f" ({x['instructions']} -> {y['instructions']} SASS instructions)" if "sass" in what else ""))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated, of {', '.join(GROUPS)}")
    ap.add_argument("--quick", action="store_true", help="one point per codec and kernel (the benchmark's headline)")
    ap.add_argument("--out", help="write the fingerprint here (JSON)")
    ap.add_argument("--against", help="a fingerprint written before: list the launches that differ, exit 1 if any")
    args = ap.parse_args(argv)
    only = [g for g in args.only.split(",") if g]
    if not only or set(only) - set(GROUPS):
        print(f"kernel_fingerprint: --only takes {', '.join(GROUPS)}, got {args.only!r}", file=sys.stderr)
        return 2
    old = None
    if args.against:
        try:
            old = json.loads(Path(args.against).read_text())
            if not isinstance(old, dict) or not isinstance(old.get("points"), dict):
                raise ValueError("no points")
        except (OSError, ValueError) as e:
            print(f"kernel_fingerprint: --against {args.against!r} is not a fingerprint: {e}", file=sys.stderr)
            return 2
    fingerprint = dict(target=f"cuda sm_{compile_only.ARCH}", triton=triton.__version__, only=only, quick=args.quick)
    made = [k for k in fingerprint if old is not None and old.get(k) != fingerprint[k]]
    if made:
        print(f"kernel_fingerprint: {args.against} was made with another " + ", ".join(made) + ": "
              + ", ".join(f"{old.get(k)!r}, here {fingerprint[k]!r}" for k in made), file=sys.stderr)
        return 2
    rec = Recorder()
    compile_only.install(rec)
    for group in only:
        dict(decode=decode_points, step=step_points, codecs=codec_points, transform=transform_points)[group](rec, args.quick)
    fingerprint["points"] = rec.points
    if args.out:
        Path(args.out).write_text(json.dumps(fingerprint, indent=1) + "\n")
    if old is None:
        return 0
    lines = compare(old, fingerprint)
    points = sum(len(v) for v in fingerprint["points"].values())
    print(f"kernel_fingerprint: {len(fingerprint['points'])} points, {points} launches; "
          + (f"{len(lines)} differ from {args.against}:" if lines else f"every launch as in {args.against}"))
    for line in lines:
        print("  " + line)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
