"""One run of a sweep (locally or on a Dask worker): papermill in a process of its own, the outcome, and the
scalars the executed notebook glues."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]  # the repository root: kernels run here
PAPERMILL_TAGS = {"papermill-error-cell-tag", "injected-parameters"}
# seconds a run's kernel may take to start (papermill's default, 60, is too short for several runs
# starting at once on a small, busy machine)
KERNEL_START_TIMEOUT = 300
# A kernel that dies before its first reply never ran a cell (several kernels starting at once can
# race for the same ports): such a run is started again, up to this many attempts in all.
KERNEL_START_ATTEMPTS = 3
KERNEL_START_FAILURE = "Kernel died before replying to kernel_info"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


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


def jsonable(value):
    """``value`` with tuples as lists, as JSON and YAML store it."""
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
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
                   "-y", yaml.safe_dump(jsonable(task.parameters))]
            if task.execution_timeout is not None:
                cmd += ["--execution-timeout", str(task.execution_timeout)]
            for _ in range(KERNEL_START_ATTEMPTS):
                proc = _papermill(cmd, env, Path(tmp) / "papermill.log")
                if dst.is_file() or KERNEL_START_FAILURE not in proc.stdout:
                    break
            executed = dst.read_text(encoding="utf-8") if dst.is_file() else None
    except Exception as exc:  # the run could not even start: report it as this run's failure
        return Outcome(False, time.monotonic() - start, f"could not run papermill: {type(exc).__name__}: {exc}", None, host=host)
    if ABORT.is_set():
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


ABORT = threading.Event()  # set when the sweep stops early: runs in flight are ended, no other starts
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
    """Run papermill in its own session; if the sweep stops (an exception here, ``ABORT``), end it and its kernel."""
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
                    if ABORT.is_set():
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
