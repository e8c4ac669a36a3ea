"""A pytest plugin that runs kvlab's GPU code paths on a machine without a GPU, compiling instead of launching.

    PYTHONPATH=tests python -m pytest -p compile_only tests/ops tests/test_bad_inputs.py

Every kernel launch compiles the kernel for an H100/H200 (``sm_90``, with Triton's own ``ptxas``) with the
arguments, constexprs and options the launch would have on such a GPU, and then returns without running it:
kvlab's host code takes its GPU paths (``kvlab._kernels.tables.compiled`` answers True, compute capability 9.0,
132 SMs), so Gluon kernels, inline PTX, bulk tensor stores, register caps and the GPU tile sizes are all
compiled. Outputs are never written, so the tests' value checks fail; what this run finds is the rest: a kernel
that does not compile, a launch whose arguments do not bind, host code of a GPU path that raises.

``KVLAB_COMPILE_ARCH=80`` takes an A100's paths and compiles for ``sm_80`` instead.

At the end the plugin prints each kernel that failed to compile or bind (once per kernel and error), and writes
every compiled launch and every failure to ``$KVLAB_COMPILE_LOG`` (JSON) when that is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback

import pytest

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise pytest.UsageError("compile_only compiles the kernels: unset TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "0"  # conftest's default (the interpreter) must not apply

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", int(os.environ.get("KVLAB_COMPILE_ARCH", "90")), 32)  # 90: H100/H200; 80: A100
SM_COUNT = 132
compiled_launches: list[dict] = []
failures: list[dict] = []


class CompileOnlyDriver:
    """The part of a Triton driver that compiling needs: the target, and a device and stream to key caches on."""

    def is_active(self) -> bool:
        return True

    def get_current_target(self):
        return TARGET

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


_run = JITFunction.run


class NotLaunched:
    """A compiled kernel that is never loaded onto a device: launching it (``kernel[grid](...)``, ``kernel.run``)
    does nothing; its compiler outputs (``asm``, ``metadata``) are the compiled kernel's."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None

    def run(self, *args, **kwargs) -> None:
        return None


def _compile_only(self, *args, grid, warmup, **kwargs):
    name = getattr(self, "__name__", None) or getattr(self.fn, "__qualname__", str(self))
    start = time.perf_counter()
    try:
        kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    except Exception as exc:
        failures.append(dict(kernel=f"{self.fn.__module__}.{name}", error=f"{type(exc).__name__}: {exc}"[:2000],
                             where=traceback.format_exc(limit=-3)[-2000:]))
        raise
    compiled_launches.append(dict(kernel=f"{self.fn.__module__}.{name}", seconds=round(time.perf_counter() - start, 3)))
    return NotLaunched(kernel)


def _install() -> None:
    from kvlab import _checks
    from kvlab._kernels import tables

    driver.set_active(CompileOnlyDriver())
    JITFunction.run = _compile_only
    tables.compiled = lambda device: True
    tables.capability = lambda device: (TARGET.arch // 10, TARGET.arch % 10)
    tables.sm_count = lambda device: SM_COUNT
    tables.on_device = lambda device: contextlib.nullcontext()
    _checks.check_kernel_device = lambda name, x: None


def pytest_configure(config):
    _install()


def pytest_terminal_summary(terminalreporter):
    seen = {}
    for f in failures:
        seen.setdefault((f["kernel"], f["error"].splitlines()[0] if f["error"] else ""), f)
    tr = terminalreporter
    tr.section("compile_only")
    tr.write_line(f"{len(compiled_launches)} launches compiled for {TARGET.backend} sm_{TARGET.arch} "
                  f"({sum(c['seconds'] for c in compiled_launches):.0f} s), {len(failures)} failed")
    for (kernel, first), f in seen.items():
        tr.write_line(f"FAILED {kernel}: {first}")
        tr.write_line(f["where"])
    log = os.environ.get("KVLAB_COMPILE_LOG")
    if log:
        with open(log, "w") as fh:
            json.dump(dict(target=f"{TARGET.backend} sm_{TARGET.arch}", compiled=compiled_launches, failures=failures),
                      fh, indent=1)
