"""Run a notebook over a grid of parameters with papermill and collect what it glues into one table.

Command line, from anywhere (the kernels run in the repository root, as the book's do)::

    python -m kvlab.sweep NOTEBOOK -p NAME V1,V2,... [-p NAME V1,...] [--out DIR] [--workers N]
                          [--executor local|dask] [--address ADDR] [--force] [--execution-timeout S]

Grid. Each ``-p NAME VALUES`` is one axis; the runs are the cartesian product of the axes in the
order given (the last axis varies fastest). ``NAME`` must be assigned in the notebook's cell tagged
``parameters``. ``VALUES`` is split at the commas that are outside quotes and brackets, and each
value is read as

* ``True``, ``False`` (any case): a bool; ``None`` (any case): None;
* an integer (``64``, ``-1``): an int; a decimal or special float (``0.5``, ``1e-3``, ``inf``, ``nan``): a float;
* a quoted string (``'3'``) or a Python list, tuple or dict literal (``[64, 128]``): that literal;
* anything else (``haar``): a string.

Where the parameters cell gives a string default, a value read as a number stays its text
(``-p label 3`` passes ``"3"``). Where it gives a number, a bool, a list or a dict, a value of
another kind is an error (None is always accepted: notebooks use it for "automatic").
An unknown name, an axis without values, an empty or unbalanced value, a repeated name or value, a
grid of more than ``MAX_RUNS`` runs, a notebook that is not valid nbformat 4: all are errors reported
before anything runs (exit code 2). So are outputs the sweep could not write at its end: a folder
where it writes a file (``results.csv``, ``results.png``, a run's notebook), a folder it cannot write
into, a ``results.csv`` it cannot read.

Output. ``DIR`` (default ``sweeps``) receives, for a notebook ``name.ipynb``:

* ``DIR/name/<key>.ipynb``: one executed notebook per run, ``<key>`` the parameters spelled out
  (``bits=2__dim=64__rotation=haar``) or, for values that are not plain file-name text,
  ``run-<hash of the parameters>``; its metadata ``kvlab_sweep`` records the parameters, the
  source notebook's SHA-256, the status and the duration;
* ``DIR/name/results.csv``: one row per run of this grid, in grid order: the parameters, every
  scalar (int, float, bool, str, None) the notebook glues with ``myst_nb.glue``, then ``status``
  (``ok``/``failed``), ``duration_s``, ``error`` and ``notebook``. A glued name that is also a swept
  parameter is stored as ``glued.<name>``;
* ``DIR/name/results.png``: the default plot (see ``plot_results``).

Resuming. A run whose executed notebook exists, succeeded, and was made from the same source
notebook bytes with the same parameters is skipped (its row is read back from the notebook);
failed runs and runs of an edited notebook rerun. ``--force`` reruns everything (needed after a
change to kvlab itself, which the check does not see).

Failures. A failing run is reported with its parameters, the failing cell and the error; its
executed notebook is kept; the other runs go on. The exit code is 0 when every run succeeded and 1
otherwise (130 when interrupted, 143 when terminated with SIGTERM).

One table per folder. Sweeps of one notebook into one ``--out`` share ``results.csv``: a run's row
replaces the row of the same parameter values, rows of other grid points stay (a sweep over other
parameter names is refused, exit code 2, before anything runs). Writers take turns (a lock file,
``.results.lock``) and each writes through a temporary file of its own, renamed over the table;
``.results.json`` records which columns are the parameters. A glued ``nan`` or ``inf`` is written as
``nan`` / ``inf`` (an empty cell means "not glued").

Stopping. On Ctrl-C (SIGINT) or SIGTERM the sweep ends the runs in flight at once: papermill is
interrupted so that it shuts its kernel down, then it and its kernel are killed after ``STOP_GRACE_S``
seconds (another Ctrl-C meanwhile does not cut that short);
their temporary folders are removed, finished runs' notebooks are kept (each written atomically) and
``results.csv`` is left as it was. A sweep killed with SIGKILL cannot do this: its papermill
processes (each in a session of its own) run on to their end and leave their ``kvlab-sweep-*``
temporary folders.

Executors. Each run is one ``python -m papermill`` process whose kernel runs in the repository
root with the root on ``PYTHONPATH``.

* ``local`` (default): one worker per visible GPU, each run pinned to its worker's GPU with
  ``CUDA_VISIBLE_DEVICES`` (``--workers N`` uses the first N GPUs). Without a GPU, ``--workers``
  processes (default 1) with ``TRITON_INTERPRET=1``, each with ``OMP_NUM_THREADS`` set to its
  share of the CPU cores unless already set.
* ``dask``: every run is a task submitted to the ``dask.distributed`` scheduler at ``--address``,
  asking for one ``GPU`` worker resource, so a worker declared with ``--resources GPU=1`` runs one
  at a time. Start one worker per GPU, each with its own ``CUDA_VISIBLE_DEVICES``. The source
  notebook travels with the task and the executed notebook comes back to the client, so workers need
  the same kvlab checkout (importable: started from its root with ``PYTHONPATH=.``) and Python
  environment, but no shared file system. A worker without a GPU
  runs the notebook under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import dataclasses
import hashlib
import itertools
import json
import math
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

__all__ = [
    "Outcome",
    "Run",
    "SweepError",
    "SweepResult",
    "Task",
    "decode_glued",
    "diagnose_notebook",
    "execute",
    "format_value",
    "glued_scalars",
    "main",
    "notebook_parameters",
    "parse_axis",
    "plot_results",
    "sweep",
]

ROOT = Path(__file__).resolve().parent.parent  # the repository root: kernels run here
EXECUTORS = ("local", "dask")
GPU_RESOURCE = "GPU"
STATUS_COLUMNS = ("status", "duration_s", "error", "notebook")
METADATA_KEY = "kvlab_sweep"
PAPERMILL_TAGS = {"papermill-error-cell-tag", "injected-parameters"}
# seconds a run's kernel may take to start (papermill's default, 60, is too short for several runs
# starting at once on a small, busy machine)
KERNEL_START_TIMEOUT = 300
# A kernel that dies before its first reply never ran a cell (several kernels starting at once can
# race for the same ports): such a run is started again, up to this many attempts in all.
KERNEL_START_ATTEMPTS = 3
KERNEL_START_FAILURE = "Kernel died before replying to kernel_info"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
MAX_PLOT_PANELS = 12
MAX_RUNS = 100_000  # a larger grid is a typo (each run executes a notebook), refused before it is built


class SweepError(ValueError):
    """A sweep that cannot start: bad notebook, parameters, values or options."""


# ----------------------------------------------------------------------------- parameters and values


_UNKNOWN = object()  # a default that is not a Python literal (an expression)


def notebook_parameters(notebook: dict) -> dict[str, object]:
    """Names assigned in the notebook's cell tagged ``parameters`` with their literal defaults.

    A default that is an expression rather than a literal maps to an opaque marker; any value is
    accepted for it.
    """
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            source = "".join(cell.get("source", ""))
            try:
                tree = ast.parse(source)
            except SyntaxError as exc:
                raise SweepError(f"the cell tagged 'parameters' is not valid Python: {exc}") from None
            found: dict[str, object] = {}
            for node in tree.body:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
                for target in targets:
                    if isinstance(target, ast.Name):
                        try:
                            found[target.id] = ast.literal_eval(node.value) if node.value is not None else _UNKNOWN
                        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                            found[target.id] = _UNKNOWN
            return found
    raise SweepError("the notebook has no code cell tagged 'parameters', so it takes no parameters")


def _read_notebook(source: Path) -> tuple[bytes, dict]:
    """The bytes of the notebook file ``source`` and its JSON; SweepError unless it is a valid nbformat 4 notebook."""
    import copy
    import warnings

    import nbformat

    try:
        data = source.read_bytes()
        nb = json.loads(data.decode("utf-8"))  # a notebook file is UTF-8 JSON (json.loads would take UTF-16 bytes too)
    except (OSError, ValueError) as exc:
        raise SweepError(f"{source}: not a notebook ({exc})") from None
    if not isinstance(nb, dict) or nb.get("nbformat") != 4:
        raise SweepError(f"{source}: not a notebook of nbformat 4 (a JSON object with \"nbformat\": 4 and a list of "
                         f"cells), got {type(nb).__name__}" + (f" of nbformat {nb.get('nbformat')!r}" if isinstance(nb, dict) else ""))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nbformat.validate(copy.deepcopy(nb))  # validate() fills in missing cell ids: leave nb as read
    except Exception as exc:  # nbformat's ValidationError and what a malformed notebook makes it raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SweepError(f"{source}: not a valid notebook ({first})") from None
    return data, nb


_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?|[+-]?(inf|infinity|nan)", re.I)


def _split_values(name: str, text: str) -> list[str]:
    """``text`` split at the commas outside quotes and brackets."""
    items, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                raise SweepError(f"-p {name}: unbalanced {ch!r} in {text!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if quote:
        raise SweepError(f"-p {name}: unclosed quote {quote} in {text!r}")
    if depth:
        raise SweepError(f"-p {name}: unclosed bracket in {text!r}")
    items.append(text[start:])
    return [item.strip() for item in items]


def _parse_value(name: str, text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    if text[:1] in "'\"([{":
        try:
            value = ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise SweepError(f"-p {name}: cannot read {text!r} as a Python literal") from None
        return list(value) if isinstance(value, tuple) else value
    return text


def _kind(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, int):
        return "an int"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a dict"
    return type(value).__name__


def _fits_default(value, default) -> bool:
    if value is None or default is None or default is _UNKNOWN:
        return True
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple))
    if isinstance(default, dict):
        return isinstance(value, dict)
    if isinstance(default, str):
        return isinstance(value, str)
    return True


def parse_axis(name: str, text: str, default=_UNKNOWN) -> list:
    """The values of ``-p name text`` (see the module doc), checked against the notebook's ``default``."""
    if not text.strip():
        raise SweepError(f"-p {name}: no values given (write them comma-separated, e.g. -p {name} 1,2)")
    values = []
    for item in _split_values(name, text):
        if not item:
            raise SweepError(f"-p {name}: empty value in {text!r} (a comma too many?)")
        value = _parse_value(name, item)
        if isinstance(default, str) and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = item  # a string parameter keeps the text
        if not _fits_default(value, default):
            raise SweepError(
                f"-p {name}: {item!r} is {_kind(value)}, but the notebook's default {name} = {default!r} "
                f"is {_kind(default)}"
            )
        values.append(value)
    return values


