"""A rerun of the benchmarks against the committed results: per group of rows (a codec, a kernel, a cache), the
median and range of the ratio rerun / committed of each time, over the points both runs measured.

    python -m benchmarks.bench_decode --out rerun --no-tests      # any benchmark, written to a folder of its own
    python -m benchmarks.compare rerun [--against results] [--tolerance 0.05]

A ratio above 1: the rerun is slower. Device times (kernels timed on the GPU, or replayed from a CUDA graph)
are the ones to compare; times called from Python also carry the host's launch work, which moves with the
machine's CPU, and are shown apart. Each file's device is printed: on another GPU the ratios compare the GPUs
as much as the code (memory-bound kernels follow the copy bandwidth). With ``--tolerance T`` the exit status
is 1 when the median ratio of a device time in some group leaves ``[1 - T, 1 + T]``.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Table:
    """A results file: the columns naming a point, the columns naming its group, its device times and its times
    called from Python."""

    keys: tuple[str, ...]
    group: tuple[str, ...]
    device_times: tuple[str, ...]
    python_times: tuple[str, ...] = ()
    python_mode: str | None = None  # rows whose ``mode`` is this ran from Python: all their times are Python times


_CODEC_KERNELS = Table(("kernel", "variant", "bits", "n_vectors", "dim"), ("kernel", "variant", "bits"),
                       ("time_ms", "graph_time_ms"))
_LAUNCH_CONFIGS = Table(("kernel", "variant", "bits", "config", "n_vectors", "dim"), ("kernel", "variant", "bits"),
                        ("time_ms",))

TABLES = {
    "decode_attention.csv": Table(("codec", "key_bits", "value_bits", "batch", "context"),
                                  ("codec", "key_bits", "value_bits"), ("time_graph_ms",), ("time_ms", "host_ms")),
    "decode_attention_sweep.csv": Table(("codec", "key_bits", "value_bits", "config", "num_splits", "batch", "context"),
                                        ("codec", "key_bits", "value_bits"), ("time_ms",)),
    "transform_decode.csv": Table(("shape", "batch", "context", "method"), ("shape", "method"), ("graph_ms",), ("ms",)),
    "generate.csv": Table(("cache", "mode", "batch", "context"), ("cache", "mode"), ("ms_per_step",),
                          python_mode="eager"),
    "codec_kernels.csv": _CODEC_KERNELS,
    "codec_kernels_affine.csv": _CODEC_KERNELS,
    "codec_kernels_mse_load.csv": _CODEC_KERNELS,
    "codec_kernels_mse_store.csv": _CODEC_KERNELS,
    "codec_launch_configs.csv": _LAUNCH_CONFIGS,
    "codec_launch_configs_affine.csv": _LAUNCH_CONFIGS,
    "codec_launch_configs_mse_load.csv": _LAUNCH_CONFIGS,
}


def _time(row: dict, column: str) -> float | None:
    try:
        value = float(row.get(column) or "nan")
    except ValueError:
        return None
    return value if value > 0 and value != float("inf") else None


def read_points(path: Path, table: Table) -> dict[tuple, dict]:
    """The measured rows of one results file, by point (rows with a ``status`` other than ``ok`` left out)."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in table.keys if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path} has no column {', '.join(missing)}: not a file of this benchmark")
        rows = [r for r in reader if r.get("status", "ok") == "ok"]
    points = {}
    for r in rows:
        key = tuple(r[c] for c in table.keys)
        if key in points:
            raise ValueError(f"{path}: the point {key} appears twice")
        points[key] = r
    return points


def _run(points: dict) -> tuple[str, str]:
    """``(device, date)`` of a results file's run."""
    row = next(iter(points.values()), {})
    return row.get("device", "?"), str(row.get("date", "?"))[:10]


def compare(rerun: dict, committed: dict, table: Table) -> list[dict]:
    """One entry per group and time column: the ratios rerun / committed over the points both measured."""
    ratios: dict[tuple, list[float]] = {}
    for key, new in rerun.items():
        old = committed.get(key)
        if old is None:
            continue
        from_python = table.python_mode is not None and new.get("mode") == table.python_mode
        group = tuple(new[c] for c in table.group)
        for kind, columns in (("device", table.device_times), ("python", table.python_times)):
            for column in columns:
                a, b = _time(new, column), _time(old, column)
                if a is not None and b is not None:
                    ratios.setdefault((group, column, "python" if from_python else kind), []).append(a / b)
    return [dict(group=", ".join(g), column=c, kind=k, points=len(v), median=statistics.median(v), low=min(v), high=max(v))
            for (g, c, k), v in ratios.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rerun", type=Path, help="folder with the rerun's CSV files")
    ap.add_argument("--against", type=Path, default=ROOT / "results", help="folder with the results to compare with")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="exit 1 when a group's median ratio of a device time leaves [1 - T, 1 + T]")
    args = ap.parse_args(argv)
    if args.tolerance is not None and not 0 <= args.tolerance < 1:
        ap.error(f"--tolerance must be in [0, 1), got {args.tolerance}")
    for folder in (args.rerun, args.against):
        if not folder.is_dir():
            ap.error(f"{folder} is not a folder")
    found, outside = 0, []
    for name, table in TABLES.items():
        new_path, old_path = args.rerun / name, args.against / name
        if not new_path.is_file() or not old_path.is_file():
            continue
        try:
            rerun, committed = read_points(new_path, table), read_points(old_path, table)
        except (ValueError, csv.Error, UnicodeDecodeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        found += 1
        (new_device, new_date), (old_device, old_date) = _run(rerun), _run(committed)
        print(f"{name}: rerun on {new_device} ({new_date}), against {old_device} ({old_date})")
        if new_device != old_device:
            print("  other GPUs: the ratios compare the GPUs as much as the code")
        entries = compare(rerun, committed, table)
        shared = len(rerun.keys() & committed.keys())
        print(f"  {shared} points in both, {len(rerun) - shared} only in the rerun, {len(committed) - shared} only committed")
        width = max([len(e["group"]) for e in entries] + [5])
        for e in sorted(entries, key=lambda e: (e["kind"] != "device", e["group"], e["column"])):
            flag = ""
            if args.tolerance is not None and e["kind"] == "device" and abs(e["median"] - 1) > args.tolerance:
                flag = "  <- outside the tolerance"
                outside.append(f"{name} {e['group']} {e['column']}")
            print(f"  {e['group']:<{width}}  {e['kind']:6} {e['column']:<14} {e['points']:4d} points  median {e['median']:.3f}"
                  f"  range {e['low']:.3f}-{e['high']:.3f}{flag}")
    if not found:
        print(f"no results file of {', '.join(TABLES)} in both {args.rerun} and {args.against}", file=sys.stderr)
        return 2
    if outside:
        print(f"{len(outside)} device times outside the tolerance {args.tolerance}: {'; '.join(outside)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
