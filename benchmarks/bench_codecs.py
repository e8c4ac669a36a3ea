"""Throughput of kvlab's codec kernels against the copy-bandwidth roofline (GPU only).

One run: runs the test suite compiled on this GPU, measures the device copy bandwidth, checks the
kernels against the reference at a benchmark-sized sample, times (median of ``do_bench``) MSE store,
MSE load (rotated and model space), affine pack / unpack (token and channel groups) and the mixed
per-head path at 1M-16M vectors of dim 128 for every bit width, times two baseline implementations
(a one-program-per-vector MSE decode and a global-scale affine cache), and writes
``results/codec_kernels.csv`` plus ``results/codec_kernels.json`` (device, versions, date, tests).

Bytes counted per call are the bytes a kernel must move: its inputs read once plus its outputs
written once (for MSE store that is the fp16 K/V read and the slots written; the rotation GEMM's
fp32 intermediate is not counted, so its cost shows up as a lower fraction of bandwidth).

    python benchmarks/bench_codecs.py [--sizes 1,4,16] [--out results] [--no-tests | --tests-log FILE]
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kvlab  # noqa: E402
from benchmarks.baselines import global_scale_affine, one_program_per_vector  # noqa: E402

DIM = 128
HEADS = 8


def bench(fn, reps=200):
    return do_bench(fn, warmup=25, rep=reps, return_mode="median")


def copy_bandwidth(nbytes=4 << 30):
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6  # GB/s, read + write


def run_tests(log=None):
    """Run the test suite here (compiled kernels), or read the log of a run made just before."""
    if log:
        text, returncode = Path(log).read_text(), None
    else:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                              cwd=ROOT, capture_output=True, text=True)
        text, returncode = proc.stdout, proc.returncode
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    summary = lines[-1] if lines else ""
    passed = returncode == 0 if returncode is not None else (" passed" in summary and "failed" not in summary and "error" not in summary)
    return {"passed": passed, "summary": summary, "tail": "\n".join(lines[-30:])}


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,4,16", help="millions of vectors")
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--tests-log", help="pytest -q output of a run on this machine, recorded instead of running the tests")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    torch.manual_seed(0)

    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": dt.date.today().isoformat(),
        "dim": DIM,
        "heads": HEADS,
    }
    if not args.no_tests:
        meta["tests"] = run_tests(args.tests_log)
        print("tests:", meta["tests"]["summary"], flush=True)
    meta["copy_gbps"] = copy_bandwidth()
    print(f"copy bandwidth {meta['copy_gbps']:.0f} GB/s", flush=True)

    rows = []

    def record(kernel, variant, bits, n, ms, nbytes, **extra):
        gbps = nbytes / ms / 1e6
        row = dict(kernel=kernel, variant=variant, bits=bits, n_vectors=n, dim=DIM, time_ms=ms,
                   bytes=nbytes, gbps=gbps, frac_copy=gbps / meta["copy_gbps"], **extra)
        rows.append(row)
        print(f"{kernel:22s} {variant:26s} b={bits!s:5s} n={n/1e6:5.1f}M {ms:8.3f} ms {gbps:7.0f} GB/s "
              f"{100 * row['frac_copy']:5.1f} %", flush=True)

    checks = {}
    for n_m in [int(s) for s in args.sizes.split(",")]:
        n = n_m << 20
        tokens = n // HEADS
        x16 = torch.randn(tokens, HEADS, DIM, device="cuda", dtype=torch.float16)
        v16 = torch.randn(tokens, HEADS, DIM, device="cuda", dtype=torch.float16)

        # ---- MSE store / load in the paged layout
        for bits in (2, 3, 4):
            kc = kvlab.MSECodec(DIM, bits, rotation="haar", seed=0)
            vc = kvlab.MSECodec(DIM, bits, rotation="haar", seed=1)
            layout = kvlab.MSESlot(DIM, bits, bits)
            block_size = 16
            cache = torch.zeros(tokens // block_size, block_size, HEADS, layout.slot_bytes, dtype=torch.uint8, device="cuda")
            slots = torch.randperm(tokens, device="cuda", dtype=torch.int64).to(torch.int32)
            kvlab.store_mse(x16, v16, slots, cache, kc, vc)
            if n_m == 1:
                sample = slots[:4096]
                kref, vref = kvlab.read_slots(cache, sample, layout)
                checks[f"mse_store_b{bits}_bytes_equal"] = bool(
                    torch.equal(kref, kc.encode(x16[:4096])) and torch.equal(vref, vc.encode(v16[:4096]))
                )
            ms = bench(lambda: kvlab.store_mse(x16, v16, slots, cache, kc, vc, check=False))
            record("mse_store", "haar, K+V, GEMM included", bits, n, ms, 2 * n * DIM * 2 + n * layout.slot_bytes)

            for space in ("rotated", "model"):
                out = kvlab.load_mse(cache, slots, vc, part="value", space=space)
                if n_m == 1:
                    ref = vc.decode(kvlab.read_slots(cache, slots[:4096], layout)[1], space=space)
                    checks[f"mse_load_{space}_b{bits}_rel_err"] = rel_err(out[:4096], ref)
                ms = bench(lambda: kvlab.load_mse(cache, slots, vc, part="value", space=space, check=False))
                record("mse_load", f"value, {space} space", bits, n, ms, n * layout.value_code_bytes + n * DIM * 2)

            # baseline: one program per (token, head), same slot layout
            cent = vc.centroids.cuda()
            base = one_program_per_vector.unpack_values_rotated(
                cache, slots, cent, num_tokens=tokens, num_heads=HEADS, head_dim=DIM,
                key_packed_size=layout.key_code_bytes, value_bits=bits)
            if n_m == 1:
                checks[f"baseline_mse_load_b{bits}_rel_err_vs_kvlab"] = rel_err(
                    base.view(tokens, HEADS, DIM)[:4096], kvlab.load_mse(cache, slots[:4096], vc, part="value"))
            ms = bench(lambda: one_program_per_vector.unpack_values_rotated(
                cache, slots, cent, num_tokens=tokens, num_heads=HEADS, head_dim=DIM,
                key_packed_size=layout.key_code_bytes, value_bits=bits))
            record("mse_load", "baseline: one program per vector", bits, n, ms, n * layout.value_code_bytes + n * DIM * 2)
            del cache

        # ---- affine pack / unpack
        flat = x16.view(n, DIM)
        for axis in ("token", "channel"):
            x = flat if axis == "token" else x16.view(tokens, HEADS * DIM)  # channel groups run along tokens
            for bits in (2, 3, 4, 8):
                gs = 32
                codes = kvlab.pack_affine(x, bits, gs, axis)
                if n_m == 1:
                    ref = kvlab.AffineCodec(bits, gs, axis)
                    part = x[:4096]
                    checks[f"affine_{axis}_b{bits}_bytes_equal"] = bool(
                        torch.equal(kvlab.pack_affine(part, bits, gs, axis), ref.encode(part)))
                ms = bench(lambda: kvlab.pack_affine(x, bits, gs, axis, check=False))
                record("affine_pack", f"{axis} groups of {gs}", bits, n, ms, n * DIM * 2 + codes.numel())
                ms = bench(lambda: kvlab.unpack_affine(codes, bits, gs, axis, x.shape[-1]))
                record("affine_unpack", f"{axis} groups of {gs}", bits, n, ms, codes.numel() + n * DIM * 2)
                del codes

        # ---- mixed per-head bits, one launch per layer
        alloc = [4, 8] * (HEADS // 2)
        mixed = kvlab.MixedAffineLayout(alloc, DIM, 32)
        codes = kvlab.pack_affine_mixed(x16, mixed)
        ms = bench(lambda: kvlab.pack_affine_mixed(x16, mixed, check=False))
        record("affine_mixed_pack", "heads " + "/".join(map(str, alloc[:2])) + "...", "mixed", n, ms, n * DIM * 2 + codes.numel())
        ms = bench(lambda: kvlab.unpack_affine_mixed(codes, mixed))
        record("affine_mixed_unpack", "heads " + "/".join(map(str, alloc[:2])) + "...", "mixed", n, ms, codes.numel() + n * DIM * 2)
        del codes

        # baseline: global scale per head, Python loop over heads, store + retrieve of K and V
        if n_m <= 4:
            k4 = x16.permute(1, 0, 2).unsqueeze(0).contiguous()
            cache_b = global_scale_affine.MixedPrecisionKVCacheTriton(alloc)
            ms_store = bench(lambda: cache_b.store(k4, k4), reps=50)
            ms_load = bench(lambda: cache_b.retrieve(), reps=50)
            nbytes_codes = cache_b.memory_bytes()
            record("affine_mixed_pack", "baseline: global scale, per-head loop", "mixed", n, ms_store / 2,
                   n * DIM * 2 + nbytes_codes // 2)
            record("affine_mixed_unpack", "baseline: global scale, per-head loop", "mixed", n, ms_load / 2,
                   nbytes_codes // 2 + n * DIM * 2)
            del cache_b, k4
        del x16, v16, flat
        torch.cuda.empty_cache()

    meta["checks"] = checks
    print(json.dumps(checks, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keys = list(rows[0]) + ["device", "torch", "triton", "date", "copy_gbps"]
    with open(out / "codec_kernels.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({**r, **{k: meta[k] for k in ("device", "torch", "triton", "date", "copy_gbps")}})
    (out / "codec_kernels.json").write_text(json.dumps(meta, indent=1))
    print(f"wrote {out / 'codec_kernels.csv'}")


if __name__ == "__main__":
    main()