_PLAIN_TEXT = re.compile(r"[^,'\"()\[\]{}\s]([^,'\"()\[\]{}]*[^,'\"()\[\]{}\s])?")


def format_value(value) -> str:
    """``value`` as text that ``-p`` reads back as the same value."""
    if isinstance(value, str):
        plain = _PLAIN_TEXT.fullmatch(value) and isinstance(_parse_value("", value), str)
        return value if plain else repr(value)
    return repr(list(value) if isinstance(value, tuple) else value)


def _check_grid(grid: dict, defaults: dict) -> None:
    if not grid:
        raise SweepError("empty grid: give at least one -p NAME VALUES")
    unknown = [name for name in grid if name not in defaults]
    if unknown:
        known = ", ".join(defaults) or "(none)"
        raise SweepError(f"unknown parameter {', '.join(unknown)}: the notebook's parameters cell assigns {known}")
    for name, values in grid.items():
        if not isinstance(values, (list, tuple)) or not values:
            raise SweepError(f"-p {name}: no values given")
        seen = set()
        for value in values:
            if not _fits_default(value, defaults[name]):
                raise SweepError(
                    f"-p {name}: {value!r} is {_kind(value)}, but the notebook's default "
                    f"{name} = {defaults[name]!r} is {_kind(defaults[name])}"
                )
            canon = _canonical(value)
            if canon in seen:
                raise SweepError(f"-p {name}: the value {format_value(value)} is given twice")
            seen.add(canon)
    total = math.prod(len(values) for values in grid.values())
    if total > MAX_RUNS:
        sizes = " x ".join(f"{len(v)} ({n})" for n, v in grid.items())
        raise SweepError(f"the grid has {total} runs ({sizes}), more than {MAX_RUNS}: sweep fewer values")


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True)


