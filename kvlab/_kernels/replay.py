"""A kernel launch kept for replay: the host cost of one decode step.

Triton's JIT binds, specialises and hashes every argument of every launch (tens of microseconds a
call, more for Gluon kernels whose layouts are hashed). A decode step launches the same kernels on
the same buffers once per layer and token, so ``Launch`` records a launch once: the first call goes
through the JIT (and compiles), later calls hand the recorded arguments straight to the compiled
kernel's launcher. Arguments named in ``variable`` may take another tensor at each call, of the same
dtype and the same 16-byte alignment (what Triton specialises a pointer on); anything else goes
through the JIT again. Under Triton's interpreter every call goes through the JIT.
"""
from __future__ import annotations

import torch
from triton import knobs
from triton.runtime import driver

from . import tables as T


def _spec(x):
    return (x.dtype, x.data_ptr() % 16 == 0)


class Launch:
    """``fn[grid](**args, **options)``, replayable: ``launch()`` or ``launch(name=tensor, ...)`` for the
    ``variable`` arguments (every kernel argument is given by name in ``args``, constexprs included)."""

    __slots__ = ("fn", "grid", "args", "options", "names", "variable", "kernel", "values", "device")

    def __init__(self, fn, grid, args: dict, options: dict | None = None, variable: tuple = ()):
        self.fn, self.args, self.options = fn, args, dict(options or {})
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.names = list(fn.arg_names)
        missing = [n for n in self.names if n not in args]
        if missing:
            raise TypeError(f"Launch of {fn.__name__} needs every argument by name; missing {missing}")
        self.variable = {n: (self.names.index(n), _spec(args[n])) for n in variable}
        self.kernel, self.values = None, [args[n] for n in self.names]
        self.device = next((a.device for a in args.values() if isinstance(a, torch.Tensor)), torch.device("cpu"))

    def __call__(self, **changed) -> None:
        kernel = self.kernel
        if kernel is not None and all(_spec(v) == self.variable[n][1] for n, v in changed.items()):
            values = self.values
            if changed:
                values = list(values)
                for n, v in changed.items():
                    values[self.variable[n][0]] = v
            stream = driver.active.get_current_stream(self.device.index)
            enter = knobs.runtime.launch_enter_hook
            meta = kernel.launch_metadata(self.grid, stream, *values) if enter is not None else None
            kernel.run(*self.grid, stream, kernel.function, kernel.packed_metadata, meta, enter,
                       knobs.runtime.launch_exit_hook, *values)
            return
        compiled = self.fn[self.grid](**{**self.args, **changed}, **self.options)
        if (kernel is None and T.compiled(self.device) and hasattr(compiled, "run")
                and all(_spec(v) == self.variable[n][1] for n, v in changed.items())):
            self.kernel = compiled
