"""Hardware counters of the decode split kernel and of SDPA fp16 at the headline shape (GPU, Nsight Compute).

Run under ``ncu`` with ``--profile-from-start off``: every configuration is compiled and run once
first, then one call of each runs between ``cudaProfilerStart`` and ``cudaProfilerStop``, so ncu sees
one launch of every kernel of one call per configuration (batch 8, context 32k, 32 query and 8 KV
heads, head dim 128, the caches of ``bench_decode.py``). The calls run in the order of ``CONFIGS``
(SDPA first), each after a ``spin_kernel`` launch that marks where it starts; the longest kernel of a
call is its main one::

    ncu --clock-control none --profile-from-start off --section WarpStateStats --section SchedulerStats \\
        --section Occupancy --section SpeedOfLight --metrics $(python -m benchmarks.ncu_decode --metrics) \\
        --csv --page details python -m benchmarks.ncu_decode > ncu.csv
    python -m benchmarks.ncu_decode --summarise ncu.csv --out results/decode_attention_ncu.json

``results/decode_attention_ncu.csv.gz`` is the committed run's ncu output; ``--summarise`` reads it too
(``--run-from`` the committed JSON to keep the run's device, versions and date).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, codec, key bits, value bits, launch arguments beyond the defaults); one call = 8 * 8 * 32768 keys and KV heads
CONFIGS = [
    ("sdpa_fp16", None, 16, 16, {}),
    ("mse_k4v4 defaults", "mse", 4, 4, {}),
    ("mse_k4v4 split loop", "mse", 4, 4, dict(mma=False)),
    ("mse_k4v4 plain loop", "mse", 4, 4, dict(block_n=64, num_stages=1, prefetch=False, keys_as_rows=False)),
    ("mse_k2v2 defaults", "mse", 2, 2, {}),
    ("affine_k4v4 defaults", "affine", 4, 4, {}),
]
# the metrics kept per kernel (ncu's names, as its details page prints them)
KEEP = ("Duration", "L1/TEX Cache Throughput", "L2 Cache Throughput", "Registers Per Thread", "Achieved Occupancy", "Theoretical Occupancy", "Issued Warp Per Scheduler",
        "No Eligible", "Active Warps Per Scheduler", "Eligible Warps Per Scheduler", "Warp Cycles Per Issued Instruction",
        "Memory Throughput", "DRAM Throughput", "Compute (SM) Throughput", "Block Limit Registers", "Block Limit Shared Mem")


# why warps were not issuing: warps stalled for each reason per issued instruction (pass them with --metrics)
STALLS = "smsp__average_warps_issue_stalled_"
STALL_REASONS = ("long_scoreboard", "short_scoreboard", "barrier", "mio_throttle", "lg_throttle", "wait", "math_pipe_throttle",
                 "not_selected", "selected", "dispatch_stall", "no_instruction", "branch_resolving", "membar", "tex_throttle",
                 "drain", "sleeping", "imc_miss", "misc")


# where the L1 pipe's work comes from: wavefronts of shared-memory stores and loads, their bank conflicts,
# global loads through L1 (requests and sectors), ldmatrix instructions
L1_METRICS = ("l1tex__data_pipe_lsu_wavefronts.sum", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
              "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
              "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
              "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
              "smsp__inst_executed_op_ldsm.sum", "smsp__inst_executed_op_shared_st.sum", "smsp__inst_executed_op_shared_ld.sum",
              "smsp__inst_executed.sum", "sm__cycles_elapsed.avg")

# how busy the integer (ALU) and the FMA pipes and the issue slots were, % of their peak over the active cycles
PIPE_METRICS = ("sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
                "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
                "smsp__issue_active.avg.pct_of_peak_sustained_active")


def run() -> None:
    import torch

    from benchmarks.bench_decode import HKV, HQ, DIM, HEADLINE, codecs, random_cache
    from kvlab.attention import DecodeLaunch, decode_attention

    b, L = HEADLINE
    calls = []
    for name, kind, kb, vb, extra in CONFIGS:
        if kind is None:
            k = torch.randn(b, HKV, L, DIM, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            qg = torch.randn(b, HKV, HQ // HKV, DIM, device="cuda", dtype=torch.float16)
            calls.append(lambda qg=qg, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(qg, k, v))
            continue
        kc, vc, layout = codecs(kind, kb, vb)
        cache, block_table, seq_lens = random_cache(kind, layout, b, L)
        q = torch.randn(b, HQ, DIM, device="cuda", dtype=torch.float16)
        calls.append(lambda a=(q, cache, block_table, seq_lens, kc, vc), e=extra: decode_attention(*a, check=False, launch=DecodeLaunch(**e)))
    for fn in calls:  # compile and warm up, outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in calls:
        torch.cuda._sleep(1000)  # a spin_kernel launch: the boundary between two calls in ncu's list
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def read_launches(path: str, metrics: tuple[str, ...]) -> dict[str, dict]:
    """ncu's ``--csv --page details`` output (or its gzip) -> ``{launch id: {"kernel": name, metric:
    "value unit"}}`` in launch order, with the metrics of ``KEEP``, the stalls and ``metrics``."""
    import gzip

    text = (gzip.open(path, "rt") if path.endswith(".gz") else open(path)).read()
    text = text[text.index('"ID"'):]  # ncu prints its own lines before the table
    launches: dict[str, dict] = {}
    for r in csv.DictReader(io.StringIO(text)):
        m = launches.setdefault(r["ID"], {"kernel": r["Kernel Name"][:100]})
        if r["Metric Name"] in KEEP + metrics or r["Metric Name"].startswith(STALLS):
            m[r["Metric Name"]] = f"{r['Metric Value']} {r['Metric Unit']}".strip()
    return launches


def run_info(run_from: str | None) -> dict:
    """Device, versions and date: this machine's, or those of the JSON ``run_from`` (a summary written
    on the GPU that ran ncu)."""
    import torch
    import triton

    run = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__,
           "triton": triton.__version__, "date": dt.date.today().isoformat()}
    return {k: json.loads(Path(run_from).read_text())[k] for k in run} if run_from else run


def summarise(path: str, out: str, run_from: str | None = None) -> None:
    """ncu's ``--csv --page details`` output (or its gzip) -> per configuration, the main kernel's kept
    metrics (device, versions and date: ``run_info``)."""
    launches = read_launches(path, L1_METRICS + PIPE_METRICS)
    # the calls, split at the spin_kernel launches; the main kernel of each is its longest
    calls, scale = [], {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
    for m in launches.values():
        if "spin_kernel" in m["kernel"]:
            calls.append([])
        elif calls:
            calls[-1].append(m)
    if len(calls) != len(CONFIGS) or not all(calls):
        raise SystemExit(f"expected {len(CONFIGS)} calls, found {[len(c) for c in calls]}")

    def duration_us(m):
        value, unit = m.get("Duration", "0 usecond").rsplit(" ", 1)
        return float(value.replace(",", "")) * scale.get(unit, 1.0)

    main = [max(c, key=duration_us) | {"kernels_in_call": len(c)} for c in calls]
    result = run_info(run_from) | {"shape": "batch 8, context 32k, 32/8 heads, dim 128", "ncu": "--clock-control none",
                    "kernels": {name: m for (name, *_), m in zip(CONFIGS, main)}}
    Path(out).write_text(json.dumps(result, indent=1))
    for name, m in result["kernels"].items():
        print(name, json.dumps(m))


def main(run, summarise, metrics: tuple[str, ...], out: str) -> None:
    """The command line of an ncu script: run the profiled calls, print ``--metrics`` (the stalls, then
    ``metrics``) for ncu, or ``--summarise`` ncu's output into ``--out`` (default ``out``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--summarise", help="ncu --csv --page details output to summarise")
    ap.add_argument("--out", default=out)
    ap.add_argument("--run-from", help="take device, versions and date from this summary JSON (written on the GPU)")
    ap.add_argument("--metrics", action="store_true", help="print the metrics for ncu's --metrics")
    args = ap.parse_args()
    if args.metrics:
        print(",".join([f"{STALLS}{r}_per_issue_active.ratio" for r in STALL_REASONS] + list(metrics)))
    elif args.summarise:
        summarise(args.summarise, args.out, args.run_from)
    else:
        run()


if __name__ == "__main__":
    main(run, summarise, L1_METRICS + PIPE_METRICS, str(ROOT / "results" / "decode_attention_ncu.json"))