# ----------------------------------------------------------------------------- runs


_SAFE_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
_SAFE_VALUE = re.compile(r"[A-Za-z0-9.+-]+(_[A-Za-z0-9.+-]+)*")
MAX_KEY_LENGTH = 150


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: one object per grid point
class Run:
    """One grid point: its parameters (in axis order) and the file name of its executed notebook."""

    index: int
    parameters: dict
    key: str

    def describe(self) -> str:
        return ", ".join(f"{name}={format_value(v)}" for name, v in self.parameters.items())


def run_key(parameters: dict) -> str:
    """``name=value__name=value`` when every part is plain file-name text, else ``run-<hash>``."""
    parts = [(name, format_value(v)) for name, v in parameters.items()]
    key = "__".join(f"{n}={v}" for n, v in parts)
    if len(key) <= MAX_KEY_LENGTH and all(_SAFE_NAME.fullmatch(n) and _SAFE_VALUE.fullmatch(v) for n, v in parts):
        return key
    digest = hashlib.sha256(json.dumps(list(parameters.items())).encode()).hexdigest()
    return f"run-{digest[:16]}"


def _grid_runs(grid: dict) -> list[Run]:
    names = list(grid)
    runs = []
    for i, combo in enumerate(itertools.product(*(grid[n] for n in names))):
        parameters = dict(zip(names, combo))
        runs.append(Run(i, parameters, run_key(parameters)))
    return runs


# ----------------------------------------------------------------------------- one run (local or on a Dask worker)


@dataclasses.dataclass(frozen=True)
class Task:
    """What a worker needs to execute one run: everything travels with it."""

    notebook_name: str
    notebook_text: str
    parameters: dict
    env: dict  # set in the papermill process's environment (the local executor's GPU pinning)
    execution_timeout: int | None = None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The result of one run: ``executed`` is the executed notebook's JSON text (None if none was written)."""

    ok: bool
    duration_s: float
    error: str
    executed: str | None
    log_tail: str = ""
    host: str = ""


_GPU_PRESENT: bool | None = None  # probed once per process that executes runs
_GPU_PROBE_LOCK = threading.Lock()


def _gpu_present(env: dict) -> bool:
    global _GPU_PRESENT
    with _GPU_PROBE_LOCK:
        if _GPU_PRESENT is None:
            probe = subprocess.run(
                [sys.executable, "-c", "import torch; print(int(torch.cuda.is_available()))"],
                capture_output=True, text=True, env=env,
            )
            _GPU_PRESENT = probe.returncode == 0 and probe.stdout.strip() == "1"
    return _GPU_PRESENT


def _kernel_env(extra: dict) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    env.setdefault("JUPYTER_PLATFORM_DIRS", "1")
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    env.update(extra)
    if "TRITON_INTERPRET" not in env and not _gpu_present(env):
        env["TRITON_INTERPRET"] = "1"
    return env


