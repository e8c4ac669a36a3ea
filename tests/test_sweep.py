"""Parameter sweeps of a notebook (kvlab.sweep): grid, resume, failures, results table, executors.

The swept notebook is tests/data/sweep_point.ipynb: parameters ``small, a, b, label, fail_at,
exit_at``; it glues ``product = a * b``, a few strings and the environment its kernel saw, raises in
its last cell when ``a == fail_at`` and ends its kernel process there when ``a == exit_at``.
"""

import csv
import json
import math
import re
import shutil
from pathlib import Path

import pytest

from kvlab import sweep as S
from kvlab.sweep import executors as SX, run as SR

NOTEBOOK = Path(__file__).parent / "data" / "sweep_point.ipynb"


@pytest.fixture
def notebook(tmp_path):
    """A private copy of the test notebook (tests edit it)."""
    path = tmp_path / "sweep_point.ipynb"
    shutil.copy(NOTEBOOK, path)
    return path


@pytest.fixture
def cpu_only(monkeypatch):
    """The local executor sees no GPU, whatever the machine has."""
    monkeypatch.setattr(SX, "_visible_gpus", lambda: [])


def read_table(directory: Path) -> list[dict]:
    with open(directory / "results.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def sweep_args(notebook, out, *options):
    return [str(notebook), *options, "--out", str(out), "--no-progress"]


# ----------------------------------------------------------------------------- values and keys


@pytest.mark.parametrize("text, default, expected", [
    ("1,2,-3", 1, [1, 2, -3]),
    ("0.5, 1e-3, inf", 1.0, [0.5, 1e-3, math.inf]),
    ("2,2.5", 1.0, [2, 2.5]),  # a float parameter takes ints too
    ("True,false,TRUE", True, [True, False, True]),
    ("None,4", 1, [None, 4]),  # None is accepted whatever the default
    ("haar,hadamard", "haar", ["haar", "hadamard"]),
    ("3,'x, y'", "s", ["3", "x, y"]),  # a string parameter keeps a number's text; quotes protect commas
    ("[64, 128],[32]", [1], [[64, 128], [32]]),
    ("(1, 2)", None, [[1, 2]]),
    ("abc,1,None", None, ["abc", 1, None]),
])
def test_values_parse(text, default, expected):
    values = S.parse_axis("x", text, default)
    assert values == expected
    assert [type(v) for v in values] == [type(v) for v in expected]


@pytest.mark.parametrize("text, default, match", [
    ("", 1, "no values"),
    ("1,,2", 1, "empty value"),
    ("1,", 1, "empty value"),
    ("[1,2", 1, "unclosed bracket"),
    ("1]", None, "unbalanced"),
    ("'abc", "s", "unclosed quote"),
    ("[1, 2 3]", None, "cannot read"),
    ("abc", 1, "'abc' is a string, but the notebook's default x = 1 is an int"),
    ("1.5", 1, "is a float"),
    ("1", True, "is an int, but .* is a bool"),
    ("yes", 2.0, "is a string"),
    ("9" * 5000, None, "has 5000 digits; an int value has at most"),
    ("{1, 2}", None, "holds set; a value is None, a bool, a number, a string, or a list or dict"),
    ("[1, {2}]", [1], "holds set"),
    ("{1: 2}", None, "holds the dict key 1, which is not a string"),
])
def test_bad_values_are_named(text, default, match):
    with pytest.raises(S.SweepError, match=match):
        S.parse_axis("x", text, default)


@pytest.mark.parametrize("value", [1, -2, 0.1, 1e-30, math.inf, True, False, None, "haar", "3", "x, y", "None", "", [1, 2]])
def test_format_value_reads_back(value):
    default = "s" if isinstance(value, str) else None
    assert S.parse_axis("x", S.format_value(value), default) == [value]


def test_run_keys_readable_or_hashed():
    assert S.run_key({"bits": 2, "dim": 64, "rotation": "haar"}) == "bits=2__dim=64__rotation=haar"
    assert S.run_key({"small": False, "x": 0.5, "n": None}) == "small=False__x=0.5__n=None"
    odd = [{"kind": "a/b"}, {"kind": "a b"}, {"kinds": [1, 2]}, {"label": "x" * 200}]
    keys = [S.run_key(p) for p in odd]
    assert all(k.startswith("run-") for k in keys) and len(set(keys)) == len(keys)
    assert S.run_key({"a": 1}) != S.run_key({"a": 1.0}) != S.run_key({"a": "1.0"})


def test_glued_scalars_decoding():
    def glue(name, data, prefix="application/papermill.record/"):
        return {"output_type": "display_data", "data": {prefix + k: v for k, v in data.items()},
                "metadata": {"scrapbook": {"name": name, "mime_prefix": prefix}}}

    nb = {"cells": [{"cell_type": "code", "outputs": [
        glue("int", {"text/plain": "4"}),
        glue("float", {"text/plain": "np.float64(0.25)"}),
        glue("tensor", {"text/plain": "tensor(0.5000)"}),
        glue("flag", {"text/plain": "np.True_"}),
        glue("text", {"text/plain": "'nowhere'"}),
        glue("none", {"text/plain": "None"}),
        glue("shown", {"text/plain": "7"}, prefix=""),  # glue(..., display=True)
        glue("html", {"text/plain": "<IPython.core.display.HTML object>", "text/html": "<b>x</b>"}),
        glue("figure", {"text/plain": "<Figure size 640x480 with 1 Axes>", "image/png": "iVBOR"}),
        glue("array", {"text/plain": "array([1, 2])"}),
        glue("list", {"text/plain": "[1, 2]"}),
        {"output_type": "stream", "name": "stdout", "text": "3\n"},
        {"output_type": "display_data", "data": {"text/plain": "5"}, "metadata": {}},
    ]}, {"cell_type": "code", "outputs": [glue("int", {"text/plain": "5"})]}]}  # the last glue wins
    assert S.glued_scalars(nb) == {"int": 5, "float": 0.25, "tensor": 0.5, "flag": True, "text": "nowhere",
                                   "none": None, "shown": 7}


# ----------------------------------------------------------------------------- bad parameters: nothing runs


@pytest.mark.parametrize("options, match", [
    ([], "empty grid"),
    (["-p", "zz", "1"], "unknown parameter zz: the notebook's parameters cell assigns small, a, b, label, fail_at, exit_at"),
    (["-p", "a", ""], "-p a: no values"),
    (["-p", "a", "1,,2"], "-p a: empty value"),
    (["-p", "a", "[1,2"], "-p a: unclosed bracket"),
    (["-p", "a", "x"], "-p a: 'x' is a string"),
    (["-p", "a", "1", "-p", "a", "2"], "-p a is given twice"),
    (["-p", "a", "1,2,1"], "-p a: the value 1 is given twice"),
    (["-p", "a", "1", "--workers", "0"], "--workers must be an integer >= 1"),
    (["-p", "a", "1", "--executor", "dask"], "--executor dask needs --address"),
    (["-p", "a", "1", "--address", "tcp://127.0.0.1:1"], "--address is for --executor dask"),
    (["-p", "a", "1", "--executor", "dask", "--address", "tcp://127.0.0.1:1", "--workers", "2"], "--workers is for --executor local"),
])
def test_bad_parameters_fail_before_running(tmp_path, capsys, options, match):
    out = tmp_path / "out"
    assert S.main(sweep_args(NOTEBOOK, out, *options)) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlab.sweep: error: ") and match in err, err
    assert not out.exists()


def test_bad_notebooks(tmp_path, capsys):
    out = tmp_path / "out"
    assert S.main(sweep_args(tmp_path / "missing.ipynb", out, "-p", "a", "1")) == 2
    assert "missing.ipynb': no such file" in capsys.readouterr().err
    (tmp_path / "page.txt").write_text("")
    assert S.main(sweep_args(tmp_path / "page.txt", out, "-p", "a", "1")) == 2
    assert "is not an .ipynb file" in capsys.readouterr().err
    nb = json.loads(NOTEBOOK.read_text())
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("tags", None)
    untagged = tmp_path / "untagged.ipynb"
    untagged.write_text(json.dumps(nb))
    assert S.main(sweep_args(untagged, out, "-p", "a", "1")) == 2
    assert "no code cell tagged 'parameters'" in capsys.readouterr().err
    assert not out.exists()


def test_more_workers_than_gpus(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(SX, "_visible_gpus", lambda: ["0", "1"])
    out = tmp_path / "out"
    assert S.main(sweep_args(NOTEBOOK, out, "-p", "a", "1", "--workers", "3")) == 2
    assert "--workers 3: only 2 GPU(s) are visible" in capsys.readouterr().err
    assert not out.exists()


# ----------------------------------------------------------------------------- sweeps that run


def _kernels_failing_to_start(monkeypatch, failures):
    """Make the first ``failures`` papermill calls end as a kernel that died before its first reply."""
    import subprocess

    real, calls = SR._papermill, []

    def run(cmd, env, log):
        calls.append(cmd)
        if len(calls) <= failures:
            return subprocess.CompletedProcess(cmd, 1, stdout=f"Traceback ...\nRuntimeError: {S.KERNEL_START_FAILURE}\n")
        return real(cmd, env, log)

    monkeypatch.setattr(SR, "_papermill", run)
    return calls


def test_a_kernel_that_dies_before_starting_is_started_again(notebook, tmp_path, monkeypatch, cpu_only):
    calls = _kernels_failing_to_start(monkeypatch, S.KERNEL_START_ATTEMPTS - 1)
    result = S.sweep(notebook, {"a": [2]}, tmp_path / "out", progress=False)
    assert (result.executed, result.failed) == (1, 0) and len(calls) == S.KERNEL_START_ATTEMPTS
    b = S.notebook_parameters(json.loads(notebook.read_text()))["b"]
    assert float(read_table(tmp_path / "out" / "sweep_point")[0]["product"]) == 2 * b


def test_a_kernel_that_never_starts_fails_the_run(notebook, tmp_path, monkeypatch, capsys, cpu_only):
    calls = _kernels_failing_to_start(monkeypatch, S.KERNEL_START_ATTEMPTS)
    result = S.sweep(notebook, {"a": [2]}, tmp_path / "out", progress=False)
    assert (result.executed, result.failed) == (1, 1) and len(calls) == S.KERNEL_START_ATTEMPTS
    assert S.KERNEL_START_FAILURE in capsys.readouterr().err


def test_grid_runs_once_and_resumes(notebook, tmp_path, capsys, cpu_only):
    out = tmp_path / "out"
    assert S.main(sweep_args(notebook, out, "-p", "a", "1,2", "-p", "b", "3,0.5", "--workers", "2")) == 0
    directory = out / "sweep_point"
    keys = ["a=1__b=3", "a=1__b=0.5", "a=2__b=3", "a=2__b=0.5"]
    assert sorted(p.stem for p in directory.glob("*.ipynb")) == sorted(keys)
    rows = read_table(directory)
    assert [r["notebook"] for r in rows] == [f"{k}.ipynb" for k in keys]  # grid order, last axis fastest
    assert [(r["a"], r["b"], float(r["product"])) for r in rows] == [
        ("1", "3", 3.0), ("1", "0.5", 0.5), ("2", "3", 6.0), ("2", "0.5", 1.0)]
    assert all(r["status"] == "ok" and r["error"] == "" and float(r["duration_s"]) > 0 for r in rows)
    assert all(r["label_text"] == "x" and r["is_small"] == "True" for r in rows)  # str and bool glues
    assert all(r["triton_interpret"] == "1" and r["cwd_is_repository_root"] == "True" for r in rows)
    header = list(rows[0])
    assert header[:2] == ["a", "b"] and header[-4:] == ["status", "duration_s", "error", "notebook"]
    assert "table" not in header  # a glued HTML object is not a scalar
    assert (directory / "results.png").stat().st_size > 0
    executed = json.loads((directory / "a=2__b=0.5.ipynb").read_text())
    assert executed["metadata"]["kvlab_sweep"]["parameters"] == {"a": 2, "b": 0.5}
    assert executed["metadata"]["kvlab_sweep"]["status"] == "ok"
    assert "4 ok (0 already finished, skipped), 0 failed" in capsys.readouterr().out

    # rerun: every run is finished, nothing executes, the table is the same
    stamps = {p.name: p.stat().st_mtime_ns for p in directory.glob("*.ipynb")}
    result = S.sweep(notebook, {"a": [1, 2], "b": [3, 0.5]}, out, workers=2, progress=False)
    assert (result.executed, result.skipped, result.failed) == (0, 4, 0)
    assert {p.name: p.stat().st_mtime_ns for p in directory.glob("*.ipynb")} == stamps
    assert read_table(directory) == rows

    # an edited notebook reruns every point
    nb = json.loads(notebook.read_text())
    nb["cells"][2]["source"] = "".join(nb["cells"][2]["source"]).replace("a * b", "a * b + 1")
    notebook.write_text(json.dumps(nb))
    result = S.sweep(notebook, {"a": [1, 2], "b": [3, 0.5]}, out, workers=2, progress=False)
    assert (result.executed, result.skipped, result.failed) == (4, 0, 0)
    assert [float(r["product"]) for r in read_table(directory)] == [4.0, 1.5, 7.0, 2.0]


def test_failing_points_are_reported_and_the_rest_complete(tmp_path, capsys, cpu_only):
    out = tmp_path / "out"
    options = ["-p", "a", "1,2,3", "-p", "fail_at", "2", "-p", "exit_at", "3", "--workers", "2"]
    assert S.main(sweep_args(NOTEBOOK, out, *options)) == 1
    captured = capsys.readouterr()
    # a cell that raises: the parameters, the cell and the error
    assert "run a=2, fail_at=2, exit_at=3 FAILED" in captured.err
    assert "cell 3 (In [4]; cells counted from 0) raised ValueError: a is 2, the failing point" in captured.err
    # a kernel that dies: the parameters, the last cell started and papermill's log
    assert "run a=3, fail_at=2, exit_at=3 FAILED" in captured.err
    # (the kernel may die before it reports the cell's execution count)
    assert re.search(r"cell 3 \((In \[4\]|no execution count); cells counted from 0\), the last cell started, "
                     r"did not finish: the kernel died", captured.err), captured.err
    assert "DeadKernelError" in captured.err
    assert "1 ok (0 already finished, skipped), 2 failed" in captured.out
    directory = out / "sweep_point"
    rows = read_table(directory)
    assert [r["status"] for r in rows] == ["ok", "failed", "failed"]
    assert [r["product"] for r in rows] == ["2.0", "4.0", "6.0"]  # glued before the failing cell
    assert "ValueError: a is 2" in rows[1]["error"] and "did not finish" in rows[2]["error"] and rows[0]["error"] == ""
    failed = json.loads((directory / "a=2__fail_at=2__exit_at=3.ipynb").read_text())
    assert failed["metadata"]["kvlab_sweep"]["status"] == "failed"
    # a rerun retries the failed points only
    result = S.sweep(NOTEBOOK, {"a": [1, 2, 3], "fail_at": [2], "exit_at": [3]}, out, workers=2, progress=False)
    assert (result.executed, result.skipped, result.failed) == (2, 1, 2) and not result.ok


def test_local_workers_are_pinned_to_one_gpu_each(tmp_path, monkeypatch):
    monkeypatch.setattr(SX, "_visible_gpus", lambda: ["3", "5"])
    result = S.sweep(NOTEBOOK, {"a": [1, 2]}, tmp_path / "out", progress=False, plot=False)
    assert result.ok and result.plot is None
    assert sorted(r["cuda_visible_devices"] for r in result.rows) == ["3", "5"]


def test_dask_executor_asks_each_run_for_one_gpu(tmp_path, capsys):
    import distributed

    out = tmp_path / "out"
    # one worker with two threads but one GPU: runs that ask for GPU=1 must not overlap
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                  resources={"GPU": 1}, dashboard_address=None) as cluster:
        rc = S.main(sweep_args(NOTEBOOK, out, "-p", "a", "1,2", "-p", "b", "3",
                               "--executor", "dask", "--address", cluster.scheduler_address))
    assert rc == 0, capsys.readouterr().err
    directory = out / "sweep_point"
    rows = read_table(directory)
    assert [(r["a"], r["product"], r["status"]) for r in rows] == [("1", "3", "ok"), ("2", "6", "ok")]
    spans = sorted((nb["metadata"]["papermill"]["start_time"], nb["metadata"]["papermill"]["end_time"])
                   for nb in (json.loads((directory / r["notebook"]).read_text()) for r in rows))
    assert spans[0][1] <= spans[1][0], spans

    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster:
        rc = S.main(sweep_args(NOTEBOOK, tmp_path / "out2", "-p", "a", "1",
                               "--executor", "dask", "--address", cluster.scheduler_address))
    assert rc == 2
    assert "no worker declares the resource GPU" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()


def test_written_files_keep_the_permissions_of_what_they_replace(tmp_path):
    """The sweep writes through a private temporary file; the file it leaves has the umask's permissions, or those of
    the file it replaced."""
    import os

    from kvlab.sweep import api as SA

    row = {"a": 1, "status": "ok", "duration_s": 0.1, "error": "", "notebook": ""}
    table = tmp_path / "results.csv"
    SA._write_csv(table, ["a", *SA.STATUS_COLUMNS], [row], ["a"])
    assert table.stat().st_mode & 0o777 == 0o666 & ~SA._UMASK
    table.chmod(0o640)
    SA._write_csv(table, ["a", *SA.STATUS_COLUMNS], [row], ["a"])
    assert table.stat().st_mode & 0o777 == 0o640
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]
