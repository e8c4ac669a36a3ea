"""Decode attention over the transform codec's paged cache against the MSE codec and torch SDPA in fp16 (GPU).

One run: runs the transform codec's kernel, cache and generation tests (``tests/ops/test_transform*.py``) compiled on this GPU,
checks ``kvlab.transform.attention.decode_attention`` against its reference at a few thousand tokens (and
refuses to time if that fails), then times one decode step at batch 8 and contexts 8k and 32k for two shapes:

* SmolLM2-135M's layer: 3 KV heads, 9 query heads, head dimension 64, one joint transform over the heads
  (192 numbers per token), as calibrated on the page "A transform codec at three and a half bits";
with keys coded before RoPE (decoded per tile, RoPE applied) and after RoPE (scored in the transformed
space), about 3.3 code bits per element plus the gains; against ``scaled_dot_product_attention`` in fp16 over
an unquantized cache of the same shape (the faster of its two forms: the query group as the query axis, or
``enable_gqa``), and ``kvlab.decode_attention`` over the MSE codec (Hadamard rotation) at K4V4 and K3V3 at the
same shape. Times are medians of
``do_bench`` called from Python and of ``do_bench_cudagraph`` replays. The caches hold random codes with
valid fp16 gains in shuffled blocks of 16 tokens.

    python -m benchmarks.bench_transform --out results     # -> transform_decode.csv / .json
    python -m benchmarks.bench_transform --smoke           # tiny shapes, any device (Triton's interpreter on a CPU)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --smoke on a CPU: before triton is imported
import triton

from kvlab import RoPE
from kvlab.transform import TransformCodec
from kvlab.transform import reference as R
from kvlab.transform.attention import decode_attention

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {  # name: (KV heads, query heads, head dim, groups)
    "SmolLM2-135M layer (joint transform)": (3, 9, 64, 1),
}
BATCH, CONTEXTS, BLOCK = 8, (8192, 32768), 16


def random_codec(width, groups, seed, device):
    """A codec of orthogonal transforms with 3 or 4 bits per component (3.3 on average) and unit-range codebooks."""
    g = torch.Generator().manual_seed(seed)
    dim = width // groups
    q, _ = torch.linalg.qr(torch.randn(groups, dim, dim, generator=g, dtype=torch.float64))
    q = q.float()
    bits = 3 + (torch.rand(groups, dim, generator=g) < 0.3).long()
    books = torch.sort(torch.randn(groups, dim, 16, generator=g), -1).values
    return TransformCodec(torch.randn(groups, dim, generator=g) * 0.1, q.contiguous(), q.transpose(1, 2).contiguous(),
                          bits, books, True).to(device)


def random_cache(codec, batch, context, device, g):
    blocks = batch * context // BLOCK
    cache = torch.randint(0, 256, (blocks, BLOCK, codec.row_bytes), dtype=torch.uint8, device=device, generator=g)
    one = int(torch.tensor(1.0, dtype=torch.float16).view(torch.int16)) & 0xFFFF
    for at, nbytes in zip(codec.group_offsets, codec.group_bytes):
        cache[..., at + nbytes - 2] = one & 0xFF
        cache[..., at + nbytes - 1] = one >> 8
    return cache


def check(device, n: int = 3000) -> float:
    """Relative error of the kernel against the reference at ``n`` tokens, both key modes and both shapes (small
    batch)."""
    worst = 0.0
    g = torch.Generator(device=device).manual_seed(0)
    for heads, q_heads, dim, groups in SHAPES.values():
        kc, vc = random_codec(heads * dim, groups, 1, device), random_codec(heads * dim, groups, 2, device)
        held = -(-(n + 1) // BLOCK) * BLOCK
        k_cache, v_cache = random_cache(kc, 2, held, device, g), random_cache(vc, 2, held, device, g)
        table = torch.randperm(2 * held // BLOCK, device=device, generator=g).int().view(2, -1)
        lens = torch.tensor([n, n * 2 // 5], dtype=torch.int32, device=device)
        q = torch.randn(2, q_heads, dim, device=device, generator=g)
        rope = RoPE(1e4 ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        for r in (None, rope):
            out = decode_attention(q, k_cache, v_cache, table, lens, kc, vc, scale=dim**-0.5, rope=r)
            ref = R.decode_attention(q, k_cache, v_cache, table, lens, kc, vc, scale=dim**-0.5, rope=r)
            assert torch.isfinite(out).all()
            worst = max(worst, float((out - ref).norm() / ref.norm()))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for transform_decode.csv / .json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (any device)")
    ap.add_argument("--tests-log", default=None, help="the log of a compiled run of the tests made just before")
    args = ap.parse_args()
    if args.smoke:
        global SHAPES
        SHAPES = {"tiny joint": (2, 4, 16, 1), "tiny per head": (2, 2, 16, 2)}
        err = check("cuda" if torch.cuda.is_available() else "cpu", n=300)
        print(f"bench_transform: smoke check, relative error {err:.2e}")
        return 0 if err < 5e-3 else 1
    from triton.testing import do_bench

    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from benchmarks.bench_decode import copy_bandwidth
    from benchmarks.common import bench_graph, run_meta, run_tests, write_run
    from kvlab.attention import decode_attention as mse_decode

    tests = run_tests(["tests/ops/test_transform_attention.py", "tests/ops/test_transform.py",
                       "tests/ops/test_transform_cache.py", "tests/ops/test_transform_generate.py"], args.tests_log)
    print("tests:", tests["summary"], flush=True)
    err = check("cuda")
    print(f"check: relative error {err:.2e}", flush=True)
    if err > 5e-3 or not tests["passed"]:
        print("bench_transform: the kernel disagrees with its reference; nothing timed", flush=True)
        return 1
    bandwidth = copy_bandwidth()
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    for shape, (heads, q_heads, dim, groups) in SHAPES.items():
        kc, vc = random_codec(heads * dim, groups, 1, "cuda"), random_codec(heads * dim, groups, 2, "cuda")
        rope = RoPE(1e4 ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        for context in CONTEXTS:
            g = torch.Generator(device="cuda").manual_seed(context)
            q = torch.randn(BATCH, q_heads, dim, device="cuda", generator=g)
            lens = torch.full((BATCH,), context, dtype=torch.int32, device="cuda")
            table = torch.randperm(BATCH * context // BLOCK, device="cuda", generator=g).int().view(BATCH, -1)
            k_cache, v_cache = random_cache(kc, BATCH, context, "cuda", g), random_cache(vc, BATCH, context, "cuda", g)
            point = dict(shape=shape, batch=BATCH, context=context, kv_heads=heads, q_heads=q_heads, head_dim=dim)
            nbytes = BATCH * context * (kc.row_bytes + vc.row_bytes)
            k = torch.randn(BATCH, heads, context, dim, device="cuda", dtype=torch.float16, generator=g)
            v = torch.randn(BATCH, heads, context, dim, device="cuda", dtype=torch.float16, generator=g)
            qh = torch.randn(BATCH, q_heads, 1, dim, device="cuda", dtype=torch.float16, generator=g)
            qm = torch.randn(BATCH, q_heads, dim, device="cuda", dtype=torch.float16, generator=g)
            for mode, r in (("transform, keys before RoPE", rope), ("transform, keys after RoPE", None)):
                fn = lambda r=r: decode_attention(q, k_cache, v_cache, table, lens, kc, vc, scale=dim**-0.5, rope=r)
                ms = do_bench(fn, warmup=10, rep=60, return_mode="median")
                try:  # the reason a capture fails, if it does
                    torch.cuda.synchronize()
                    graph_obj = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph_obj):
                        fn()
                    graph = bench_graph(fn)
                except Exception as e:  # noqa: BLE001
                    print(f"  capture of {mode}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    graph = None
                rows.append(dict(point, method=mode, bits_per_element=round(8 * (kc.row_bytes + vc.row_bytes) / (2 * heads * dim), 3),
                                 ms=ms, graph_ms=graph, bytes=nbytes))
            del k_cache, v_cache
            best = None

            qg = qh.view(BATCH, heads, q_heads // heads, dim)
            for form, fn in (("q group as query axis", lambda: sdpa(qg, k, v)),
                             ("enable_gqa", lambda: sdpa(qh, k, v, enable_gqa=True))):
                ms, graph = do_bench(fn, warmup=10, rep=60, return_mode="median"), bench_graph(fn)
                if best is None or (graph or ms) < (best["graph_ms"] or best["ms"]):
                    best = dict(point, method="SDPA fp16", config=form, bits_per_element=16.0, ms=ms, graph_ms=graph,
                                bytes=2 * k.numel() * 2)
            rows.append(best)
            del k, v
            import kvlab
            from kvlab.layout import MSESlot

            for kb in (4, 3):  # kvlab's fused decode over MSE codes at the same shape
                key_codec = kvlab.MSECodec(dim, kb, rotation="hadamard", seed=0)
                value_codec = kvlab.MSECodec(dim, kb, rotation="hadamard", seed=1)
                layout = MSESlot(dim, kb, kb)
                blocks = BATCH * context // BLOCK
                gm = torch.Generator(device="cuda").manual_seed(kb)
                cache = torch.randint(0, 256, (blocks, BLOCK, heads, layout.slot_bytes), dtype=torch.uint8,
                                      device="cuda", generator=gm)
                one = int(torch.tensor(1.0, dtype=torch.float16).view(torch.int16)) & 0xFFFF
                for at in (layout.key_norm_offset, layout.value_norm_offset):
                    cache[..., at], cache[..., at + 1] = one & 0xFF, one >> 8
                mtable = torch.randperm(blocks, device="cuda", generator=gm).int().view(BATCH, -1)
                fn = lambda: mse_decode(qm, cache, mtable, lens, key_codec, value_codec, scale=dim**-0.5, check=False)
                ms, graph = do_bench(fn, warmup=10, rep=60, return_mode="median"), bench_graph(fn)
                rows.append(dict(point, method=f"MSE K{kb}V{kb} (kvlab.decode_attention)",
                                 bits_per_element=round(8 * layout.slot_bytes / (2 * dim), 3), ms=ms, graph_ms=graph,
                                 bytes=BATCH * context * heads * layout.slot_bytes))
                del cache
            for r in rows[-6:]:
                print(f"{shape[:24]:24s} {context:6d} {r['method'][:40]:40s} {r['ms']:.3f} ms  graph {r['graph_ms']}", flush=True)
            torch.cuda.empty_cache()
    for r in rows:
        t = r["graph_ms"] or r["ms"]
        r["gb_per_s"] = round(r["bytes"] / t / 1e6, 1)
    meta = run_meta("bench_transform", copy_gb_per_s=round(bandwidth, 1), check_rel_err=err, tests=tests["summary"])
    if args.out:
        write_run(args.out, "transform_decode", rows, ["shape", "batch", "context", "kv_heads", "q_heads", "head_dim",
                                                       "method", "config", "bits_per_element", "ms", "graph_ms",
                                                       "bytes", "gb_per_s"], meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