def _jsonable(value):
    """``value`` with tuples as lists, as JSON and YAML store it."""
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def execute(task: Task) -> Outcome:
    """Execute one run with ``python -m papermill`` in a temporary folder; never raises for a failing notebook."""
    import socket

    import yaml

    start = time.monotonic()
    host = socket.gethostname()
    try:
        env = _kernel_env(task.env)
        with tempfile.TemporaryDirectory(prefix="kvlab-sweep-") as tmp:
            src, dst = Path(tmp) / task.notebook_name, Path(tmp) / "executed.ipynb"
            src.write_text(task.notebook_text, encoding="utf-8")
            cmd = [sys.executable, "-m", "papermill", str(src), str(dst), "--cwd", str(ROOT),
                   "--kernel", "python3", "--no-progress-bar", "--log-level", "WARNING",
                   "--start-timeout", str(KERNEL_START_TIMEOUT),
                   "-y", yaml.safe_dump(_jsonable(task.parameters))]
            if task.execution_timeout is not None:
                cmd += ["--execution-timeout", str(task.execution_timeout)]
            for _ in range(KERNEL_START_ATTEMPTS):
                proc = _papermill(cmd, env, Path(tmp) / "papermill.log")
                if dst.is_file() or KERNEL_START_FAILURE not in proc.stdout:
                    break
            executed = dst.read_text(encoding="utf-8") if dst.is_file() else None
    except Exception as exc:  # the run could not even start: report it as this run's failure
        return Outcome(False, time.monotonic() - start, f"could not run papermill: {type(exc).__name__}: {exc}", None, host=host)
    if _ABORT.is_set():
        return Outcome(False, time.monotonic() - start, "the sweep was interrupted", None, host=host)
    duration = time.monotonic() - start
    try:
        nb = json.loads(executed) if executed else None
    except ValueError:
        nb, executed = None, None
    if proc.returncode == 0 and nb is not None and not _error_outputs(nb):
        return Outcome(True, duration, "", executed, host=host)
    timed_out = task.execution_timeout is not None and ("CellTimeoutError" in proc.stdout
                                                        or "Cell execution timed out" in proc.stdout)
    if nb is not None and timed_out:
        where = _timed_out_cell(nb)
        return Outcome(False, duration, f"{where} timed out: it ran longer than --execution-timeout "
                       f"{task.execution_timeout} s", executed, host=host)
    if nb is not None and _error_outputs(nb):
        return Outcome(False, duration, diagnose_notebook(nb), executed, host=host)
    # no error output: the kernel died, a cell timed out or papermill itself failed; its log tells
    problem = (diagnose_notebook(nb) if nb is not None else None) or "no executed notebook was written"
    tail = "\n".join(ANSI.sub("", proc.stdout).strip().splitlines()[-15:])
    return Outcome(False, duration, f"{problem} (papermill exit code {proc.returncode})", executed, tail, host)


_ABORT = threading.Event()  # set when the sweep stops early: runs in flight are ended, no other starts
STOP_GRACE_S = 10  # seconds papermill has to shut its kernel down after SIGINT before it and its kernel are killed


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc; [] where there is none), a kernel in its own session included."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat") if Path("/proc").is_dir() else []:
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(entry.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _papermill(cmd: list[str], env: dict, log: Path) -> subprocess.CompletedProcess:
    """Run papermill in its own session; if the sweep stops (an exception here, ``_ABORT``), end it and its kernel."""
    import signal

    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            while True:
                try:
                    proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    if _ABORT.is_set():
                        raise KeyboardInterrupt from None
        except BaseException:
            family = _children(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)  # papermill shuts its kernel down
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            for pid in [proc.pid, *family, *_children(proc.pid)]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout=log.read_text(errors="replace"))


def _timed_out_cell(nb: dict) -> str:
    """The cell a timeout stopped: the first with an error output, else the last one started."""
    errors = _error_outputs(nb)
    if errors:
        return _describe_cell(nb, errors[0][0])
    cells = nb.get("cells", [])
    started = [i for i, c in enumerate(cells) if c.get("cell_type") == "code"
               and c.get("metadata", {}).get("papermill", {}).get("start_time")]
    return _describe_cell(nb, started[-1]) if started else "a cell"


def _error_outputs(nb: dict) -> list[tuple[int, dict]]:
    return [(i, out) for i, cell in enumerate(nb.get("cells", []))
            for out in cell.get("outputs", []) or [] if out.get("output_type") == "error"]


def _describe_cell(nb: dict, i: int) -> str:
    cells = nb.get("cells", [])
    tags = set(cells[i].get("metadata", {}).get("tags", []))
    count = cells[i].get("execution_count")
    label = f"In [{count}]" if count is not None else "no execution count"
    if "injected-parameters" in tags:
        return f"the injected parameters cell ({label})"
    index = sum(1 for c in cells[:i] if not PAPERMILL_TAGS & set(c.get("metadata", {}).get("tags", [])))
    return f"cell {index} ({label}; cells counted from 0)"


def diagnose_notebook(nb: dict) -> str | None:
    """The failing cell of an executed notebook and its error, or the last cell started if the kernel
    died or a cell timed out; None if neither (also used by ``scripts/run_notebooks.py``)."""
    errors = _error_outputs(nb)
    if errors:
        i, out = errors[0]
        msg = f"{_describe_cell(nb, i)} raised {out.get('ename')}: {ANSI.sub('', str(out.get('evalue')))}"
        line = None
        for frame in out.get("traceback", []):
            for text in ANSI.sub("", frame).splitlines():
                m = re.match(r"^\s*-+>\s*(\d+)\s?(.*)$", text)
                if m:
                    line = f"line {m.group(1)}: {m.group(2).strip()}"
        return msg + (f", at {line}" if line else "")
    # papermill may mark every cell as finished after the kernel died: the culprit is the last one started
    cells = nb.get("cells", [])
    started = [i for i, c in enumerate(cells) if c.get("cell_type") == "code"
               and c.get("metadata", {}).get("papermill", {}).get("start_time")]
    if started:
        return f"{_describe_cell(nb, started[-1])}, the last cell started, did not finish: the kernel died or the cell timed out"
    return None


