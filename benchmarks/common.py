"""What the GPU benchmarks share: running the test suite on the device they measure, timing a call replayed from a
CUDA graph, writing result CSVs, filling a cache with the reference encoder's codes."""

from __future__ import annotations

import csv
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_tests(paths: list[str], log: str | None = None) -> dict:
    """Run pytest on ``paths`` here (compiled kernels), or read the logs of runs made just before.

    ``log``: one pytest output file, or several separated by commas (a suite run in parts, e.g. one
    file per call on a machine with a time limit per command). ``passed`` is pytest's exit status, or
    for logs that every one's summary line says "N passed" with no failure or error.
    """
    if log:
        parts = [_summarise(Path(f).read_text(), None) | {"log": f} for f in log.split(",") if f]
        if len(parts) == 1:
            return parts[0]
        return {"passed": all(p["passed"] for p in parts), "summary": "; ".join(p["summary"] for p in parts),
                "tail": "\n".join(p["tail"] for p in parts), "logs": [p["log"] for p in parts]}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
                          cwd=ROOT, capture_output=True, text=True)
    return _summarise(proc.stdout + proc.stderr, proc.returncode)


def bench_graph(fn, rep: int = 60):
    """Median time (ms) of ``fn`` replayed from a CUDA graph (None where it cannot be captured): the kernels
    alone, without the host's launch work between calls.

    ``do_bench_cudagraph`` runs ``fn`` on a stream of its own, which does not wait for the default stream:
    the inputs just made there (random codes, a shuffled block table) must be complete before it reads
    them, or its first call may read a block table still being written."""
    import torch
    from triton.testing import do_bench_cudagraph

    torch.cuda.synchronize()
    try:
        return do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception as e:  # noqa: BLE001 - recorded as missing, with the reason printed
        print(f"  CUDA graph capture failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def _summarise(text: str, returncode: int | None) -> dict:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if " passed" in ln or " failed" in ln or " error" in ln), "")
    passed = returncode == 0 if returncode is not None else (" passed" in summary and "failed" not in summary and "error" not in summary)
    return {"passed": passed, "summary": summary, "tail": "\n".join(lines[-30:])}


def write_csv(path: Path, rows: list[dict], keys: list[str], run: dict) -> None:
    """``rows`` as CSV at ``path``: the columns ``keys`` (missing values empty), then the columns of
    ``run`` (device, versions, date, ...) repeated on every row, so that each row names its run."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(keys) + list(run))
        w.writeheader()
        for r in rows:
            w.writerow({**{k: r.get(k, "") for k in keys}, **run})


def run_meta(script: str, **extra) -> dict:
    """What names a run of ``python -m benchmarks.<script>`` on this GPU: device, versions, date and command, then
    ``extra``."""
    import torch
    import triton

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": f"python -m benchmarks.{script}" + "".join(f" {a}" for a in sys.argv[1:]), **extra}


def write_run(out: str | Path, stem: str, rows: list[dict], keys: list[str], meta: dict) -> None:
    """One run in folder ``out``: ``<stem>.csv`` (``write_csv``: the columns ``keys``, then the run's device,
    versions and date) and ``<stem>.json`` (``meta`` and the rows)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{stem}.csv", rows, keys, {k: meta[k] for k in ("device", "torch", "triton", "date")})
    (out / f"{stem}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")


def write_reference_slots(cache, slots, key_codec, value_codec, keys, values, layout, chunk: int = 1 << 18) -> None:
    """Write the reference encoder's codes of ``keys`` and ``values`` into ``slots`` of ``cache`` (the bytes
    ``store_mse`` writes), ``chunk`` tokens at a time to bound the encoder's fp32 intermediates."""
    import kvlab

    for i in range(0, slots.shape[0], chunk):
        s = slice(i, i + chunk)
        kvlab.mse.reference.store_slots(cache, slots[s], key_codec.encode(keys[s]), value_codec.encode(values[s]), layout)
