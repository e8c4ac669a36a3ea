"""A pytest plugin that runs kvlab's GPU code paths on a machine without a GPU, compiling instead of launching.

    PYTHONPATH=tests python -m pytest -p compile_only tests/ops tests/test_bad_inputs.py

Every kernel launch compiles the kernel for an H100/H200 (``sm_90``, with Triton's own ``ptxas``) with the
arguments, constexprs and options the launch would have on such a GPU, and then returns without running it:
kvlab's host code takes its GPU paths (``kvlab._kernels.tables.compiled`` answers True, compute capability 9.0,
132 SMs), so Gluon kernels, inline PTX, bulk tensor stores, register caps and the GPU tile sizes are all
compiled. Outputs are never written, so the tests' value checks fail; what this run finds is the rest: a kernel
that does not compile, a launch whose arguments do not bind, host code of a GPU path that raises.

``KVLAB_COMPILE_ARCH=80`` takes an A100's paths and compiles for ``sm_80`` instead (``benchmarks/compile_only.py``
does the compiling; this plugin reports on it).

At the end the plugin prints each kernel that failed to compile or bind (once per kernel and error), and writes
every compiled launch and every failure to ``$KVLAB_COMPILE_LOG`` (JSON) when that is set.
"""

from __future__ import annotations

import json
import os
import traceback

import pytest

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise pytest.UsageError("compile_only compiles the kernels: unset TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "0"  # conftest's default (the interpreter) must not apply

from benchmarks import compile_only  # noqa: E402

compiled_launches: list[dict] = []
failures: list[dict] = []


def _name(fn) -> str:
    return f"{fn.fn.__module__}.{getattr(fn, '__name__', None) or fn.fn.__qualname__}"


def _compiled(fn, kernel, grid, args, seconds) -> None:
    if seconds is not None:
        compiled_launches.append(dict(kernel=_name(fn), seconds=round(seconds, 3)))


def _failed(fn, exc) -> None:
    failures.append(dict(kernel=_name(fn), error=f"{type(exc).__name__}: {exc}"[:2000],
                         where=traceback.format_exc(limit=-3)[-2000:]))


def pytest_configure(config):
    compile_only.install(_compiled, _failed)


def pytest_terminal_summary(terminalreporter):
    seen = {}
    for f in failures:
        seen.setdefault((f["kernel"], f["error"].splitlines()[0] if f["error"] else ""), f)
    tr = terminalreporter
    tr.section("compile_only")
    tr.write_line(f"{len(compiled_launches)} launches compiled for cuda sm_{compile_only.ARCH} "
                  f"({sum(c['seconds'] for c in compiled_launches):.0f} s), {len(failures)} failed")
    for (kernel, first), f in seen.items():
        tr.write_line(f"FAILED {kernel}: {first}")
        tr.write_line(f["where"])
    log = os.environ.get("KVLAB_COMPILE_LOG")
    if log:
        with open(log, "w") as fh:
            json.dump(dict(target=f"cuda sm_{compile_only.ARCH}", compiled=compiled_launches, failures=failures),
                      fh, indent=1)
