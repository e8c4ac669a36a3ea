"""``python -m kvlab.sweep``: the command line of ``kvlab.sweep.sweep`` (see the package's docstring)."""

from __future__ import annotations

import argparse
import sys
import threading

from .api import EXECUTORS, sweep
from .grid import SweepError, notebook_parameters, notebook_path, parse_axis, read_notebook



# ----------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m kvlab.sweep",
        description="Run a notebook over a grid of parameters with papermill; collect the glued scalars into results.csv.",
        epilog="Values: True/False/None (any case), integers, floats (1e-3, inf), quoted strings or Python "
               "list literals, else plain strings; comma-separated outside quotes and brackets. "
               "Exit code: 0 all runs succeeded, 1 some run failed, 2 bad arguments, 130 interrupted, "
               "143 terminated (SIGTERM).",
    )
    ap.add_argument("notebook", help="the notebook to run (.ipynb with a cell tagged 'parameters')")
    ap.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUES"),
                    help="one axis of the grid: a parameter and its comma-separated values (repeatable)")
    ap.add_argument("--out", default="sweeps", help="output folder (default: sweeps); runs go to OUT/<notebook name>/")
    ap.add_argument("--workers", type=int, default=None,
                    help="local executor: parallel runs (default: one per visible GPU, else 1)")
    ap.add_argument("--executor", choices=EXECUTORS, default="local", help="where runs execute (default: local)")
    ap.add_argument("--address", help="dask executor: the scheduler's address, e.g. tcp://host:8786")
    ap.add_argument("--force", action="store_true", help="rerun every run, finished or not")
    ap.add_argument("--execution-timeout", type=int, default=None, metavar="SECONDS",
                    help="fail a run whose cell runs longer than this (default: no limit)")
    ap.add_argument("--no-plot", action="store_true", help="skip results.png")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled as an interruption: runs in flight are ended with their kernels."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    import signal

    ap = _parser()
    args = ap.parse_args(argv)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _main(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(args) -> int:
    try:
        source = notebook_path(args.notebook)
        defaults = notebook_parameters(read_notebook(source)[1])
        grid: dict[str, list] = {}
        for name, text in args.parameter:
            if name in grid:
                raise SweepError(f"-p {name} is given twice; put all its values in one comma-separated list")
            if name not in defaults:
                known = ", ".join(defaults) or "(none)"
                raise SweepError(f"unknown parameter {name}: the notebook's parameters cell assigns {known}")
            grid[name] = parse_axis(name, text, defaults[name])
        result = sweep(source, grid, args.out, executor=args.executor, workers=args.workers,
                       address=args.address, force=args.force, execution_timeout=args.execution_timeout,
                       plot=not args.no_plot, progress=not args.no_progress)
    except SweepError as exc:
        print(f"kvlab.sweep: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt as exc:
        print("kvlab.sweep: interrupted; finished runs are kept and skipped by the next run of the same command; "
              "results.csv is as it was", file=sys.stderr, flush=True)
        return 143 if isinstance(exc, _Terminated) else 130
    total = len(result.rows)
    print(f"kvlab.sweep: {total} run(s) of {source}: {total - result.failed} ok "
          f"({result.skipped} already finished, skipped), {result.failed} failed", flush=True)
    print(f"kvlab.sweep: table {result.directory / 'results.csv'}"
          + (f", plot {result.plot}" if result.plot else ""), flush=True)
    return 0 if result.ok else 1
