"""Decode attention over the quantized paged cache against torch SDPA in fp16 (GPU only).

One run: optionally runs ``tests/ops/test_attention.py`` and ``tests/ops/test_centered.py`` compiled on this GPU
(or records the log of a run made just before), measures the device copy bandwidth, checks
``decode_attention`` against the reference at a few thousand tokens, with ``--sweep`` times the
launch configurations of ``SWEEP`` at the headline shape (batch 8, context 32k; the fastest split-loop
configuration of each codec is the library's ``launch_defaults``), then times every grid point: batch
1/8/32 x context 1k/4k/16k/32k/128k, 32 query heads, 8 KV heads, head dim 128, for the MSE codec at
K4V4, K3V3, K2V2, the centred-key MSE codec at K4V4 (keys around a RoPE-turned mean: one more score
term per key, ``rope_mean_scores``) and the affine codec (groups of 32) at K4V4 and K8V8, against
``scaled_dot_product_attention`` in fp16 over an unquantized contiguous cache of the same shape, timed
in the same run: at each grid point the fastest of the ways SDPA can run it (``sdpa_variants``: the query group
of a KV head as SDPA's query axis, or one query row per head with ``enable_gqa``, each with torch's choice of
kernel and with each backend forced; no head is copied), named in the CSV's ``config``. The grid
runs what a caller who sets no launch argument gets (for MSE keys and values of 2, 3 or 4 bits the loop of
``kvlab.attention.gluon``, else the split loop at its ``launch_defaults``; the CSV's ``config`` says which),
or with ``--sweep`` the fastest configuration of the sweep.

Timings are medians of ``triton.testing.do_bench`` of the whole entry point (for MSE caches
four kernels: query rotation, loop, merge, output rotation), called from Python as a user would: where the GPU
work is shorter than the host's launch work, that is what is timed. Each grid point is also timed
replayed from a CUDA graph (``do_bench_cudagraph``, as serving engines run decode), which removes the
host's share, and the host time per call is recorded (calls enqueued back to back).

Bytes counted are those each kernel must read: the packed slots of every cached token (``slot_bytes``
per token and KV head) for the quantized cache, the fp16 K and V for SDPA. Those bytes at the run's measured copy
bandwidth are each point's byte floor (``floor_ms``); each row's share of it is ``frac_copy`` for the call from
Python and ``share_of_floor_graph`` for the graph replay. The quantized caches hold
random codes (valid fp16 norms, scales and zeros) in shuffled physical blocks of 16 tokens; grid
points that do not fit in memory are recorded as skipped.

``--splits`` instead times the MSE calls over split counts (``decode_mma_splits.json``: the data behind
``kvlab.attention.gluon.default_splits``).

    python -m benchmarks.bench_decode [--out results] [--no-tests | --tests-log FILE] [--quick] [--sweep] [--splits]
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
from benchmarks.common import bench_graph, run_tests, write_csv
from kvlab.attention.reference import decode_attention_reference
from kvlab.attention import DecodeLaunch, decode_attention
from kvlab.layout import AffineSlot

ROOT = Path(__file__).resolve().parents[1]

HQ, HKV, DIM, BLOCK = 32, 8, 128, 16
BATCHES = (1, 8, 32)
CONTEXTS = (1024, 4096, 16384, 32768, 131072)
HEADLINE = (8, 32768)
CODECS = [("mse", 4, 4), ("mse", 3, 3), ("mse", 2, 2), ("centered", 4, 4), ("affine", 4, 4), ("affine", 8, 8)]
GROUP = 32
TARGETS = {("mse", 4, 4): 3.0, ("mse", 3, 3): 3.5, ("mse", 2, 2): 4.5}
SWEEP = [dict(block_n=64, num_warps=4), dict(block_n=64, num_warps=4, num_stages=1),
         dict(block_n=64, num_warps=4, num_stages=2), dict(block_n=128, num_warps=8),
         dict(block_n=64, num_warps=4, splits_factor=2),
         dict(block_n=64, num_warps=4, num_stages=1, prefetch=True), dict(block_n=32, num_warps=4, num_stages=1, prefetch=True),
         dict(block_n=64, num_warps=4, num_stages=1, max_registers=128), dict(block_n=32, num_warps=4, num_stages=1),
         # the transposed products (keys as MMA rows: warpgroup MMAs on Hopper)
         dict(block_n=64, num_warps=4, keys_as_rows=True), dict(block_n=64, num_warps=4, num_stages=1, keys_as_rows=True),
         dict(block_n=128, num_warps=4, num_stages=1, keys_as_rows=True),
         dict(block_n=128, num_warps=4, num_stages=1, keys_as_rows=True, max_registers=168),
         dict(block_n=128, num_warps=4, num_stages=1, prefetch=True, keys_as_rows=True),
         dict(block_n=64, num_warps=4, num_stages=1, prefetch=True, keys_as_rows=True),
         dict(block_n=128, num_warps=8, num_stages=1, keys_as_rows=True),
         dict(block_n=256, num_warps=8, num_stages=1, keys_as_rows=True),
         # affine: the dequantization in fp16 pairs
         dict(block_n=64, num_warps=4, fast=True), dict(block_n=64, num_warps=4, num_stages=1, fast=True),
         dict(block_n=64, num_warps=4, fast=True, keys_as_rows=True), dict(block_n=128, num_warps=4, num_stages=1, fast=True),
         # one and two warps a program (MMAs of one warp), with more splits to fill the SMs
         dict(block_n=32, num_warps=1, num_stages=1, prefetch=True, splits_factor=4),
         dict(block_n=64, num_warps=1, num_stages=1, prefetch=True, splits_factor=4),
         dict(block_n=64, num_warps=2, num_stages=1, prefetch=True, splits_factor=2),
         dict(block_n=64, num_warps=2, num_stages=1, prefetch=True, keys_as_rows=True, splits_factor=2),
         dict(block_n=64, num_warps=1, num_stages=1, fast=True, splits_factor=4),
         dict(block_n=64, num_warps=2, num_stages=1, fast=True, splits_factor=2),
         dict(mma=True), dict(mma=True, splits_factor=0.5), dict(mma=True, splits_factor=2)]


def bench(fn, rep=60):
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def host_ms(fn, calls=50):
    """Host time per call: ``calls`` calls enqueued back to back, timed without waiting for the GPU."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / calls


