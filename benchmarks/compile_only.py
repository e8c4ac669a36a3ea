"""kvlab's GPU code paths on a machine without a GPU: every kernel launch compiles instead of running.

``install()`` (before the first launch, with ``TRITON_INTERPRET`` unset) makes every launch compile its kernel
for an H100/H200 (``sm_90``, with Triton's own ``ptxas``) with the arguments, constexprs and options the launch
would have on such a GPU, and return without running it. kvlab's host code takes its GPU paths
(``kvlab._kernels.tables.compiled`` answers True, compute capability 9.0, 132 SMs), so Gluon kernels, inline
PTX, bulk tensor stores, register caps and the GPU tile sizes are all compiled; outputs are never written.
``KVLAB_COMPILE_ARCH=80`` takes an A100's paths and compiles for ``sm_80`` instead.

Used by the pytest plugin ``tests/compile_only.py`` (the test suite's launches, compiled) and by
``benchmarks.kernel_fingerprint`` (the benchmarks' launches, fingerprinted).
"""

from __future__ import annotations

import contextlib
import os
import time

ARCH = int(os.environ.get("KVLAB_COMPILE_ARCH", "90"))  # 90: H100/H200; 80: A100
SM_COUNT = 132


class CompileOnlyDriver:
    """The part of a Triton driver that compiling needs: the target, and a device and stream to key caches on."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", ARCH, 32)

    def is_active(self) -> bool:
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


class NotLaunched:
    """A compiled kernel that is never loaded onto a device: launching it (``kernel[grid](...)``, ``kernel.run``)
    does nothing but tell ``on_launch``; its compiler outputs (``asm``, ``metadata``) are the compiled kernel's."""

    def __init__(self, fn, kernel, on_launch):
        self.fn, self.kernel, self.on_launch = fn, kernel, on_launch

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if self.on_launch is not None:
                self.on_launch(self.fn, self.kernel, grid, dict(zip(self.fn.arg_names, args)) | kwargs, None)

        return launch

    def run(self, *args, **kwargs) -> None:
        return None


def install(on_launch=None, on_error=None) -> None:
    """Compile instead of launch, in this process. ``on_launch(fn, kernel, grid, args, seconds)`` hears of every
    launch: ``fn`` the JIT function, ``kernel`` the compiled kernel, ``grid`` a tuple, ``args`` by name, and the
    seconds the JIT took (None for a later launch of a kernel compiled before, ``kernel[grid](...)``).
    ``on_error(fn, exception)`` hears of a launch that does not compile or bind (the exception is raised)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile-only launches compile the kernels: unset TRITON_INTERPRET before importing triton")
    os.environ["TRITON_INTERPRET"] = "0"
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from kvlab import _checks
    from kvlab._kernels import tables

    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        start = time.perf_counter()
        try:
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as exc:
            if on_error is not None:
                on_error(self, exc)
            raise
        if on_launch is not None:
            bound = dict(zip(self.arg_names, args)) | kwargs
            shape = grid(bound) if callable(grid) else grid
            on_launch(self, kernel, tuple(shape), bound, time.perf_counter() - start)
        return NotLaunched(self, kernel, on_launch)

    driver.set_active(CompileOnlyDriver())
    JITFunction.run = compile_only
    tables.compiled = lambda device: True
    tables.capability = lambda device: (ARCH // 10, ARCH % 10)
    tables.sm_count = lambda device: SM_COUNT
    tables.on_device = lambda device: contextlib.nullcontext()
    _checks.check_kernel_device = lambda name, x: None
