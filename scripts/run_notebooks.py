#!/usr/bin/env python3
"""Execute the book's notebooks with papermill, then build the book.

Every `_toc.yml` entry under `book/executed/` names a notebook: `book/executed/<name>` is
executed from `notebooks/<name>.ipynb` into `book/executed/<name>.ipynb`. The kernel runs in
the repository root with the root on PYTHONPATH (so `import kvlab` works), and with
TRITON_INTERPRET=1 when torch sees no CUDA device (decided once, before any kernel starts).

Notebook defaults are CPU-sized; `--full` passes `-p small False` to every notebook.

`--jobs N` executes up to N notebooks at once (each in its own kernel), the longest first (`LONGEST`), then in
the order of `_toc.yml`; a notebook whose parameters cell defines `executed_dir` reads the executed chapters,
so it starts only after every other notebook has finished.

A notebook fails when papermill exits non-zero (a dead kernel exits non-zero even when the
output looks complete) or when the executed copy holds an error output. A failure names the
notebook and the failing cell, removes that notebook's executed copy from book/executed/
(the failed run is kept under _build/notebooks/ for inspection) and stops before the book
build, so no page with a traceback is built.

After all notebooks pass, runs `jupyter-book build --all -W --keep-going .` (skip with
--no-build).

`--record FILE` writes what each notebook did (status, seconds, the failing cell) with the device, the
versions, the date, the command and a fingerprint of the code it ran (the page's cells and the kvlab
package), as JSON, after every notebook (so a run cut short keeps what it finished); with it, a failure
does not stop the other notebooks (the exit code still says it). `--update` merges the run into FILE's
existing record (same device and parameters, else an error that leaves FILE as it was), replacing the
entries of the pages run again: `results/book_full_<machine>.json` holds the last full-size run of each page
on one machine (page 12 shows them all).
`--page-timeout S` stops a notebook that runs longer than S seconds (a failure: "timeout").
`--save-results DIR` passes `-p save_results DIR/<name>.json` to each notebook whose parameters cell defines
`save_results` (the pages that write the results of a full-size run, e.g. `results/perplexity_h200.json`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
TOC = ROOT / "_toc.yml"
SOURCES = ROOT / "notebooks"
EXECUTED = ROOT / "book" / "executed"
WORK = ROOT / "_build" / "notebooks"
BIN = Path(sys.executable).parent
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class NotebookError(Exception):
    pass


def machine_facts(env: dict[str, str]) -> dict[str, str]:
    """The device and the versions of python, torch, triton and transformers that the kernels run with."""
    probe = subprocess.run(
        [sys.executable, "-c", "import json, platform, torch, triton, transformers; print(json.dumps({"
         "'device': torch.cuda.get_device_name() if torch.cuda.is_available() else "
         "f'{platform.processor() or platform.machine()}, {__import__(\"os\").cpu_count()} CPUs, no GPU', "
         "'python': platform.python_version(), 'torch': torch.__version__, 'triton': triton.__version__, "
         "'transformers': transformers.__version__}))"],
        capture_output=True, text=True, env=env)
    return json.loads(probe.stdout) if probe.returncode == 0 else {"device": "unknown"}


class Record:
    """The JSON record of a run (``--record``): one entry per notebook, rewritten after each.

    Each entry holds the page's status and seconds, the date, the command, the versions and the code it ran
    (``kvlab.study.fingerprint.source_fingerprint``: the page's cells and the kvlab package). With ``update``
    the entries join the record already in ``path``, which must be of the same device and parameters, and
    replace the entries of the pages run again, so the file holds the last run of each page."""

    def __init__(self, path: Path, env: dict[str, str], params: list[str], update: bool = False):
        import platform
        import threading

        facts = machine_facts(env)
        device, parameters = facts.pop("device"), " ".join(params) or "(notebook defaults)"
        self.lock = threading.Lock()
        self.path = path
        self.command = "python scripts/run_notebooks.py " + " ".join(sys.argv[1:])
        self.versions = facts
        self.sources: dict[str, dict[str, str]] = {}
        self.order = {name: i for i, name in enumerate(executed_names())}
        head = {"date": self.now(), "device": device, "versions": facts,
                "machine": f"{platform.platform()}, {os.cpu_count()} CPUs", "parameters": parameters}
        if update and path.is_file():
            self.data = json.loads(path.read_text())
            for key in ("device", "parameters"):
                if self.data.get(key) != head[key]:
                    raise NotebookError(
                        f"--update: {path} records runs with {key} {self.data.get(key)!r}, this run's is {head[key]!r}; "
                        f"write a new record instead (the file is unchanged)")
            self.data.update(head)
        else:
            self.data = {"what": "the last execution of each page named here: status, seconds and the code it ran",
                         **head, "pages": []}
            self.write()

    @staticmethod
    def now() -> str:
        import datetime

        return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    def begin(self, name: str, src: Path) -> None:
        """Fingerprint the code a page is about to run (before it runs: a run takes minutes)."""
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        try:
            from kvlab.study.fingerprint import source_fingerprint
        except Exception as exc:  # a package that does not import: say so instead of a traceback
            raise NotebookError(f"{name}: cannot fingerprint the code it runs, kvlab does not import: {exc!r}") from exc
        self.sources[name] = source_fingerprint(src)

    def add(self, name: str, status: str, seconds: float, error: str = "") -> None:
        entry = {"page": name, "status": status, "seconds": round(seconds, 1), "error": error, "date": self.now(),
                 "command": self.command, "versions": self.versions, "source": self.sources.get(name)}
        with self.lock:  # notebooks finish in threads (--jobs)
            pages = [e for e in self.data["pages"] if e["page"] != name] + [entry]
            self.data["pages"] = sorted(pages, key=lambda e: self.order.get(e["page"], len(self.order)))
            self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        tmp.replace(self.path)


RECORD: Record | None = None
PAGE_TIMEOUT: float | None = None
SAVE_DIR: Path | None = None


def log(msg: str) -> None:
    print(f"run_notebooks: {msg}", flush=True)


def toc_files(node) -> list[str]:
    """All `file:` entries of a jb-book toc, in order (root, parts, chapters, sections)."""
    found: list[str] = []
    if isinstance(node, dict):
        for key in ("root", "file"):
            if isinstance(node.get(key), str):
                found.append(node[key])
        for value in node.values():
            if isinstance(value, (list, dict)):
                found.extend(toc_files(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(toc_files(item))
    return found


def executed_names() -> list[str]:
    """Notebook names (paths relative to book/executed, without suffix) listed in _toc.yml."""
    toc = yaml.safe_load(TOC.read_text())
    prefix = "book/executed/"
    names = []
    for entry in toc_files(toc):
        entry = entry.strip().removesuffix(".ipynb")
        if entry.startswith(prefix) and entry[len(prefix):] not in names:
            names.append(entry[len(prefix):])
    return names


def parameters_source(name: str, src: Path) -> str:
    """The source of the cell tagged `parameters` (it must define `small`)."""
    nb = json.loads(src.read_text())
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            source = "".join(cell.get("source", ""))
            if re.search(r"^\s*small\s*=", source, re.M):
                return source
            raise NotebookError(f"{name}: the cell tagged 'parameters' does not define `small`")
    raise NotebookError(f"{name}: no code cell tagged 'parameters' (it must define `small`)")


def reads_executed(name: str) -> bool:
    """Whether a notebook reads the executed chapters (its parameters cell defines `executed_dir`)."""
    src = SOURCES / f"{name}.ipynb"
    return src.is_file() and bool(re.search(r"^\s*executed_dir\s*=", parameters_source(name, src), re.M))


# The CPU-sized run's longest notebooks (100 to 300 s each on a 2-core machine, the others under a minute), started
# first when several run at once so that the jobs end together.
LONGEST = ("03_perplexity", "09_keys_at_three_bits", "16_second_model", "08_mixed_precision", "13_generation",
           "15_transform_codec", "11_sweeps")


def run_all(names: list[str], env: dict[str, str], params: list[str], jobs: int) -> None:
    """Execute the notebooks, up to `jobs` at once (the longest first); those that read the executed chapters after
    all others. On a failure no further notebook starts; the first failure is raised once the running ones finish."""
    first = [n for n in names if not reads_executed(n)]
    last = [n for n in names if n not in first]
    if jobs > 1:
        first.sort(key=lambda n: LONGEST.index(n) if n in LONGEST else len(LONGEST))
    if jobs <= 1:
        errors = []
        for name in first + last:
            try:
                run_notebook(name, env, params)
            except NotebookError as exc:
                if RECORD is None:
                    raise
                errors.append(exc)
        if errors:
            raise errors[0]
        return
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    errors: list[NotebookError] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for batch in (first, last):
            queue, running = list(batch), set()
            stop = lambda: bool(errors) and RECORD is None  # recording: the other notebooks still run
            while (queue and not stop()) or running:
                while queue and not stop() and len(running) < jobs:
                    running.add(pool.submit(run_notebook, queue.pop(0), env, params))
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    try:
                        future.result()
                    except NotebookError as exc:
                        errors.append(exc)
            if errors:
                raise errors[0]


def kernel_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(BIN), env.get("PATH", "")))
    env.setdefault("JUPYTER_PLATFORM_DIRS", "1")
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    # Busy-waiting OpenMP threads stall a 2-core machine between torch ops.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "TRITON_INTERPRET" not in env:
        probe = subprocess.run(
            [sys.executable, "-c", "import torch; print(int(torch.cuda.is_available()))"],
            capture_output=True, text=True, env=env,
        )
        if probe.returncode != 0:
            raise NotebookError(f"cannot import torch to look for a GPU:\n{probe.stderr.strip()}")
        if probe.stdout.strip() != "1":
            env["TRITON_INTERPRET"] = "1"
    return env


def error_outputs(nb: dict) -> list[tuple[int, dict, dict]]:
    """(cell index, cell, output) for every error output of a notebook."""
    found = []
    for i, cell in enumerate(nb.get("cells", [])):
        for out in cell.get("outputs", []) or []:
            if out.get("output_type") == "error":
                found.append((i, cell, out))
    return found


def diagnose(nb: dict | None) -> str:
    """The failing cell and its error (``kvlab.sweep.diagnose_notebook``, imported only on failure)."""
    if nb is None:
        return "no executed notebook was written"
    sys.path.insert(0, str(ROOT))
    from kvlab.sweep import diagnose_notebook

    return diagnose_notebook(nb) or "no cell was executed"


def hide_injected_parameters(nb: dict) -> None:
    """Tag the cell papermill adds for ``-p`` parameters ``remove-cell``: the page shows what it ran, not how it was called."""
    for cell in nb["cells"]:
        tags = cell.setdefault("metadata", {}).setdefault("tags", [])
        if "injected-parameters" in tags and "remove-cell" not in tags:
            tags.append("remove-cell")


KERNEL_DIED = "Kernel died before replying to kernel_info"  # jupyter_client: no cell ran


def run_notebook(name: str, env: dict[str, str], params: list[str]) -> None:
    src = SOURCES / f"{name}.ipynb"
    dst = EXECUTED / f"{name}.ipynb"
    tmp = WORK / f"{name}.ipynb"
    logfile = WORK / f"{name}.log"
    if not src.is_file():
        raise NotebookError(f"{name}: _toc.yml lists book/executed/{name} but {src.relative_to(ROOT)} does not exist")
    parameters = parameters_source(name, src)  # checks that the notebook has its parameters cell
    if RECORD is not None:
        RECORD.begin(name, src)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.unlink(missing_ok=True)
    if SAVE_DIR is not None and re.search(r"^\s*save_results\s*=", parameters, re.M):
        params = [*params, "-p", "save_results", str(SAVE_DIR / f"{name}.json")]
    cmd = [sys.executable, "-m", "papermill", str(src), str(tmp),
           "--cwd", str(ROOT), "--kernel", "python3", "--no-progress-bar",
           "--log-level", "WARNING", *params]
    start = time.monotonic()
    for attempt in (1, 2):  # kernels started at the same moment (--jobs) can die before they start: start it again
        timed_out = False
        with open(logfile, "w") as fh:
            proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
            try:
                left = None if PAGE_TIMEOUT is None else max(1.0, PAGE_TIMEOUT - (time.monotonic() - start))
                rc = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:  # papermill and its kernel, which runs in papermill's session
                os.killpg(proc.pid, signal.SIGKILL)
                rc, timed_out = proc.wait(), True
        if rc == 0 or timed_out or attempt == 2 or KERNEL_DIED not in logfile.read_text(errors="replace"):
            break
        log(f"{src.relative_to(ROOT)}: its kernel died before it started; starting it again")
        tmp.unlink(missing_ok=True)
    elapsed = time.monotonic() - start
    nb = json.loads(tmp.read_text()) if tmp.is_file() and not timed_out else None
    failed = rc != 0 or nb is None or bool(error_outputs(nb))
    if failed:
        dst.unlink(missing_ok=True)
        if RECORD is not None:
            RECORD.add(name, "timeout" if timed_out else "failed", elapsed,
                       f"stopped after {PAGE_TIMEOUT:.0f} s" if timed_out else diagnose(nb))
        tail = "\n".join("      " + l for l in ANSI.sub("", logfile.read_text()).splitlines()[-15:])
        raise NotebookError(
            f"notebook {src.relative_to(ROOT)} FAILED after {elapsed:.1f}s (papermill exit code {rc})\n"
            f"  {diagnose(nb)}\n"
            f"  executed copy kept at {tmp.relative_to(ROOT)}, log at {logfile.relative_to(ROOT)}\n"
            f"  last lines of the log:\n{tail}"
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    hide_injected_parameters(nb)
    dst.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    tmp.unlink()
    if RECORD is not None:
        RECORD.add(name, "ok", elapsed)
    log(f"{src.relative_to(ROOT)} -> {dst.relative_to(ROOT)} ok ({elapsed:.1f}s)")


def build_book() -> None:
    jb = BIN / "jupyter-book"
    cmd = [str(jb) if jb.exists() else "jupyter-book", "build", "--all", "-W", "--keep-going", "."]
    log("$ " + " ".join(["jupyter-book", *cmd[1:]]))
    start = time.monotonic()
    env = dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1")
    env.setdefault("JUPYTER_PLATFORM_DIRS", "1")
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    if rc != 0:
        raise NotebookError(f"jupyter-book build failed (exit code {rc})")
    log(f"book built in {time.monotonic() - start:.1f}s: {(ROOT / '_build' / 'html' / 'index.html').relative_to(ROOT)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="run only these notebooks (names under book/executed/)")
    ap.add_argument("--full", action="store_true", help="full-size run: pass `-p small False` to every notebook")
    ap.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                    help="extra papermill parameter for every notebook (repeatable)")
    ap.add_argument("--no-build", action="store_true", help="execute the notebooks only")
    ap.add_argument("--jobs", "-j", type=int, default=1, metavar="N", help="notebooks executed at once (default 1)")
    ap.add_argument("--record", type=Path, metavar="FILE", help="write each notebook's status and seconds as JSON")
    ap.add_argument("--update", action="store_true",
                    help="with --record: replace these pages' entries in FILE's record, keeping the other pages'")
    ap.add_argument("--page-timeout", type=float, metavar="S", help="stop a notebook after S seconds")
    ap.add_argument("--save-results", type=Path, metavar="DIR", help="where pages with a save_results parameter write")
    args = ap.parse_args()
    global RECORD, PAGE_TIMEOUT, SAVE_DIR
    if args.save_results is not None:
        args.save_results.mkdir(parents=True, exist_ok=True)
        SAVE_DIR = args.save_results.resolve()
    if args.page_timeout is not None and not args.page_timeout > 0:
        ap.error(f"--page-timeout must be a positive number of seconds, got {args.page_timeout}")
    PAGE_TIMEOUT = args.page_timeout
    if args.update and args.record is None:
        ap.error("--update needs --record FILE")

    try:
        names = executed_names()
        if args.names:
            unknown = sorted(set(args.names) - set(names))
            if unknown:
                raise NotebookError(f"not in _toc.yml under book/executed/: {', '.join(unknown)}")
            names = [n for n in names if n in args.names]
        params: list[str] = ["-p", "small", "False"] if args.full else []
        for key, value in args.parameter:
            params += ["-p", key, value]
        env = kernel_env()
        if args.record is not None:
            RECORD = Record(args.record.resolve(), env, params, update=args.update)
        log(f"{len(names)} notebook(s), {max(1, args.jobs)} at once; TRITON_INTERPRET={env.get('TRITON_INTERPRET', '(unset)')}; "
            f"parameters: {' '.join(params) or '(notebook defaults)'}")
        start = time.monotonic()
        run_all(names, env, params, args.jobs)
        log(f"{len(names)} notebook(s) executed in {time.monotonic() - start:.1f}s")
        if not args.no_build:
            build_book()
    except NotebookError as exc:
        print(f"run_notebooks: ERROR: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
