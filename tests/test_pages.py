"""The book's pages as a reader sees them: every code cell hidden (shown on click) or removed, the checks a
page runs on its claims in removed cells only, and a parameters cell with a CPU-sized default."""

import json
import pathlib
import re

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
HIDDEN = {"hide-input", "remove-cell", "remove-input"}


def _code_cells(path):
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] == "code":
            yield i, set(cell["metadata"].get("tags", [])), "".join(cell["source"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_code_hidden_and_checks_removed(path):
    for i, tags, source in _code_cells(path):
        assert tags & HIDDEN, f"{path.name} cell {i}: code shown by default (tag it hide-input or remove-cell)"
        shown_check = "remove-cell" not in tags and re.search(r"^\s*assert\b", source, re.M) is not None
        assert not shown_check, f"{path.name} cell {i}: an assert a reader can show (move it to a remove-cell cell)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_parameters_cell(path):
    cells = [(tags, source) for _, tags, source in _code_cells(path) if "parameters" in tags]
    assert len(cells) == 1, f"{path.name}: one cell tagged parameters"
    assert re.search(r"^small = True\b", cells[0][1], re.M), f"{path.name}: the parameters default to the CPU size"
