"""The record of a book run (``scripts/run_notebooks.py --record``) and the code fingerprint it stores."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from kvlab.study.fingerprint import source_fingerprint

ROOT = Path(__file__).resolve().parent.parent
CPU = {"device": "x86_64, 2 CPUs, no GPU", "python": "3.11.7", "torch": "2.13.0+cpu", "triton": "3.6.0",
       "transformers": "5.24.0"}


@pytest.fixture
def runner(monkeypatch):
    spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "scripts" / "run_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    facts = dict(CPU)
    monkeypatch.setattr(module, "machine_facts", lambda env: dict(facts))
    module.facts = facts  # what the next Record sees as this machine
    return module


def _run(runner, path, names, params=(), update=False):
    record = runner.Record(path, {}, list(params), update=update)
    for name in names:
        record.begin(name, ROOT / "notebooks" / f"{name}.ipynb")
        record.add(name, "ok", 1.0)
    return json.loads(path.read_text())


def test_a_record_holds_each_page_with_the_code_it_ran(runner, tmp_path):
    data = _run(runner, tmp_path / "rec.json", ["12_summary", "01_lloyd_max"], ["-p", "small", "False"])
    assert [e["page"] for e in data["pages"]] == ["01_lloyd_max", "12_summary"]  # in the order of _toc.yml
    assert data["device"] == CPU["device"] and data["parameters"] == "-p small False"
    for e in data["pages"]:
        assert e["source"] == source_fingerprint(ROOT / "notebooks" / f"{e['page']}.ipynb")
        assert e["versions"]["torch"] == CPU["torch"] and e["command"].startswith("python scripts/run_notebooks.py")


def test_an_update_replaces_the_pages_run_again_and_keeps_the_others(runner, tmp_path):
    path = tmp_path / "rec.json"
    first = _run(runner, path, ["01_lloyd_max", "12_summary"])
    runner.facts["transformers"] = "5.25.0"
    second = _run(runner, path, ["12_summary"], update=True)
    assert [e["page"] for e in second["pages"]] == ["01_lloyd_max", "12_summary"]
    assert second["pages"][0] == first["pages"][0]
    assert second["pages"][1]["versions"]["transformers"] == "5.25.0" == second["versions"]["transformers"]


@pytest.mark.parametrize("change", ["device", "parameters"])
def test_an_update_of_another_device_or_parameters_is_refused_and_leaves_the_file(runner, tmp_path, change):
    path = tmp_path / "rec.json"
    _run(runner, path, ["01_lloyd_max"])
    before = path.read_bytes()
    params = ["-p", "small", "False"] if change == "parameters" else []
    if change == "device":
        runner.facts["device"] = "NVIDIA H200"
    with pytest.raises(runner.NotebookError, match=f"records runs with {change}"):
        _run(runner, path, ["12_summary"], params, update=True)
    assert path.read_bytes() == before


def test_update_needs_a_record(runner, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["run_notebooks.py", "--update"])
    with pytest.raises(SystemExit) as exc:
        runner.main()
    assert exc.value.code == 2 and "--update needs --record" in capsys.readouterr().err


def _notebook(path, cells):
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def _cell(source, outputs=(), tags=()):
    return {"cell_type": "code", "source": source, "outputs": list(outputs), "execution_count": 3,
            "metadata": {"tags": list(tags)}}


def test_the_source_fingerprint_sees_cells_and_package_but_not_outputs(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("x = 1\n")
    nb = _notebook(tmp_path / "a.ipynb", [_cell("small = True"), _cell("print(1)")])
    base = source_fingerprint(nb, package)
    run = _notebook(tmp_path / "b.ipynb", [_cell("small = True"), _cell("small = False", tags=["injected-parameters"]),
                                          _cell(["print", "(1)"], outputs=[{"output_type": "stream", "text": "1"}])])
    assert source_fingerprint(run, package) == base  # an executed copy: outputs and injected parameters ignored
    edited = _notebook(tmp_path / "c.ipynb", [_cell("small = True"), _cell("print(2)")])
    assert source_fingerprint(edited, package)["page"] != base["page"]
    assert source_fingerprint(edited, package)["kvlab"] == base["kvlab"]
    (package / "sub").mkdir()
    (package / "sub" / "b.py").write_text("")
    assert source_fingerprint(nb, package)["kvlab"] != base["kvlab"]


def test_the_source_fingerprint_names_a_missing_path(tmp_path):
    with pytest.raises(ValueError, match="notebook: no such file"):
        source_fingerprint(tmp_path / "none.ipynb")
    nb = _notebook(tmp_path / "a.ipynb", [])
    with pytest.raises(ValueError, match="package: no such folder"):
        source_fingerprint(nb, tmp_path / "none")


def test_the_cell_papermill_injects_is_removed_from_the_page(runner):
    nb = {"cells": [{"cell_type": "code", "metadata": {"tags": ["parameters", "hide-input"]}, "source": "small = True"},
                    {"cell_type": "code", "metadata": {"tags": ["injected-parameters"]}, "source": "small = False"}]}
    runner.hide_injected_parameters(nb)
    runner.hide_injected_parameters(nb)  # once only
    assert [c["metadata"]["tags"] for c in nb["cells"]] == [["parameters", "hide-input"], ["injected-parameters", "remove-cell"]]


class _Papermill:
    """A stand-in for papermill's process: each run prints the next line of `logs` and returns 1 when the line
    holds an error, else writes the executed notebook (the source, unexecuted) and returns 0."""

    def __init__(self, logs):
        self.logs, self.runs = list(logs), 0

    def __call__(self, cmd, stdout, **kwargs):
        line = self.logs[self.runs]
        self.runs += 1
        stdout.write(line + "\n")
        stdout.flush()
        if not line:
            Path(cmd[4]).write_text(Path(cmd[3]).read_text())
        rc = 1 if line else 0
        return type("Proc", (), {"pid": 0, "wait": lambda self, timeout=None: rc})()


@pytest.mark.parametrize("died", [True, False])
def test_a_kernel_that_dies_before_it_starts_is_started_again_once(runner, monkeypatch, died):
    tmp_path = ROOT / "_build" / f"test_kernel_died_{died}"  # the runner names paths relative to the repository
    shutil.rmtree(tmp_path, ignore_errors=True)
    monkeypatch.setattr(runner, "WORK", tmp_path / "work")
    monkeypatch.setattr(runner, "EXECUTED", tmp_path / "executed")
    first = f"RuntimeError: {runner.KERNEL_DIED}" if died else "RuntimeError: something else"
    fake = _Papermill([first, ""])
    monkeypatch.setattr(runner.subprocess, "Popen", fake)
    if died:
        runner.run_notebook("14_kernel_notes", {}, [])
        assert fake.runs == 2 and (tmp_path / "executed" / "14_kernel_notes.ipynb").is_file()
    else:  # any other failure is the notebook's
        with pytest.raises(runner.NotebookError, match="14_kernel_notes"):
            runner.run_notebook("14_kernel_notes", {}, [])
        assert fake.runs == 1 and not (tmp_path / "executed").exists()
    shutil.rmtree(tmp_path)