# ----------------------------------------------------------------------------- glued values


_NUMPY_SCALAR = re.compile(r"(?:np|numpy)\.(?:float|int|uint|complex|str_|bytes_)\d*_?\((.*)\)", re.S)
_NUMPY_BOOL = {"np.True_": True, "np.False_": False, "numpy.True_": True, "numpy.False_": False}
_TENSOR_SCALAR = re.compile(r"tensor\(([^,()]+)\)")
_NOT_SCALAR = object()
_SPECIAL_FLOAT = re.compile(r"[+-]?(?:(?:np|numpy|math)\.)?(?:nan|inf)", re.I)


def decode_glued(text: str):
    """The scalar a glued ``text/plain`` repr stands for (numpy and torch scalars included), or a marker if none."""
    text = text.strip()
    if text in _NUMPY_BOOL:
        return _NUMPY_BOOL[text]
    for pattern in (_NUMPY_SCALAR, _TENSOR_SCALAR):
        m = pattern.fullmatch(text)
        if m:
            text = m.group(1).strip()
    special = _SPECIAL_FLOAT.fullmatch(text)
    if special:  # repr of a float nan or infinity, which literal_eval does not read
        return float(special.group(0).replace("np.", "").replace("numpy.", "").replace("math.", ""))
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_SCALAR
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _NOT_SCALAR


def glued_scalars(nb: dict) -> dict[str, object]:
    """``{name: value}`` of every scalar glued with ``myst_nb.glue`` (the last glue of a name wins).

    A glue is a ``display_data`` output whose metadata ``scrapbook.name`` names it and whose data
    keys carry the ``scrapbook.mime_prefix``; a scalar is one whose only data is ``text/plain``.
    Figures, HTML and other rich objects are left out.
    """
    found: dict[str, object] = {}
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []) or []:
            record = (out.get("metadata") or {}).get("scrapbook")
            if out.get("output_type") != "display_data" or not isinstance(record, dict) or "name" not in record:
                continue
            prefix = record.get("mime_prefix", "")
            data = {k[len(prefix):]: v for k, v in (out.get("data") or {}).items() if k.startswith(prefix)}
            if set(data) != {"text/plain"}:
                found.pop(record["name"], None)
                continue
            text = data["text/plain"]
            value = decode_glued("".join(text) if isinstance(text, list) else text)
            if value is _NOT_SCALAR:
                found.pop(record["name"], None)
            else:
                found[record["name"]] = value
    return found


# ----------------------------------------------------------------------------- executors