def kernel_breakdown(fn, calls=20) -> dict:
    """GPU time per call of each kernel ``fn`` launches (microseconds, torch.profiler), by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_time_total > 0 and e.device_type.name == "CUDA":
            out[e.key[:80]] = out.get(e.key[:80], 0.0) + e.device_time_total / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


SDPA_BACKENDS = ("default", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def sdpa_variants(batch, k, v):
    """The ways to run fp16 decode attention with torch SDPA over K, V ``[batch, HKV, L, DIM]``, by name: the
    query group of a KV head as the query axis (``[batch, HKV, G, DIM]``), or one query row per head with
    ``enable_gqa`` (``[batch, HQ, 1, DIM]``), each with torch's own choice of kernel and with each backend
    forced. The baseline is the fastest of them at each grid point."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    qg = torch.randn(batch, HKV, HQ // HKV, DIM, device="cuda", dtype=torch.float16)
    qh = qg.reshape(batch, HQ, 1, DIM)
    forms = {"q group as query axis": lambda: sdpa(qg, k, v), "enable_gqa": lambda: sdpa(qh, k, v, enable_gqa=True)}
    out = []
    for form, call in forms.items():
        for backend in SDPA_BACKENDS:
            if backend == "default":
                out.append((form, call))
            else:
                def fn(call=call, backend=getattr(SDPBackend, backend)):
                    with sdpa_kernel(backend):
                        return call()
                out.append((f"{form}, {backend.lower()}", fn))
    return out


def copy_bandwidth(nbytes=4 << 30):
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), rep=200)
    del src, dst
    return 2 * nbytes / ms / 1e6  # GB/s, read + write


