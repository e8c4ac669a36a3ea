"""Decode attention over calibrated transform codes in the fused layout against fp16 SDPA and the MSE codec (GPU).

One run: runs ``tests/ops/test_transform_attention.py`` compiled on this GPU, checks the fused kernel
(``kvlab.transform.fused``, through ``kvlab.transform.attention.decode_attention``) against its pure-torch
reference at a few thousand tokens (and times nothing if that fails), measures the copy bandwidth, then times one
decode step of one layer of the Llama-3-8B shape (8 KV heads, 32 query heads, head dimension 128) at several
batches and contexts:

* the fused layout at 3.5 and 2.5 bits per element (96 components of 4 bits and 32 of 2; 32 and 96), random
  orthogonal transforms and uniform levels (the bytes and the work of a calibrated codec);
* ``scaled_dot_product_attention`` in fp16 over the same context, the faster of its two forms (the query group as
  the query axis, or ``enable_gqa``);
* ``kvlab.decode_attention`` over MSE K4V4 codes (Hadamard rotation).

Every time is the median of CUDA-graph replays (``do_bench_cudagraph``); ``floor_ms`` is the row's bytes at the
measured copy bandwidth, ``share_of_floor`` the floor over the time.

    python -m benchmarks.bench_fused --out results          # -> fused_decode.csv / .json
    python -m benchmarks.bench_fused --smoke                # the check at tiny sizes, any device
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --smoke on a CPU: before triton is imported
import triton

from kvlab.transform import reference as R
from kvlab.transform.attention import decode_attention
from kvlab.transform.fused import fused_layout

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "ops"))
from transform_codecs import fused_codec  # noqa: E402

HEADS, Q_HEADS, DIM, BLOCK = 8, 32, 128, 16
POINTS = [(8, 32768), (1, 131072), (8, 8192), (32, 4096), (1, 4096), (8, 131072)]
FORMATS = {"fused 3.5": (0, 96, 32), "fused 2.5": (0, 32, 96)}


def cache_of(codec, tokens, device, g):
    """A paged cache of random codes (any code is a valid code of the fused layout)."""
    return torch.randint(0, 256, (tokens // BLOCK, BLOCK, codec.row_bytes), dtype=torch.uint8, device=device,
                         generator=g)


def check(device, heads=HEADS, q_heads=Q_HEADS, dim=DIM, n=3000) -> float:
    """Largest relative error of the fused kernel against the reference, both formats, two sequences."""
    worst = 0.0
    g = torch.Generator(device=device).manual_seed(0)
    for counts in FORMATS.values():
        if sum(counts) > dim:
            counts = (0, 0, dim)
        kc, vc = (fused_codec(heads, dim, counts, s).to(device) for s in (1, 2))
        assert fused_layout(kc) is not None
        tokens = 2 * (n // BLOCK + 1) * BLOCK
        k_cache, v_cache = cache_of(kc, tokens, device, g), cache_of(vc, tokens, device, g)
        table = torch.randperm(tokens // BLOCK, device=device, generator=g).int().view(2, -1)
        lens = torch.tensor([n, n // 3], dtype=torch.int32, device=device)
        q = torch.randn(2, q_heads, dim, device=device, generator=g)
        out = decode_attention(q, k_cache, v_cache, table, lens, kc, vc, scale=dim**-0.5)
        ref = R.decode_attention(q, k_cache, v_cache, table, lens, kc, vc, scale=dim**-0.5)
        assert torch.isfinite(out).all()
        worst = max(worst, float((out - ref).norm() / ref.norm()))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for fused_decode.csv / .json")
    ap.add_argument("--smoke", action="store_true", help="the check at tiny sizes, no timing (any device)")
    ap.add_argument("--tests-log", default=None, help="the log of a compiled run of the tests made just before")
    args = ap.parse_args()
    if args.smoke:
        err = check("cuda" if torch.cuda.is_available() else "cpu", heads=2, q_heads=4, dim=64, n=300)
        print(f"bench_fused: smoke check, relative error {err:.2e}")
        return 0 if err < 5e-3 else 1
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import kvlab
    from benchmarks.bench_decode import copy_bandwidth
    from benchmarks.common import bench_graph, run_meta, run_tests, write_run
    from kvlab.layout import MSESlot

    tests = run_tests(["tests/ops/test_transform_attention.py"], args.tests_log)
    print("tests:", tests["summary"], flush=True)
    err = check("cuda")
    print(f"check: relative error {err:.2e}", flush=True)
    if err > 5e-3 or not tests["passed"]:
        print("bench_fused: the kernel disagrees with its reference; nothing timed", flush=True)
        return 1
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth:.0f} GB/s", flush=True)
    rows = []
    for batch, context in POINTS:
        g = torch.Generator(device="cuda").manual_seed(context + batch)
        point = dict(batch=batch, context=context, kv_heads=HEADS, q_heads=Q_HEADS, head_dim=DIM)
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        tokens = batch * context
        table = torch.randperm(tokens // BLOCK, device="cuda", generator=g).int().view(batch, -1)
        q = torch.randn(batch, Q_HEADS, DIM, device="cuda", generator=g)
        for name, counts in FORMATS.items():
            kc, vc = (fused_codec(HEADS, DIM, counts, s).to("cuda") for s in (1, 2))
            k_cache, v_cache = cache_of(kc, tokens, "cuda", g), cache_of(vc, tokens, "cuda", g)
            fn = lambda: decode_attention(q, k_cache, v_cache, table, lens, kc, vc, scale=DIM**-0.5, check=False)
            nbytes = tokens * (kc.row_bytes + vc.row_bytes)
            rows.append(dict(point, method=name, bits_per_element=8 * (kc.row_bytes + vc.row_bytes) / (2 * HEADS * DIM),
                             ms=bench_graph(fn), bytes=nbytes))
            del k_cache, v_cache
        k = torch.randn(batch, HEADS, context, DIM, device="cuda", dtype=torch.float16, generator=g)
        v = torch.randn_like(k)
        qh = q.half().view(batch, Q_HEADS, 1, DIM)
        qg = qh.view(batch, HEADS, Q_HEADS // HEADS, DIM)
        best = None
        for form, fn in (("q group as query axis", lambda: sdpa(qg, k, v)),
                         ("enable_gqa", lambda: sdpa(qh, k, v, enable_gqa=True))):
            ms = bench_graph(fn)
            if ms is not None and (best is None or ms < best["ms"]):
                best = dict(point, method="SDPA fp16", config=form, bits_per_element=16.0, ms=ms,
                            bytes=2 * k.numel() * 2)
        rows.append(best)
        del k, v
        key_codec = kvlab.MSECodec(DIM, 4, rotation="hadamard", seed=0)
        value_codec = kvlab.MSECodec(DIM, 4, rotation="hadamard", seed=1)
        layout = MSESlot(DIM, 4, 4)
        cache = torch.randint(0, 256, (tokens // BLOCK, BLOCK, HEADS, layout.slot_bytes), dtype=torch.uint8,
                              device="cuda", generator=g)
        one = int(torch.tensor(1.0, dtype=torch.float16).view(torch.int16)) & 0xFFFF
        for at in (layout.key_norm_offset, layout.value_norm_offset):
            cache[..., at], cache[..., at + 1] = one & 0xFF, one >> 8
        qm = q.half()
        fn = lambda: kvlab.decode_attention(qm, cache, table, lens, key_codec, value_codec, scale=DIM**-0.5,
                                            check=False)
        rows.append(dict(point, method="MSE K4V4 (kvlab.decode_attention)",
                         bits_per_element=8 * layout.slot_bytes / (2 * DIM), ms=bench_graph(fn),
                         bytes=tokens * HEADS * layout.slot_bytes))
        del cache
        torch.cuda.empty_cache()
        sdpa_ms = best["ms"]
        for r in rows[-4:]:
            r["floor_ms"] = r["bytes"] / bandwidth / 1e6
            r["share_of_floor"] = r["floor_ms"] / r["ms"]
            r["speedup_vs_sdpa"] = sdpa_ms / r["ms"]
            print(f"B={batch:2d} ctx={context:6d} {r['method'][:34]:34s} {r['ms']:.4f} ms  floor {r['floor_ms']:.4f}  "
                  f"{100 * r['share_of_floor']:.0f} %  {r['speedup_vs_sdpa']:.2f}x SDPA", flush=True)
    meta = run_meta("bench_fused", copy_gb_per_s=round(bandwidth, 1), check_rel_err=err, tests=tests["summary"])
    if args.out:
        write_run(args.out, "fused_decode", rows, ["batch", "context", "kv_heads", "q_heads", "head_dim", "method",
                                                   "config", "bits_per_element", "ms", "floor_ms", "share_of_floor",
                                                   "speedup_vs_sdpa", "bytes"], meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
