"""Throughput of kvlab's codec kernels against the copy-bandwidth roofline (GPU only).

One run: runs the test suite compiled on this GPU, measures the device copy bandwidth, checks the
kernels against the reference at a benchmark-sized sample, times (median of ``do_bench``) MSE store,
MSE load (rotated and model space), affine pack / unpack (token and channel groups) and the mixed
per-head path at 1M-16M vectors of dim 128 for every bit width (and, at each size, a device copy of
the fp16 vectors: the roofline at that size, against the 4 GiB copy that every fraction divides by),
times two baseline implementations (a one-program-per-vector MSE decode and a global-scale affine
cache), and writes
``results/codec_kernels.csv`` plus ``results/codec_kernels.json`` (device, versions, date, tests).
``--only affine`` (or ``mse``) times one codec's kernels into ``codec_kernels_affine.csv`` / ``.json``;
``--only mse_load`` times the MSE loads alone (slots written by the reference encoder, the same bytes),
each also replayed from a CUDA graph (``graph_time_ms``: without the host's launch work, which a call
of ~0.1 ms at 1M vectors does not always hide);
``--only mse_store`` the MSE store with the fused Hadamard rotation alone.

Bytes counted per call are the bytes a kernel must move: its inputs read once plus its outputs
written once (for MSE store that is the fp16 K/V read and the slots written; the rotation GEMM's
fp32 intermediate is not counted, so its cost shows up as a lower fraction of bandwidth).

    python -m benchmarks.bench_codecs [--sizes 1,4,16] [--out results] [--no-tests | --tests-log FILE] [--only mse|affine|mse_load|mse_store]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

import kvlab
from benchmarks.common import bench_graph, run_tests, write_csv, write_reference_slots
from benchmarks.baselines import global_scale_affine, one_program_per_vector

ROOT = Path(__file__).resolve().parents[1]

DIM = 128
HEADS = 8
DEV = "cuda"


def bench(fn, reps=200):
    if DEV == "cpu":  # --smoke: one call, to exercise the script without a GPU
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    return do_bench(fn, warmup=25, rep=reps, return_mode="median")


def bench_replayed(fn, reps=200):
    """Median time of ``fn`` replayed from a CUDA graph (``common.bench_graph``): the kernel alone, without
    the host's launch work between calls (which ``bench`` can catch when a call is short)."""
    return bench(fn) if DEV == "cpu" else bench_graph(fn, rep=reps)


# Launch configs tried with --sweep, per kernel (the first of each list is the default).
TUNABLES = {
    "mse_store": [dict(block_rows=None, num_warps=4), dict(block_rows=None, num_warps=1),
                  dict(block_rows=None, num_warps=2), dict(block_rows=None, num_warps=4, piece=32),
                  dict(block_rows=None, num_warps=4, piece=16), dict(block_rows=None, num_warps=8, piece=16)],
    "mse_load": [dict(block_rows=None, num_warps=None), dict(block_rows=None, num_warps=8),
                 dict(block_rows=64, num_warps=4), dict(block_rows=16, num_warps=1), dict(block_rows=16, num_warps=2),
                 # model space: every program loads R^T (32 KB); more rows share it (fewer instructions per byte)
                 dict(block_rows=128, num_warps=4), dict(block_rows=256, num_warps=8)],
    # affine pack: one warp and small tiles by default (bench_launch_configs.py --only affine sweeps more)
    "affine_pack": [dict(block_rows=None, num_warps=None), dict(block_rows=None, num_warps=2),
                    dict(block_rows=None, num_warps=4), dict(block_rows=2, num_warps=1)],
    "affine_mixed_pack": [dict(block_rows=None, num_warps=None), dict(block_rows=16, num_warps=1),
                          dict(block_rows=None, num_warps=2)],
    "default": [dict(block_rows=None, num_warps=None), dict(block_rows=None, num_warps=8)],
}
_best = {}
SWEEP = False


