"""``sweep``: a notebook over a grid, every run's glued scalars in one table (``results.csv``), and the default plot."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from . import executors as X
from .grid import (
    Run, SweepError, canonical, check_grid, format_value, grid_runs, notebook_parameters, notebook_path,
    read_notebook,
)
from .run import ABORT, Outcome, Task, glued_scalars, jsonable


EXECUTORS = ("local", "dask")
STATUS_COLUMNS = ("status", "duration_s", "error", "notebook")
METADATA_KEY = "kvlab_sweep"
MAX_PLOT_PANELS = 12


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
            and canonical(record.get("parameters")) == canonical(jsonable(parameters))):
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
        "parameters": jsonable(run.parameters),
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once: os.umask can only be read by setting it


def _mode_of(path: Path) -> int:
    """The permissions a file written at ``path`` gets: those of the file it replaces, else the umask's (a temporary
    file is created private)."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        return 0o666 & ~_UMASK


def _replace_atomically(path: Path, write) -> None:
    """``write(fh)`` into a temporary file of a name of its own beside ``path``, then rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as fh:  # whatever the locale: the table is read as UTF-8
            write(fh)
        os.chmod(tmp, _mode_of(path))
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
    source = notebook_path(notebook)
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
    source_bytes, source_nb = read_notebook(source)
    defaults = notebook_parameters(source_nb)
    check_grid(grid, defaults)
    runs = grid_runs(grid)
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
    tasks = {run: Task(source.name, text, jsonable(run.parameters), {}, execution_timeout) for run in pending}

    # connect or plan the workers before anything runs, so a bad option fails with nothing done
    client = X.connect_dask(address) if executor == "dask" and pending else None
    slots = X.local_slots(workers) if executor == "local" and pending else []
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SweepError(f"--out {out}: cannot create the folder {directory} ({exc.strerror or exc})") from None
    _check_writable(directory, out)
    ABORT.clear()

    rows: dict[Run, dict] = {}
    for run, nb in finished.items():
        record = nb["metadata"][METADATA_KEY]
        rows[run] = _row(run, nb, "ok", record.get("duration_s", math.nan), "", f"{run.key}.ipynb")

    failed = 0
    if pending:
        from tqdm import tqdm

        bar = tqdm(total=len(runs), initial=len(finished), unit="run", desc=source.stem,
                   file=sys.stderr, disable=not progress, dynamic_ncols=True)
        results = X.run_dask(tasks, client) if client is not None else X.run_local(tasks, slots)
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
            ABORT.set()  # runs in flight end now, with their kernels; results.csv stays as it was
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
        return list(dict.fromkeys(canonical(jsonable(r[name])) for r in rows))

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
                pts = sorted((categories.index(canonical(jsonable(r[x_name]))), r[metric]) for r in members)
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
        os.chmod(tmp, _mode_of(path))
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return path
