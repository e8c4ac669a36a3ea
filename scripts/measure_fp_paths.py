#!/usr/bin/env python3
"""How far the pages' checked numbers move between the CPU's floating-point paths.

Executes, CPU-sized, every page that compares a live measurement with a committed one, once under each path of
``kvlab.study.fp_paths.PATHS`` (the machine's default, ``MKL_CBWR=COMPATIBLE``, ``=AVX2``, ``=AVX512`` and
``ATEN_CPU_CAPABILITY=avx2``), and runs the tests that compare codes with committed fingerprints under each. Each
page hands its checked quantities to ``kvlab.study.fp_paths.check`` / ``record``, which write them to a file
during this run instead of asserting a bound. The page's own claims (orderings, margins) still run: a page that
fails under a path is reported and the script exits 1.

Writes ``results/fp_paths.json``: per page, per quantity, the value under each path; the status of every page
and of the tests under each path; the CPU, the versions, the date and the command. The pages' bounds are
``MARGIN`` times the largest value over the paths (``kvlab.study.fp_paths.tolerance``).

    nice -n 10 python scripts/measure_fp_paths.py            # about 50 minutes on a 2-core CPU
    python scripts/measure_fp_paths.py 16_second_model --paths default MKL_CBWR=COMPATIBLE --out /tmp/fp.json
    python scripts/measure_fp_paths.py --tests-only     # the tests again under every path, into the existing file
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from kvlab.study.fp_paths import PATHS, RECORD_ENV, RESULTS, recorded  # noqa: E402
from run_notebooks import kernel_env  # noqa: E402

PAGES = ("16_second_model", "15_transform_codec", "09_keys_at_three_bits", "03_perplexity")
TESTS = ("tests/test_results.py",)  # committed results pinned to the codecs' bytes


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def run_page(page: str, path: str, workdir: Path) -> tuple[str, str, str, dict, float]:
    out = workdir / f"{page}.{path}.jsonl"
    env = {**kernel_env(), **PATHS[path], RECORD_ENV: str(out)}
    cmd = [sys.executable, "-m", "papermill", str(ROOT / "notebooks" / f"{page}.ipynb"), str(workdir / f"{page}.{path}.ipynb"),
           "--cwd", str(ROOT), "--kernel", "python3", "--no-progress-bar", "--log-level", "WARNING"]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    seconds = time.monotonic() - start
    values = recorded(out).get(page, {})
    status = "ok" if proc.returncode == 0 else "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
    return page, path, status, values, seconds


def run_tests(path: str) -> tuple[str, str]:
    env = {**kernel_env(), **PATHS[path]}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    return path, "passed" if proc.returncode == 0 else "failed: " + proc.stdout.strip().splitlines()[-1][:300]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pages", nargs="*", default=list(PAGES), help=f"pages to run (default: {' '.join(PAGES)})")
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS), help="floating-point paths")
    ap.add_argument("--jobs", type=int, default=2, help="pages executed at once (default 2)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where to write (default results/fp_paths.json)")
    ap.add_argument("--tests-only", action="store_true", help="run only the tests, and replace their status in --out")
    args = ap.parse_args()
    unknown = sorted(set(args.pages) - set(PAGES))
    if unknown:
        ap.error(f"pages must be among {list(PAGES)}, got {unknown}")
    if args.jobs < 1:
        ap.error(f"--jobs must be at least 1, got {args.jobs}")

    if args.tests_only:
        if not args.out.is_file():
            ap.error(f"--tests-only updates an existing file: {args.out} does not exist")
        data = json.loads(args.out.read_text())
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            status = dict(pool.map(run_tests, args.paths))
        data["tests"] = {"files": list(TESTS), "status": {**data["tests"]["status"], **status},
                         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        args.out.write_text(json.dumps(data, indent=1) + "\n")
        failed = [path for path, state in status.items() if state != "passed"]
        print(f"measure_fp_paths: {' '.join(TESTS)}: " + (f"FAILED under {', '.join(failed)}" if failed else "passed under every path"))
        return 1 if failed else 0

    import torch
    import triton
    import transformers

    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = [pool.submit(run_page, page, path, Path(tmp)) for path in args.paths for page in args.pages]
        tests = [pool.submit(run_tests, path) for path in args.paths]
        pages: dict = {page: {} for page in args.pages}
        status: dict = {page: {} for page in args.pages}
        seconds: dict = {page: {} for page in args.pages}
        for future in runs:
            page, path, state, values, secs = future.result()
            print(f"measure_fp_paths: {page} under {path}: {state} ({secs:.0f} s, {len(values)} quantities)", flush=True)
            status[page][path], seconds[page][path] = state, round(secs, 1)
            for quantity, value in values.items():
                pages[page].setdefault(quantity, {})[path] = value
        test_status = dict(f.result() for f in tests)
    data = {
        "what": "the checked quantities of the CPU-sized pages that compare live measurements with committed ones, "
                "under each floating-point path of kvlab.study.fp_paths.PATHS on one machine; pages[page][quantity][path]: "
                "the value (a page bounds each gap by kvlab.study.fp_paths.tolerance: MARGIN times the largest value)",
        "date": date,
        "machine": f"{cpu_model()}, {platform.machine()}, {len(os.sched_getaffinity(0))} CPUs",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                     "transformers": transformers.__version__},
        "command": "python scripts/measure_fp_paths.py",
        "paths": {name: PATHS[name] for name in args.paths},
        "page_status": status,
        "page_seconds": seconds,
        "tests": {"files": list(TESTS), "status": test_status},
        "seconds": round(time.monotonic() - start, 1),
        "pages": pages,
    }
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    failed = [f"{p} under {q}" for p, by in status.items() for q, s in by.items() if s != "ok"]
    failed += [f"{' '.join(TESTS)} under {q}" for q, s in test_status.items() if s != "passed"]
    print(f"measure_fp_paths: wrote {args.out} in {data['seconds']:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