def tuned(key, call):
    """Median time of ``call(kvlab.CodecLaunch(**config))`` at the best launch config for ``key`` (swept on first use)."""
    if key not in _best:
        times = {}
        configs = TUNABLES.get(key[0], TUNABLES["default"])
        sweep = SWEEP is True or (isinstance(SWEEP, list) and key[0] in SWEEP)
        for cfg in (configs if sweep else configs[:1]):
            try:
                times[tuple(cfg.items())] = bench(lambda: call(kvlab.CodecLaunch(**cfg)), reps=60)
            except Exception as e:  # a config the kernel rejects or cannot compile
                print(f"  {key}: {cfg} failed: {type(e).__name__}: {str(e)[:100]}")
        _best[key] = dict(min(times, key=times.get))
    cfg = _best[key]
    return bench(lambda: call(kvlab.CodecLaunch(**cfg))), cfg


# where a call enters a Gluon kernel: (module under kvlab, the function every launch of it goes through)
GLUON_HOOKS = {"load": ("mse.gluon_load", "launch"), "store": ("mse.gluon_store", "spec")}


def _runs_gluon(call, op: str = "load") -> bool:
    """Whether ``call()`` goes through the Gluon kernel of ``op`` (``GLUON_HOOKS``: the model-space load, the
    Hadamard store) rather than the Triton kernel."""
    if DEV != "cuda":
        return False
    import importlib

    module, hook = GLUON_HOOKS[op]
    gluon = importlib.import_module(f"kvlab.{module}")
    original, calls = getattr(gluon, hook), []
    setattr(gluon, hook, lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    try:
        call()
    finally:
        setattr(gluon, hook, original)
    return bool(calls)


def copy_bandwidth(nbytes=4 << 30):
    nbytes = nbytes if DEV == "cuda" else 1 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6  # GB/s, read + write


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,4,16", help="millions (2^20) of vectors")
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--sweep", nargs="?", const="all", default="",
                    help="time every launch config in TUNABLES and keep the best: for all kernels, "
                         "or for a comma-separated list (e.g. mse_store,mse_load)")
    ap.add_argument("--only", choices=("mse", "affine", "mse_load", "mse_store"),
                    help="one codec's kernels (writes codec_kernels_<only>.csv/.json): a run of the other's stays valid; "
                         "mse_load: the MSE loads alone, from slots the reference encoder writes (no store compiled); "
                         "mse_store: the Hadamard MSE store alone")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (Triton interpreter), no timing claims")
    ap.add_argument("--tests-log", help="pytest -q output of a run on this machine, recorded instead of running the tests (several files: comma-separated)")
    args = ap.parse_args()
    global DEV, SWEEP
    SWEEP = args.sweep.split(",") if args.sweep and args.sweep != "all" else bool(args.sweep)
    unit = 1 << 20
    if args.smoke:
        DEV, unit = "cpu", 1 << 8  # 256 vectors: the interpreter runs every program one by one
        args.no_tests = True
    else:
        assert torch.cuda.is_available(), "this benchmark needs a GPU (or --smoke)"
    torch.manual_seed(0)

    meta = {
        "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": dt.date.today().isoformat(),
        "dim": DIM,
        "heads": HEADS,
    }
    if not args.no_tests:
        meta["tests"] = run_tests(["tests"], args.tests_log)
        print("tests:", meta["tests"]["summary"], flush=True)
    meta["copy_gbps"] = copy_bandwidth()
    print(f"copy bandwidth {meta['copy_gbps']:.0f} GB/s", flush=True)

    rows = []
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "codec_kernels" + (f"_{args.only}" if args.only else "")
    partial = out_dir / f"{name}.partial.csv"  # every row as it is measured: a run cut short keeps them
    partial.unlink(missing_ok=True)
    run = {k: meta[k] for k in ("device", "torch", "triton", "date", "copy_gbps")}  # every CSV row also names the run

    def record(kernel, variant, bits, n, ms, nbytes, config=None, graph_ms=None):
        gbps = nbytes / ms / 1e6
        row = dict(kernel=kernel, variant=variant, bits=bits, n_vectors=n, dim=DIM, time_ms=ms,
                   bytes=nbytes, gbps=gbps, frac_copy=gbps / meta["copy_gbps"],
                   config=" ".join(f"{k}={v}" for k, v in (config or {}).items()),
                   # the same call replayed from a CUDA graph (the MSE loads of --only mse_load)
                   graph_time_ms=graph_ms, graph_frac_copy=None if graph_ms is None else nbytes / graph_ms / 1e6 / meta["copy_gbps"])
        rows.append(row)
        write_csv(partial, rows, list(row), run)
        print(f"{kernel:22s} {variant:26s} b={bits!s:5s} n={n/1e6:5.1f}M {ms:8.3f} ms {gbps:7.0f} GB/s "
              f"{100 * row['frac_copy']:5.1f} %" + (f"  graph {graph_ms:8.3f} ms {100 * row['graph_frac_copy']:5.1f} %" if graph_ms else ""),
              flush=True)

    checks = {}
    sizes = [int(s) for s in args.sizes.split(",")]
    # sweep launch configs at the middle size first, then reuse them for the others; without a sweep
    # the sizes run in the order given (the largest first keeps it whole if the run is cut short)
    order = sorted(sizes, key=lambda m: abs(m - 4)) if SWEEP else sizes
    for n_m in order:
        n = n_m * unit
        tokens = n // HEADS
        x16 = torch.randn(tokens, HEADS, DIM, device=DEV, dtype=torch.float16)
        v16 = torch.randn(tokens, HEADS, DIM, device=DEV, dtype=torch.float16)
        # the roofline at this size: a device copy of n fp16 vectors (the bytes most kernels here move)
        y16 = torch.empty_like(x16)
        # (not replayed from a graph: captured, the copy becomes a memcpy node that the copy engines run, not the
        # SMs, at ~65 % of this copy's bandwidth from 4M vectors up; the run of 2026-12-02 recorded that)
        record("copy", "device copy of the fp16 vectors", "", n, bench(lambda: y16.copy_(x16)), 2 * n * DIM * 2)
        del y16

        # ---- MSE store / load in the paged layout
        rotations = ("hadamard",) if args.only == "mse_store" else ("haar", "hadamard")
        for bits, rot in [(b, r) for r in rotations for b in (2, 3, 4)] if args.only in (None, "mse", "mse_load", "mse_store") else []:
            kc = kvlab.MSECodec(DIM, bits, rotation=rot, seed=0)
            vc = kvlab.MSECodec(DIM, bits, rotation=rot, seed=1)
            layout = kvlab.MSESlot(DIM, bits, bits)
            block_size = 16
            cache = torch.zeros(tokens // block_size, block_size, HEADS, layout.slot_bytes, dtype=torch.uint8, device=DEV)
            slots = torch.randperm(tokens, device=DEV, dtype=torch.int64).to(torch.int32)
            if args.only == "mse_load":  # the reference's bytes (the store kernel writes the same)
                write_reference_slots(cache, slots, kc, vc, x16, v16, layout)
            else:
                kvlab.store_mse(x16, v16, slots, cache, kc, vc)
            if n_m == order[0] and args.only != "mse_load":
                sample = slots[:4096]
                kref, vref = kvlab.mse.reference.load_slots(cache, sample, layout)
                checks[f"mse_store_{rot}_b{bits}_bytes_equal"] = bool(
                    torch.equal(kref, kc.encode(x16[:4096])) and torch.equal(vref, vc.encode(v16[:4096]))
                )
            if args.only != "mse_load":
                store = lambda launch: kvlab.store_mse(x16, v16, slots, cache, kc, vc, check=False, launch=launch)  # noqa: E731
                ms, cfg = tuned(("mse_store", rot, bits), store)
                variant = "haar, K+V, GEMM included" if rot == "haar" else "hadamard, K+V, FWHT fused"
                kernel = {"kernel": "gluon" if _runs_gluon(lambda: store(kvlab.CodecLaunch(**cfg)), "store") else "triton"}
                record("mse_store", variant, bits, n, ms, 2 * n * DIM * 2 + n * layout.slot_bytes, cfg | kernel)
            if args.only == "mse_store":
                del cache
                continue

            for space in ("rotated", "model"):
                out = kvlab.load_mse(cache, slots, vc, part="value", space=space)
                if n_m == order[0]:
                    ref = vc.decode(kvlab.mse.reference.load_slots(cache, slots[:4096], layout)[1], space=space)
                    checks[f"mse_load_{rot}_{space}_b{bits}_rel_err"] = rel_err(out[:4096], ref)
                if rot == "hadamard" and space == "rotated":
                    continue  # the rotated-space load does not depend on the rotation: timed with Haar
                load = lambda launch: kvlab.load_mse(cache, slots, vc, part="value", space=space, check=False, launch=launch)  # noqa: E731
                ms, cfg = tuned(("mse_load", rot, space, bits), load)
                # model space: which kernel that launch runs (on Hopper, the Gluon kernel of kvlab.mse.gluon_load), recorded
                best = kvlab.CodecLaunch(**cfg)
                kernel = {"kernel": "gluon" if _runs_gluon(lambda: load(best)) else "triton"} if space == "model" else {}
                record("mse_load", f"value, {space} space" + (", hadamard" if rot == "hadamard" else ""), bits, n, ms,
                       n * layout.value_code_bytes + n * DIM * 2, cfg | kernel,
                       graph_ms=bench_replayed(lambda: load(best)) if args.only == "mse_load" else None)

            if rot == "hadamard":  # the baseline reads the same slots whatever the rotation: timed with Haar
                del cache
                continue
            # baseline: one program per (token, head), same slot layout
            cent = vc.codebook.to(DEV)  # the centroid of each stored code
            base = one_program_per_vector.load_values_rotated(
                cache, slots, cent, num_tokens=tokens, num_heads=HEADS, head_dim=DIM,
                key_packed_size=layout.key_code_bytes, value_bits=bits)
            if n_m == order[0]:
                checks[f"baseline_mse_load_b{bits}_rel_err_vs_kvlab"] = rel_err(
                    base.view(tokens, HEADS, DIM)[:4096], kvlab.load_mse(cache, slots[:4096], vc, part="value"))
            ms = bench(lambda: one_program_per_vector.load_values_rotated(
                cache, slots, cent, num_tokens=tokens, num_heads=HEADS, head_dim=DIM,
                key_packed_size=layout.key_code_bytes, value_bits=bits))
            record("mse_load", "baseline: one program per vector", bits, n, ms, n * layout.value_code_bytes + n * DIM * 2)
            del cache

        if args.only in ("mse", "mse_load", "mse_store"):
            del x16, v16
            continue

        # ---- affine pack / unpack
        flat = x16.view(n, DIM)
        by_head = x16.transpose(0, 1).contiguous()  # [heads, tokens, dim]: channel groups run along tokens
        for axis in ("token", "channel"):
            x = flat if axis == "token" else by_head
            for bits in (2, 3, 4, 8):
                gs = 32
                codes = kvlab.encode_affine(x, bits, gs, axis)
                if n_m == order[0]:
                    ref = kvlab.AffineCodec(bits, gs, axis)
                    part = x[:4096] if axis == "token" else x[:, :4096]
                    checks[f"affine_{axis}_b{bits}_bytes_equal"] = bool(
                        torch.equal(kvlab.encode_affine(part, bits, gs, axis), ref.encode(part)))
                ms, cfg = tuned(("affine_pack", axis, bits), lambda launch: kvlab.encode_affine(x, bits, gs, axis, check=False, launch=launch))
                record("affine_pack", f"{axis} groups of {gs}", bits, n, ms, n * DIM * 2 + codes.numel(), cfg)
                ms, cfg = tuned(("affine_unpack", axis, bits), lambda launch: kvlab.decode_affine(codes, bits, gs, axis, DIM, launch=launch))
                record("affine_unpack", f"{axis} groups of {gs}", bits, n, ms, codes.numel() + n * DIM * 2, cfg)
                del codes

        # ---- mixed per-head bits, one launch per layer
        alloc = [4, 8] * (HEADS // 2)
        mixed = kvlab.affine.MixedAffineLayout(alloc, DIM, 32)
        codes = kvlab.affine.encode_affine_mixed(x16, mixed)
        label = "heads " + "/".join(map(str, alloc[:2])) + "..."
        ms, cfg = tuned("affine_mixed_pack", lambda launch: kvlab.affine.encode_affine_mixed(x16, mixed, check=False, launch=launch))
        record("affine_mixed_pack", label, "mixed", n, ms, n * DIM * 2 + codes.numel(), cfg)
        ms, cfg = tuned("affine_mixed_unpack", lambda launch: kvlab.affine.decode_affine_mixed(codes, mixed, launch=launch))
        record("affine_mixed_unpack", label, "mixed", n, ms, codes.numel() + n * DIM * 2, cfg)
        del codes, by_head

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
    write_csv(out_dir / f"{name}.csv", rows, list(rows[0]), run)
    (out_dir / f"{name}.json").write_text(json.dumps(meta, indent=1))
    partial.unlink()
    print(f"wrote {out_dir / name}.csv")


if __name__ == "__main__":
    main()