def codecs(kind, kb, vb):
    if kind == "centered":  # keys around a per-channel mean that turns with RoPE (theta 1e4), unit scale
        from kvlab.calibration import RoPE
        from kvlab.centered import CenteredMSECodec

        g = torch.Generator().manual_seed(2)
        rope = RoPE(1.0 / 10000 ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM))
        kc = CenteredMSECodec(DIM, kb, torch.randn(HKV, DIM, generator=g), torch.rand(HKV, DIM, generator=g) + 0.5,
                              seed=0, rope=rope)
        return kc, kvlab.MSECodec(DIM, vb, seed=1), kvlab.MSESlot(DIM, kb, vb)
    if kind == "mse":
        return kvlab.MSECodec(DIM, kb, seed=0), kvlab.MSECodec(DIM, vb, seed=1), kvlab.MSESlot(DIM, kb, vb)
    return kvlab.AffineCodec(kb, GROUP), kvlab.AffineCodec(vb, GROUP), AffineSlot(DIM, kb, vb, GROUP)


def fp16_bytes(v: float) -> list[int]:
    u = int(torch.tensor(v, dtype=torch.float16).view(torch.int16)) & 0xFFFF
    return [u & 0xFF, u >> 8]


def random_cache(kind, layout, batch, context):
    """Random codes in shuffled blocks; norms (MSE) or scales and zeros (affine) set to valid fp16 values."""
    num_blocks = batch * context // BLOCK
    cache = torch.randint(0, 256, (num_blocks, BLOCK, HKV, layout.slot_bytes), dtype=torch.uint8, device="cuda")
    if kind in ("mse", "centered"):
        for at in (layout.key_norm_offset, layout.value_norm_offset):
            cache[..., at : at + 2] = torch.tensor(fp16_bytes(1.0), dtype=torch.uint8, device="cuda")
    else:
        ng = DIM // GROUP
        for start, bits in ((0, layout.key_bits), (layout.value_offset, layout.value_bits)):
            meta = start + DIM * bits // 8
            cache[..., meta : meta + 2 * ng] = torch.tensor(fp16_bytes(0.01) * ng, dtype=torch.uint8, device="cuda")
            cache[..., meta + 2 * ng : meta + 4 * ng] = torch.tensor(fp16_bytes(-0.1) * ng, dtype=torch.uint8, device="cuda")
    block_table = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, context // BLOCK)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return cache, block_table, seq_lens


