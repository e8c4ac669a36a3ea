"""DRAM traffic of the MSE loads against the bytes they are counted as moving (GPU, Nsight Compute).

A load of one part (the keys' or the values' codes) reads half of every slot it touches, and the two
halves share sectors: this measures how many bytes the loads really fetch from DRAM. Run under ``ncu``
with ``--profile-from-start off``: every load is compiled and run once first, then one call of each
(``CONFIGS``, for 2-, 3- and 4-bit keys and values) runs between ``cudaProfilerStart`` and
``cudaProfilerStop``, at 4M vectors of dim 128 in 8 heads, slots shuffled as in ``bench_codecs.py``::

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --metrics $(python -m benchmarks.ncu_load --metrics) --csv --page details \\
        python -m benchmarks.ncu_load > ncu.csv
    python -m benchmarks.ncu_load --summarise ncu.csv --out results/codec_load_ncu.json

``results/codec_load_ncu.csv.gz`` is the committed run's ncu output; ``--summarise`` reads it too
(``--run-from`` a JSON written on that GPU keeps its device and versions).
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.ncu_decode import main, read_launches, run_info

ROOT = Path(__file__).resolve().parents[1]

DIM, HEADS, VECTORS, BITS = 128, 8, 4 << 20, (2, 3, 4)
CONFIGS = [("value", "rotated"), ("key", "rotated"), ("value", "model")]  # (part, space), in launch order per width
# bytes DRAM delivered and took, sectors L2 served to and took from the SMs
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sectors_srcunit_tex_op_read.sum",
           "lts__t_sectors_srcunit_tex_op_write.sum")
UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "sector": 1}


def _layout(bits: int):
    import kvlab

    return kvlab.MSESlot(DIM, bits, bits)


def run() -> None:
    import torch

    import kvlab
    from benchmarks.common import write_reference_slots

    tokens = VECTORS // HEADS
    x = torch.randn(tokens, HEADS, DIM, device="cuda", dtype=torch.float16)
    for bits in BITS:
        kc = kvlab.MSECodec(DIM, bits, rotation="hadamard", seed=0)
        vc = kvlab.MSECodec(DIM, bits, rotation="hadamard", seed=1)
        layout = _layout(bits)
        cache = torch.zeros(tokens // 16, 16, HEADS, layout.slot_bytes, dtype=torch.uint8, device="cuda")
        slots = torch.randperm(tokens, device="cuda", dtype=torch.int64).to(torch.int32)
        write_reference_slots(cache, slots, kc, vc, x, x, layout)
        calls = [lambda p=part, s=space: kvlab.load_mse(cache, slots, kc if p == "key" else vc, part=p, space=s, check=False)
                 for part, space in CONFIGS]
        for call in calls:  # compile, outside the profiled range
            call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for call in calls:
            call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        del cache


def _number(text: str) -> float:
    value, unit = text.rsplit(" ", 1) if " " in text else (text, "")
    return float(value.replace(",", "")) * UNITS.get(unit, 1)


def summarise(path: str, out: str, run_from: str | None = None) -> None:
    """ncu's ``--csv --page details`` output (or its gzip) -> per load: the bytes counted (codes read,
    fp16 vectors written), the bytes DRAM read and wrote, and their ratios."""
    launches = [m for m in read_launches(path, METRICS).values() if "load_mse_kernel" in m["kernel"]]
    if len(launches) != len(BITS) * len(CONFIGS):
        raise SystemExit(f"expected {len(BITS) * len(CONFIGS)} loads, found {len(launches)}")
    rows = []
    for i, m in enumerate(launches):
        bits, (part, space) = BITS[i // len(CONFIGS)], CONFIGS[i % len(CONFIGS)]
        layout = _layout(bits)
        code_bytes = layout.key_code_bytes if part == "key" else layout.value_code_bytes
        read, written = _number(m["dram__bytes_read.sum"]), _number(m["dram__bytes_write.sum"])
        rows.append(dict(bits=bits, part=part, space=space, slot_bytes=layout.slot_bytes,
                         counted_read=VECTORS * code_bytes, counted_written=VECTORS * DIM * 2,
                         dram_read=read, dram_written=written,
                         l2_read_sectors=_number(m["lts__t_sectors_srcunit_tex_op_read.sum"]),
                         l2_write_sectors=_number(m["lts__t_sectors_srcunit_tex_op_write.sum"]),
                         read_per_vector=read / VECTORS, read_ratio=read / (VECTORS * code_bytes),
                         traffic_ratio=(read + written) / (VECTORS * (code_bytes + DIM * 2)),
                         duration=m.get("Duration"), dram_throughput=m.get("DRAM Throughput")))
    shape = f"{VECTORS >> 20}M vectors of dim {DIM} in {HEADS} heads, shuffled slots, fp16 out, Hadamard rotation"
    result = run_info(run_from) | {"shape": shape, "ncu": "--clock-control none", "loads": rows}
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"{r['bits']} bit {r['part']:5s} {r['space']:7s}: DRAM read {r['read_per_vector']:.1f} B a vector "
              f"({r['read_ratio']:.2f}x the code bytes), read + written {r['traffic_ratio']:.3f}x counted, {r['duration']}")


if __name__ == "__main__":
    main(run, summarise, METRICS, str(ROOT / "results" / "codec_load_ncu.json"))