def _visible_gpus() -> list[str]:
    """CUDA device ids this process sees, as ``CUDA_VISIBLE_DEVICES`` entries; [] when forced to the interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return []
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"],
        capture_output=True, text=True,
    )
    count = int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return listed[:count] if "CUDA_VISIBLE_DEVICES" in os.environ else [str(i) for i in range(count)]


def _local_slots(workers: int | None) -> list[dict]:
    """The environment of each local worker: one GPU each, or a share of the CPU cores."""
    gpus = _visible_gpus()
    if gpus:
        if workers is not None and workers > len(gpus):
            raise SweepError(f"--workers {workers}: only {len(gpus)} GPU(s) are visible, and each local worker owns one")
        return [{"CUDA_VISIBLE_DEVICES": gpu} for gpu in gpus[: workers or len(gpus)]]
    workers = workers or 1
    slot = {"TRITON_INTERPRET": "1"}
    if "OMP_NUM_THREADS" not in os.environ:
        slot["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    return [dict(slot) for _ in range(workers)]


def _run_local(tasks: dict[Run, Task], slots: list[dict]):
    """Yield ``(run, outcome)`` as runs finish, at most one run per worker slot (``_local_slots``) at a time."""
    free: queue.Queue = queue.Queue()
    for slot in slots:
        free.put(slot)

    def pinned(task: Task) -> Outcome:
        slot = free.get()
        try:
            return execute(dataclasses.replace(task, env={**task.env, **slot}))
        finally:
            free.put(slot)

    pool = ThreadPoolExecutor(max_workers=len(slots))
    try:
        futures = {pool.submit(pinned, task): run for run, task in tasks.items()}
        for future in as_completed(futures):
            yield futures[future], future.result()
    except BaseException:  # interrupted (or the consumer stopped): runs in flight end now, with their kernels
        _ABORT.set()
        raise
    finally:  # start no further run; wait for the runs in flight to end, however often Ctrl-C is pressed meanwhile
        _wait_uninterrupted(lambda: pool.shutdown(wait=True, cancel_futures=True))


def _wait_uninterrupted(wait) -> None:
    """Call ``wait()`` to its end: a KeyboardInterrupt (or SIGTERM) meanwhile calls it again, and is raised after it."""
    interrupted = None
    while True:
        try:
            wait()
            break
        except KeyboardInterrupt as exc:
            interrupted = interrupted or exc
            print("kvlab.sweep: stopping: ending the runs in flight and their kernels "
                  f"(at most {STOP_GRACE_S} s)", file=sys.stderr, flush=True)
    if interrupted is not None:
        raise interrupted


def _connect_dask(address: str):
    try:
        from distributed import Client
    except ImportError:
        raise SweepError("--executor dask needs the distributed package (pip install distributed)") from None
    try:
        client = Client(address, timeout=30)
    except Exception as exc:  # unreachable, or not an address at all (ValueError, TypeError, ...)
        raise SweepError(f"--address {address}: cannot reach a Dask scheduler there; give a scheduler's address "
                         f"such as tcp://host:8786 ({type(exc).__name__}: {exc})") from None
    workers = client.scheduler_info().get("workers", {})
    if not any(w.get("resources", {}).get(GPU_RESOURCE, 0) >= 1 for w in workers.values()):
        client.close()
        raise SweepError(
            f"--address {address}: no worker declares the resource {GPU_RESOURCE} (each run asks for "
            f"{GPU_RESOURCE}=1); start workers with `--resources {GPU_RESOURCE}=1`"
        )
    return client


def _run_dask(tasks: dict[Run, Task], client):
    """Yield ``(run, outcome)`` as the cluster finishes runs; each task asks for one GPU resource."""
    from distributed import as_completed as dask_completed

    futures = {}
    for run, task in tasks.items():
        future = client.submit(execute, task, resources={GPU_RESOURCE: 1}, pure=False,
                               key=f"kvlab-sweep-{run.key}-{os.urandom(4).hex()}")
        futures[future] = run
    try:
        for future in dask_completed(list(futures)):
            run = futures[future]
            try:
                yield run, future.result()
            except Exception as exc:  # the task itself died (worker lost, unpicklable result, ...)
                yield run, Outcome(False, 0.0, f"the Dask task failed: {type(exc).__name__}: {exc}", None)
    finally:
        client.cancel(list(futures))


# ----------------------------------------------------------------------------- sweep


@dataclasses.dataclass
class SweepResult:
    """What a sweep did: ``rows`` as written to ``results.csv``, and where the files are."""

    directory: Path
    columns: list[str]
    rows: list[dict]
    executed: int
    skipped: int
    failed: int
    plot: Path | None

    @property
    def ok(self) -> bool:
        return self.failed == 0


def _load_finished(path: Path, source_sha256: str, parameters: dict) -> dict | None:
    """The executed notebook at ``path`` if it is a successful run of this source with these parameters."""
    if not path.is_file():
        return None
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    record = nb.get("metadata", {}).get(METADATA_KEY, {})
    if (record.get("status") == "ok" and record.get("notebook_sha256") == source_sha256
            and _canonical(record.get("parameters")) == _canonical(_jsonable(parameters))):
        return nb
    return None


def _store(path: Path, outcome: Outcome, run: Run, source: Path, source_sha256: str) -> dict | None:
    """Write the executed notebook with its sweep record (atomically); return it as a dict."""
    if outcome.executed is None:
        path.unlink(missing_ok=True)  # a stale notebook of an earlier run must not stand for this one
        return None
    nb = json.loads(outcome.executed)
    meta = nb.setdefault("metadata", {})
    meta.setdefault("papermill", {})["input_path"] = str(source)
    meta[METADATA_KEY] = {
        "parameters": _jsonable(run.parameters),
        "notebook_sha256": source_sha256,
        "status": "ok" if outcome.ok else "failed",
        "duration_s": round(outcome.duration_s, 3),
        "error": outcome.error,
    }
    text = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    _replace_atomically(path, lambda fh: fh.write(text))
    return nb


def _row(run: Run, nb: dict | None, status: str, duration: float, error: str, notebook: str) -> dict:
    row = dict(run.parameters)
    for name, value in (glued_scalars(nb) if nb is not None else {}).items():
        row[f"glued.{name}" if name in run.parameters or name in STATUS_COLUMNS else name] = value
    row.update(status=status, duration_s=round(duration, 3), error=error, notebook=notebook)
    return row


def _cell(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    return str(value)


def _replace_atomically(path: Path, write) -> None:
    """``write(fh)`` into a temporary file of a name of its own beside ``path``, then rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as fh:  # whatever the locale: the table is read as UTF-8
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _table_lock(directory: Path):
    """One writer of ``directory``'s table at a time (other sweeps into the same folder wait)."""
    import fcntl

    with open(directory / ".results.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


TABLE_PARAMETERS = ".results.json"  # beside results.csv: which of its columns are the parameters


def _check_writable(directory: Path, out) -> None:
    """SweepError unless a file can be created in ``directory`` (a read-only folder fails before anything runs)."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".kvlab-sweep-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise SweepError(f"--out {out}: cannot write into {directory} ({exc.strerror or exc})") from None


def _read_table(directory: Path, parameters: list[str]) -> tuple[list[str], list[dict]]:
    """The columns and rows (cell text) of ``directory``'s results.csv; SweepError if its grid has other parameters."""
    path = directory / "results.csv"
    if not path.is_file():
        return [], []
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.reader(fh)
            header = next(reader, [])
            rows = [dict(zip(header, cells)) for cells in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise SweepError(f"--out: {path} cannot be read as a table ({exc}); the sweep merges its rows into it: "
                         "move it away or use another --out") from None
    try:
        known = json.loads((directory / TABLE_PARAMETERS).read_text(encoding="utf-8"))["parameters"]
    except (OSError, ValueError, KeyError, TypeError):
        known = header[: len(parameters)]  # a table written without the record: its first columns
    if sorted(known) != sorted(parameters):
        raise SweepError(f"--out: {path} holds runs over the parameters ({', '.join(known)}), this sweep is over "
                         f"({', '.join(parameters)}); its rows would not fit one table: use another --out "
                         "(or move that folder away)")
    return header, rows


def _write_csv(path: Path, columns: list[str], rows: list[dict], parameters: list[str]) -> list[str]:
    """Write ``rows`` into the table at ``path``, keeping the rows of other grid points already there.

    A row of the same parameter values replaces the old one in place; new ones follow in grid order. Returns the
    table's columns. One writer at a time (a lock file), each through a temporary file of its own.
    """
    directory = path.parent
    with _table_lock(directory):
        old_columns, old_rows = _read_table(directory, parameters)
        new_rows = [{c: (format_value(row[c]) if c in parameters else _cell(row[c])) for c in columns if c in row}
                    for row in rows]
        names = sorted(parameters)

        def key(row):
            return tuple(row.get(n, "") for n in names)

        fresh = {key(r): r for r in new_rows}
        merged = [fresh.pop(key(r), r) for r in old_rows]
        merged += [r for r in new_rows if key(r) in fresh]
        glued = [c for c in [*old_columns, *columns] if c not in parameters and c not in STATUS_COLUMNS]
        table = [*parameters, *dict.fromkeys(glued), *STATUS_COLUMNS]

        def write(fh):
            writer = csv.writer(fh)
            writer.writerow(table)
            for row in merged:
                writer.writerow([row.get(c, "") for c in table])

        _replace_atomically(directory / TABLE_PARAMETERS, lambda fh: json.dump({"parameters": parameters}, fh))
        _replace_atomically(path, write)
    return table


def sweep(
    notebook,
    grid: dict,
    out="sweeps",
    *,
    executor: str = "local",
    workers: int | None = None,
    address: str | None = None,
    force: bool = False,
    execution_timeout: int | None = None,
    plot: bool = True,
    progress: bool = True,
) -> SweepResult:
    """Run ``notebook`` over the cartesian product of ``grid`` (``{name: [values]}``); see the module doc."""
    source = Path(notebook)
    if source.suffix != ".ipynb" or not source.is_file():
        raise SweepError(f"notebook {str(notebook)!r} is not an .ipynb file")
    if executor not in EXECUTORS:
        raise SweepError(f"--executor must be one of {EXECUTORS}, got {executor!r}")
    if executor == "dask" and not address:
        raise SweepError("--executor dask needs --address ADDR, the scheduler's address (e.g. tcp://host:8786)")
    if executor == "local" and address:
        raise SweepError("--address is for --executor dask")
    if workers is not None and executor != "local":
        raise SweepError("--workers is for --executor local; a Dask cluster runs as many runs as its workers have GPUs")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise SweepError(f"--workers must be an integer >= 1, got {workers!r}")
    if execution_timeout is not None and (isinstance(execution_timeout, bool) or not isinstance(execution_timeout, int)
                                          or execution_timeout < 1):
        raise SweepError(f"--execution-timeout must be an integer >= 1 (seconds), got {execution_timeout!r}")
    source_bytes, source_nb = _read_notebook(source)
    defaults = notebook_parameters(source_nb)
    _check_grid(grid, defaults)
    runs = _grid_runs(grid)
    parameter_names = list(grid)

    directory = Path(out) / source.stem
    for folder in (Path(out), directory):
        if folder.exists() and not folder.is_dir():
            raise SweepError(f"--out {out}: {folder} exists and is not a folder")
    # every file the sweep writes must be a file or absent, so that no run is lost to a write failing at the end
    written = ["results.csv", "results.png", TABLE_PARAMETERS, ".results.lock", *(f"{run.key}.ipynb" for run in runs)]
    for name in written:
        if (directory / name).exists() and not (directory / name).is_file():
            raise SweepError(f"--out {out}: {directory / name} exists and is not a file; the sweep writes it: "
                             "move it away or use another --out")
    if directory.is_dir():
        _check_writable(directory, out)
    if (directory / "results.csv").exists():  # tables are replaced by renames: read without the lock, create nothing
        _read_table(directory, list(grid))  # a table of other parameters or unreadable: refused before anything runs
    source_sha256 = hashlib.sha256(source_bytes).hexdigest()
    finished: dict[Run, dict] = {}
    if not force:
        for run in runs:
            nb = _load_finished(directory / f"{run.key}.ipynb", source_sha256, run.parameters)
            if nb is not None:
                finished[run] = nb
    pending = [run for run in runs if run not in finished]
    text = source_bytes.decode("utf-8")
    tasks = {run: Task(source.name, text, _jsonable(run.parameters), {}, execution_timeout) for run in pending}

    # connect or plan the workers before anything runs, so a bad option fails with nothing done
    client = _connect_dask(address) if executor == "dask" and pending else None
    slots = _local_slots(workers) if executor == "local" and pending else []
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SweepError(f"--out {out}: cannot create the folder {directory} ({exc.strerror or exc})") from None
    _check_writable(directory, out)
    _ABORT.clear()

    rows: dict[Run, dict] = {}
    for run, nb in finished.items():
        record = nb["metadata"][METADATA_KEY]
        rows[run] = _row(run, nb, "ok", record.get("duration_s", math.nan), "", f"{run.key}.ipynb")

    failed = 0
    if pending:
        from tqdm import tqdm

        bar = tqdm(total=len(runs), initial=len(finished), unit="run", desc=source.stem,
                   file=sys.stderr, disable=not progress, dynamic_ncols=True)
        results = _run_dask(tasks, client) if client is not None else _run_local(tasks, slots)
        try:
            for run, outcome in results:
                path = directory / f"{run.key}.ipynb"
                nb = _store(path, outcome, run, source, source_sha256)
                status = "ok" if outcome.ok else "failed"
                rows[run] = _row(run, nb, status, outcome.duration_s, outcome.error, path.name if nb else "")
                if not outcome.ok:
                    failed += 1
                    where = f"\n    executed notebook: {path}" if nb is not None else ""
                    log = "\n".join("      " + line for line in outcome.log_tail.splitlines())
                    bar.write(f"kvlab.sweep: run {run.describe()} FAILED after {outcome.duration_s:.1f}s"
                              f"{' on ' + outcome.host if client is not None and outcome.host else ''}\n"
                              f"    {outcome.error}{where}" + (f"\n    last lines of papermill's log:\n{log}" if log else ""),
                              file=sys.stderr)
                bar.set_postfix(failed=failed, refresh=False)
                bar.update(1)
        except BaseException:
            _ABORT.set()  # runs in flight end now, with their kernels; results.csv stays as it was
            raise
        finally:
            results.close()
            bar.close()
            if client is not None:
                client.close()

    ordered = [rows[run] for run in runs]
    glued = list(dict.fromkeys(k for row in ordered for k in row if k not in parameter_names and k not in STATUS_COLUMNS))
    columns = [*parameter_names, *glued, *STATUS_COLUMNS]
    columns = _write_csv(directory / "results.csv", columns, ordered, parameter_names)
    plot_path = plot_results(ordered, parameter_names, directory / "results.png") if plot else None
    if plot_path is None:
        (directory / "results.png").unlink(missing_ok=True)  # no plot of an earlier sweep stands for this one
    return SweepResult(directory, columns, ordered, len(pending), len(finished), failed, plot_path)


# ----------------------------------------------------------------------------- default plot


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plot_results(rows: list[dict], parameters: list[str], path) -> Path | None:
    """One panel per glued number that varies over the successful runs (at most 12), against a parameter.

    The x axis is the first parameter with numeric values that vary (else the first that varies,
    as categories); each other varying parameter combination is one line. A panel's y axis is
    logarithmic when its values are positive and span more than a factor of 10. Returns the path,
    or None when there is nothing to plot (no successful run or no glued number).
    """
    rows = [r for r in rows if r.get("status") == "ok"]
    names = list(dict.fromkeys(k for r in rows for k in r if k not in parameters and k not in STATUS_COLUMNS))
    numeric = [n for n in names if all(_is_number(r.get(n)) for r in rows)]
    varying = [n for n in numeric if len({r[n] for r in rows}) > 1]
    metrics_ = (varying or numeric)[:MAX_PLOT_PANELS]
    if not rows or not metrics_:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    def distinct(name):
        return list(dict.fromkeys(_canonical(_jsonable(r[name])) for r in rows))

    moving = [p for p in parameters if len(distinct(p)) > 1]
    numeric_x = [p for p in moving if all(_is_number(r[p]) for r in rows)]
    x_name = (numeric_x or moving or parameters)[0]
    categories = None if x_name in numeric_x else distinct(x_name)
    series_names = [p for p in moving if p != x_name]

    ncols = min(3, len(metrics_))
    nrows = math.ceil(len(metrics_) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    groups: dict[str, list[dict]] = {}
    for r in rows:
        label = ", ".join(f"{p}={format_value(r[p])}" for p in series_names) or None
        groups.setdefault(label, []).append(r)
    for ax, metric in zip(axes.flat, metrics_):
        for label, members in groups.items():
            if categories is None:
                pts = sorted((r[x_name], r[metric]) for r in members)
            else:
                pts = sorted((categories.index(_canonical(_jsonable(r[x_name]))), r[metric]) for r in members)
            ax.plot(*zip(*pts), marker="o", ms=4, lw=1, label=label)
        values = [r[metric] for r in rows]
        if min(values) > 0 and max(values) > 10 * min(values):
            ax.set_yscale("log")
        if categories is not None:
            ax.set_xticks(range(len(categories)), [format_value(json.loads(c)) for c in categories])
        elif all(isinstance(r[x_name], int) for r in rows) and len(distinct(x_name)) <= 12:
            ax.set_xticks(sorted({r[x_name] for r in rows}))
        ax.set_xlabel(x_name)
        ax.set_title(metric, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics_):]:
        ax.set_visible(False)
    if series_names:
        handles, labels = axes[0, 0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False)
        legend_rows = math.ceil(len(labels) / min(4, len(labels)))
        fig.tight_layout(rect=(0, min(0.4, 0.05 * legend_rows / nrows + 0.02), 1, 1))
    else:
        fig.tight_layout()
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")  # a name of its own
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return path


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
        source = Path(args.notebook)
        if source.suffix != ".ipynb" or not source.is_file():
            raise SweepError(f"notebook {args.notebook!r} is not an .ipynb file")
        defaults = notebook_parameters(_read_notebook(source)[1])
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


if __name__ == "__main__":
    # Run the importable copy, so Dask pickles execute() and Task by reference to kvlab.sweep, not __main__.
    from kvlab.sweep import main as _main

    sys.exit(_main())