def grid_launch(cfg, kind, kb, vb, q, batch, context):
    """(launch arguments, description) of a grid point: ``cfg`` from the sweep, or None for the library's own
    choice (no launch argument), described by the loop and launch it takes."""
    if cfg is not None:
        kw = {k: v for k, v in cfg.items() if k != "splits_factor"}
        base = (kvlab.attention.api._mma_splits(batch, HKV, context, q.device) if cfg.get("mma")
                else kvlab.attention.api._default_splits(batch, HKV, context, kw["block_n"], q.device))
        kw["num_splits"] = max(1, round(base * cfg.get("splits_factor", 1)))
        return kw, " ".join(f"{k}={v}" for k, v in kw.items())
    k_codec, v_codec, _ = codecs(kind, kb, vb)
    centered = k_codec if kind == "centered" else None
    k_codec = k_codec.mse if kind == "centered" else k_codec
    if kvlab.attention.api._takes_mma_loop(q, HKV, kind, centered, k_codec, v_codec, None, ()):
        return {}, f"mma=True num_splits={kvlab.attention.api._mma_splits(batch, HKV, context, q.device)}"
    tuned = kvlab.attention.api.launch_defaults(kind, max(kb, vb))
    splits = kvlab.attention.api._default_splits(batch, HKV, context, tuned["block_n"], q.device)
    return {}, " ".join(f"{k}={v}" for k, v in tuned.items()) + f" num_splits={splits}"


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def correctness_checks(codec_list=CODECS):
    """decode_attention vs the reference at a few thousand tokens, data written by the store kernels: at the
    launch defaults, and with the other choice of each option the defaults set."""
    checks = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [3001, 1777]
    for kind, kb, vb in codec_list:
        kc, vc, layout = codecs(kind, kb, vb)
        max_blocks = -(-max(lens) // BLOCK)
        cache = torch.zeros(len(lens) * max_blocks, BLOCK, HKV, layout.slot_bytes, dtype=torch.uint8, device="cuda")
        block_table = torch.randperm(cache.shape[0], device="cuda").to(torch.int32).view(len(lens), max_blocks)
        for b, n in enumerate(lens):
            t = torch.arange(n, device="cuda")
            slots = block_table[b].long()[t // BLOCK] * BLOCK + t % BLOCK
            key = torch.randn(n, HKV, DIM, device="cuda", generator=g, dtype=torch.float16)
            value = torch.randn(n, HKV, DIM, device="cuda", generator=g, dtype=torch.float16)
            if kind == "mse":
                kvlab.store_mse(key, value, slots, cache, kc, vc)
            elif kind == "centered":
                kvlab.centered.store_centered_mse(key, value, slots, cache, kc, vc, positions=t)
            else:
                kvlab.affine.store_affine(key, value, slots, cache, kc, vc)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(len(lens), HQ, DIM, device="cuda", generator=g, dtype=torch.float16)
        expected = decode_attention_reference(q.float(), cache, block_table, seq_lens, kc, vc)
        checks[f"{kind}_k{kb}v{vb}_rel_err"] = rel_err(decode_attention(q, cache, block_table, seq_lens, kc, vc), expected)
        if kind == "mse" and (kb, vb) in kvlab.attention.gluon.DEFAULT_BITS:  # the default is the loop of kvlab.attention.gluon; the split loop too
            checks[f"{kind}_k{kb}v{vb}_split_loop_rel_err"] = rel_err(
                decode_attention(q, cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(mma=False)), expected)
        if kind == "mse":
            checks[f"{kind}_k{kb}v{vb}_generic_rel_err"] = rel_err(
                decode_attention(q, cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(fast=False)), expected)
        if kind == "affine":
            for fast in (False, True):
                checks[f"{kind}_k{kb}v{vb}_{'fp16_pairs' if fast else 'fp32'}_rel_err"] = rel_err(
                    decode_attention(q, cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(fast=fast)), expected)
        for rows in (False, True):  # the launch defaults pick one of the two products
            checks[f"{kind}_k{kb}v{vb}_keys_as_rows_{rows}_rel_err"] = rel_err(
                decode_attention(q, cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(keys_as_rows=rows)), expected)
    return checks


CSV_KEYS = ["codec", "key_bits", "value_bits", "batch", "context", "num_q_heads", "num_kv_heads", "dim", "status",
            "time_ms", "bytes", "gbps", "frac_copy", "speedup_vs_sdpa", "config",
            "time_graph_ms", "speedup_graph_vs_sdpa", "host_ms", "floor_ms", "share_of_floor_graph"]


def write_results(out: Path, rows, meta, name="decode_attention"):
    """``name``.csv (one row per codec and grid point, with the run's device, versions, date) and ``name``.json."""
    out.mkdir(parents=True, exist_ok=True)
    run = dict(device=meta["device"], torch=meta["torch"], triton=meta["triton"], date=meta["date"],
               copy_gbps=meta["copy_gbps"], tests_passed=meta.get("tests", {}).get("passed"))
    write_csv(out / f"{name}.csv", rows, CSV_KEYS, run)
    (out / f"{name}.json").write_text(json.dumps(meta, indent=1))


def split_sweep(out: Path, meta: dict) -> None:
    """decode_mma_splits.json: at every grid point, MSE K4V4 and K2V2, the whole call replayed from a CUDA graph
    at the default split count (``kvlab.attention.gluon.default_splits``) and at each power of two from 2 to
    1024 (at least 16 keys a split)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = dict(meta, sm_count=sms, points=[])
    for kb, vb in ((4, 4), (2, 2)):
        kc, vc, layout = codecs("mse", kb, vb)
        for b in BATCHES:
            for L in CONTEXTS:
                cache, block_table, seq_lens = random_cache("mse", layout, b, L)
                q = torch.randn(b, HQ, DIM, device="cuda", dtype=torch.float16)
                default = kvlab.attention.gluon.default_splits(b * HKV, L, sms)
                cands = sorted({default} | {1 << i for i in range(1, 11) if (1 << i) <= L // 16})
                ms = {n: bench_graph(lambda: decode_attention(q, cache, block_table, seq_lens, kc, vc, check=False, launch=DecodeLaunch(num_splits=n)))
                      for n in cands}
                if None in ms.values():  # a failed call (a CUDA error stays with the process): keep what was measured
                    res["error"] = f"k{kb}v{vb} batch {b} context {L}: a call failed (see the log)"
                    (out / "decode_mma_splits.json").write_text(json.dumps(res, indent=1))
                    return
                best = min(ms, key=ms.get)
                res["points"].append(dict(key_bits=kb, value_bits=vb, batch=b, context=L, default_splits=default,
                                          time_graph_ms=ms))
                print(f"splits k{kb}v{vb} B={b} L={L}: default {default} {ms[default] * 1e3:.1f} us, "
                      f"best {best} {ms[best] * 1e3:.1f} us", flush=True)
                (out / "decode_mma_splits.json").write_text(json.dumps(res, indent=1))
                del cache, block_table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--tests-log", help="pytest output of tests/ops/test_attention.py and tests/ops/test_centered.py run on this machine just before (several files: comma-separated)")
    ap.add_argument("--no-checks", action="store_true", help="skip the checks against the reference (a timing-only run)")
    ap.add_argument("--quick", action="store_true", help="headline point only (batch 8, context 32k)")
    ap.add_argument("--codecs", help="only these codecs, e.g. mse:4:4,centered:4:4 (default: all of CODECS)")
    ap.add_argument("--sweep", action="store_true",
                    help="time SWEEP's launch configurations at the headline shape first (decode_attention_sweep.csv), "
                         "and time the grid at each codec's fastest; without it the grid runs the library's launch_defaults")
    ap.add_argument("--splits", action="store_true",
                    help="only time the MSE calls over split counts at every grid point (decode_mma_splits.json)")
    args = ap.parse_args()
    codec_list = CODECS
    if args.codecs:
        wanted = {tuple(c.split(":")) for c in args.codecs.split(",")}
        codec_list = [c for c in CODECS if (c[0], str(c[1]), str(c[2])) in wanted]
        if not codec_list:
            ap.error(f"--codecs: none of {args.codecs!r} is in {CODECS}")
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    torch.manual_seed(0)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": dt.date.today().isoformat(), "num_q_heads": HQ, "num_kv_heads": HKV, "dim": DIM,
            "block_size": BLOCK, "affine_group_size": GROUP}
    if not args.no_tests:
        meta["tests"] = run_tests(["tests/ops/test_attention.py", "tests/ops/test_centered.py"], args.tests_log)
        print("tests:", meta["tests"]["summary"], flush=True)
    if args.splits:
        return split_sweep(Path(args.out), meta)
    meta["copy_gbps"] = copy_bandwidth()
    print(f"copy bandwidth {meta['copy_gbps']:.0f} GB/s", flush=True)
    if not args.no_checks:
        meta["checks"] = correctness_checks(codec_list)
        print(json.dumps(meta["checks"], indent=1), flush=True)
    total_mem = torch.cuda.get_device_properties(0).total_memory

    # ---- launch configurations at the headline shape
    best = {c: None for c in codec_list}  # None: no launch argument, the library's own choice
    b, L = HEADLINE
    sweep_rows = []
    for kind, kb, vb in codec_list if args.sweep else []:
        kc, vc, layout = codecs(kind, kb, vb)
        cache, block_table, seq_lens = random_cache(kind, layout, b, L)
        q = torch.randn(b, HQ, DIM, device="cuda", dtype=torch.float16)
        times = {}
        for cfg in SWEEP:
            if cfg.get("prefetch") and kind == "affine":
                continue  # the affine path is not pipelined
            if "fast" in cfg and kind != "affine":
                continue  # the MSE path is fast by default
            if cfg.get("mma") and (kind != "mse" or {kb, vb} - set(kvlab.attention.gluon.BITS)):
                continue  # the loop of kvlab.attention.gluon: 2-, 3- and 4-bit MSE keys and values
            kw, _ = grid_launch(cfg, kind, kb, vb, q, b, L)
            try:
                ms = bench(lambda: decode_attention(q, cache, block_table, seq_lens, kc, vc, check=False, launch=DecodeLaunch(**kw)))
            except Exception as e:  # a configuration that does not compile or fit
                print(f"  {kind} k{kb}v{vb} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            times[tuple(cfg.items())] = ms
            sweep_rows.append(dict(codec=kind, key_bits=kb, value_bits=vb, config=str(cfg), num_splits=kw["num_splits"], time_ms=ms))
            print(f"  sweep {kind} k{kb}v{vb} {cfg} splits={kw['num_splits']}: {ms:.4f} ms", flush=True)
        best[(kind, kb, vb)] = dict(min(times, key=times.get))
        if kind == "mse" and not best[(kind, kb, vb)].get("mma"):  # the generic unpack at the best configuration
            cfg = best[(kind, kb, vb)]
            kw, _ = grid_launch(cfg, kind, kb, vb, q, b, L)
            ms = bench(lambda: decode_attention(q, cache, block_table, seq_lens, kc, vc, check=False, launch=DecodeLaunch(fast=False, **kw)))
            sweep_rows.append(dict(codec=kind, key_bits=kb, value_bits=vb, config=str(cfg) + " fast=False",
                                   num_splits=kw["num_splits"], time_ms=ms))
            print(f"  generic unpack {kind} k{kb}v{vb}: {ms:.4f} ms", flush=True)
        del cache, block_table
    if args.sweep:
        meta["sweep"] = sweep_rows
        write_csv(Path(args.out) / "decode_attention_sweep.csv", sweep_rows,
                  ["codec", "key_bits", "value_bits", "config", "num_splits", "time_ms"],
                  dict(device=meta["device"], torch=meta["torch"], triton=meta["triton"], date=meta["date"], batch=b, context=L))
    meta["launch"] = "fastest of the sweep" if args.sweep else "the library's choice (no launch argument)"
    meta["configs"] = {f"{k[0]}_k{k[1]}v{k[2]}": v or "library default" for k, v in best.items()}
    meta["compiled"] = [dict(key=str(k)[:300], n_regs=v.n_regs, n_spills=v.n_spills)
                        for fn in (kvlab.attention.triton._decode_split_kernel, kvlab.attention.gluon.decode_mma_kernel)
                        for cache_ in fn.device_caches.values() for k, v in cache_[0].items()]
    for c in meta["compiled"]:
        print("  compiled: regs", c["n_regs"], "spills", c["n_spills"], c["key"][:160], flush=True)

    # ---- the grid
    rows = []
    grid = [HEADLINE] if args.quick else [(b, L) for b in BATCHES for L in CONTEXTS]
    for b, L in grid:
        fp16_need = 2 * b * HKV * L * DIM * 2
        base = dict(batch=b, context=L, num_q_heads=HQ, num_kv_heads=HKV, dim=DIM)
        sdpa_ms = sdpa_graph_ms = None
        if 2.5 * fp16_need > total_mem:
            rows.append(dict(base, codec="sdpa_fp16", key_bits=16, value_bits=16, status="skipped: does not fit in memory"))
        else:
            try:
                k = torch.randn(b, HKV, L, DIM, device="cuda", dtype=torch.float16)
                v = torch.randn_like(k)
                times = {}
                for name, fn in sdpa_variants(b, k, v):
                    try:
                        times[name] = (bench(fn), fn)
                    except RuntimeError as e:  # a backend that does not take this form
                        print(f"  SDPA {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                name = min(times, key=lambda n: times[n][0])
                sdpa_ms, fn = times[name]
                sdpa_graph_ms = bench_graph(fn)
                if (b, L) == HEADLINE:
                    meta["sdpa_variants_ms"] = {n: t for n, (t, _) in times.items()}
                print(f"B={b:3d} L={L:6d} SDPA " + ", ".join(f"{n} {t:.4f}" for n, (t, _) in times.items()) + f" ms: {name}",
                      flush=True)
                rows.append(dict(base, codec="sdpa_fp16", key_bits=16, value_bits=16, status="ok", time_ms=sdpa_ms,
                                 time_graph_ms=sdpa_graph_ms, host_ms=host_ms(fn), bytes=fp16_need, config=name))
                del k, v, times, fn
            except torch.cuda.OutOfMemoryError:
                rows.append(dict(base, codec="sdpa_fp16", key_bits=16, value_bits=16, status="skipped: out of memory"))
            torch.cuda.empty_cache()
        for kind, kb, vb in codec_list:
            kc, vc, layout = codecs(kind, kb, vb)
            need = b * L * HKV * layout.slot_bytes
            row = dict(base, codec=kind, key_bits=kb, value_bits=vb)
            if 2.5 * need > total_mem:
                rows.append(dict(row, status="skipped: does not fit in memory"))
                continue
            try:
                cache, block_table, seq_lens = random_cache(kind, layout, b, L)
                q = torch.randn(b, HQ, DIM, device="cuda", dtype=torch.float16)
                kw, config = grid_launch(best[(kind, kb, vb)], kind, kb, vb, q, b, L)
                fn = lambda: decode_attention(q, cache, block_table, seq_lens, kc, vc, check=False, launch=DecodeLaunch(**kw))  # noqa: E731
                ms, graph_ms = bench(fn), bench_graph(fn)
                if (b, L) == HEADLINE:  # where the time of one call goes, kernel by kernel
                    try:
                        meta.setdefault("breakdown_us", {})[f"{kind}_k{kb}v{vb}"] = kernel_breakdown(fn)
                    except Exception as e:  # a profiler that cannot see the device
                        meta.setdefault("breakdown_us", {})[f"{kind}_k{kb}v{vb}"] = {"error": f"{type(e).__name__}: {e}"[:200]}
                rows.append(dict(row, status="ok", time_ms=ms, bytes=need, config=config,
                                 speedup_vs_sdpa=sdpa_ms / ms if sdpa_ms else None, time_graph_ms=graph_ms,
                                 speedup_graph_vs_sdpa=sdpa_graph_ms / graph_ms if sdpa_ms and sdpa_graph_ms and graph_ms else None,
                                 host_ms=host_ms(fn)))
                del cache, block_table, q
            except torch.cuda.OutOfMemoryError:
                rows.append(dict(row, status="skipped: out of memory"))
            torch.cuda.empty_cache()
        for r in rows[-(1 + len(codec_list)):]:
            if r.get("status") == "ok":
                r["gbps"] = r["bytes"] / r["time_ms"] / 1e6
                r["frac_copy"] = r["gbps"] / meta["copy_gbps"]
                r["floor_ms"] = r["bytes"] / meta["copy_gbps"] / 1e6
                if r.get("time_graph_ms"):
                    r["share_of_floor_graph"] = r["floor_ms"] / r["time_graph_ms"]
                sp = r.get("speedup_vs_sdpa")
                spg, gms = r.get("speedup_graph_vs_sdpa"), r.get("time_graph_ms")
                print(f"B={b:3d} L={L:6d} {r['codec']:9s} k{r['key_bits']}v{r['value_bits']} {r['time_ms']:8.4f} ms "
                      f"{100 * r['frac_copy']:5.1f} % copy bw" + (f"  {sp:5.2f}x SDPA" if sp else "")
                      + (f" | graph {gms:8.4f} ms" if gms else "") + (f" {spg:5.2f}x" if spg else "")
                      + f" | host {r['host_ms']:.3f} ms", flush=True)
        write_results(Path(args.out), rows, meta, "decode_attention.partial")  # a run cut short keeps its rows

    headline = {}
    for r in rows:
        if (r["batch"], r["context"]) == HEADLINE and r.get("speedup_vs_sdpa") and r["codec"] == "mse":
            key = (r["codec"], r["key_bits"], r["value_bits"])
            headline[f"mse_k{r['key_bits']}v{r['value_bits']}"] = dict(
                speedup_vs_sdpa=r["speedup_vs_sdpa"], target=TARGETS[key], met=r["speedup_vs_sdpa"] >= TARGETS[key],
                frac_copy=r["frac_copy"], speedup_graph_vs_sdpa=r.get("speedup_graph_vs_sdpa"))
    meta["headline"] = headline
    print(json.dumps(headline, indent=1))

    write_results(Path(args.out), rows, meta)
    print(f"wrote {Path(args.out) / 'decode_attention.csv'}")


if __name__ == "__main__":
    main()
