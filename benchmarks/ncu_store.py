"""Hardware counters of the MSE store with the Hadamard rotation (GPU, Nsight Compute).

Run under ``ncu`` with ``--profile-from-start off``: the store is compiled and run once first, then
one call (two launches: the keys, the values) runs between ``cudaProfilerStart`` and
``cudaProfilerStop``, at 4M vectors of dim 128 in 8 heads, fp16 input, 4-bit keys and values::

    ncu --clock-control none --profile-from-start off --section WarpStateStats --section SchedulerStats \\
        --section Occupancy --section SpeedOfLight --metrics $(python -m benchmarks.ncu_store --metrics) \\
        --csv --page details python -m benchmarks.ncu_store > ncu.csv
    python -m benchmarks.ncu_store --summarise ncu.csv --out results/codec_store_ncu.json

``results/codec_store_ncu.csv.gz`` is the committed run's ncu output (the Triton kernel, before the Gluon kernel of
``kvlab.mse.gluon_store`` ran by default), ``results/codec_store_ncu_gluon.csv.gz`` the Gluon kernel's; ``--summarise``
reads them too (``--run-from`` a JSON written on that GPU keeps its device and versions).
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.ncu_decode import main, read_launches, run_info

ROOT = Path(__file__).resolve().parents[1]

DIM, HEADS, BITS, VECTORS = 128, 8, 4, 4 << 20
# pipes' use (% of peak over the active cycles), issue slots, L1 traffic, instructions
METRICS = ("sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
           "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
           "sm__pipe_fp64_cycles_active.avg.pct_of_peak_sustained_active",
           "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",
           "smsp__issue_active.avg.pct_of_peak_sustained_active",
           "l1tex__data_pipe_lsu_wavefronts.sum", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
           "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
           "smsp__inst_executed.sum", "l1tex__throughput.avg.pct_of_peak_sustained_active")


def run() -> None:
    import torch

    import kvlab

    tokens = VECTORS // HEADS
    key = torch.randn(tokens, HEADS, DIM, device="cuda", dtype=torch.float16)
    value = torch.randn_like(key)
    kc = kvlab.MSECodec(DIM, BITS, rotation="hadamard", seed=0)
    vc = kvlab.MSECodec(DIM, BITS, rotation="hadamard", seed=1)
    layout = kvlab.MSESlot(DIM, BITS, BITS)
    cache = torch.zeros(tokens // 16, 16, HEADS, layout.slot_bytes, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(tokens, device="cuda", dtype=torch.int64).to(torch.int32)
    kvlab.store_mse(key, value, slots, cache, kc, vc, check=False)  # compile, outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    kvlab.store_mse(key, value, slots, cache, kc, vc, check=False)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def summarise(path: str, out: str, run_from: str | None = None) -> None:
    """ncu's ``--csv --page details`` output (or its gzip) -> the kept metrics of each store launch."""
    # the Triton kernel (store_mse_kernel) or, on a CUDA GPU by default, the Gluon kernel of kvlab.mse.gluon_store (store_kernel)
    launches = [m for m in read_launches(path, METRICS).values() if m["kernel"].lstrip("_") in ("store_mse_kernel", "store_kernel")]
    if len(launches) != 2:
        raise SystemExit(f"expected the two launches of one store (keys, values), found {len(launches)}")
    shape = f"{VECTORS >> 20}M vectors of dim {DIM} in {HEADS} heads, fp16, {BITS}-bit keys and values, Hadamard rotation"
    result = run_info(run_from) | {"shape": shape, "ncu": "--clock-control none", "launches": launches}
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    for m in launches:
        print(json.dumps(m))


if __name__ == "__main__":
    main(run, summarise, METRICS, str(ROOT / "results" / "codec_store_ncu.json"))
