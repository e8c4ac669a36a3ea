"""Floating-point paths of a CPU, and the tolerances a page derives from how far its live numbers move between them.

torch's CPU build multiplies matrices along the path that MKL and ATen pick for the machine's CPU (AVX2,
AVX-512, or MKL's bit-reproducible ``COMPATIBLE`` path). The paths round differently, and a quantized cache
turns those last-bit differences into other codes: on one window of Gemma 3 270M the loss of MSE K4V4 moves
by about three points of perplexity between two paths of one CPU, while the model's own perplexity moves by
0.001 % (``results/fp_paths.json``). A
CPU-sized page that compares a live number with a committed one therefore allows what the paths themselves
move it, measured, not guessed:

* ``PATHS``: the environments of the measurement, the machine's default among them;
* ``scripts/measure_fp_paths.py`` executes the pages that compare with committed numbers under every path and
  writes each checked quantity's value per path to ``results/fp_paths.json``;
* a page states a bound with ``check(page, quantity, value, floor)``: the value must stay within
  ``tolerance(page, quantity, floor)``, ``MARGIN`` times the largest value over the paths (at least ``floor``);
  ``record`` keeps a quantity that the page tells its reader (no bound).

Under ``scripts/measure_fp_paths.py`` (``KVLAB_FP_RECORD`` names a file) ``check`` and ``record`` append each value
to that file and ``check`` asserts nothing: the run measures what the bounds are derived from.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

__all__ = ["MARGIN", "PATHS", "RESULTS", "check", "load", "record", "recorded", "spread", "tolerance"]

RESULTS = Path(__file__).resolve().parent.parent.parent / "results" / "fp_paths.json"
RECORD_ENV = "KVLAB_FP_RECORD"
MARGIN = 2.0  # a bound is twice the largest value measured over the paths

# name -> the environment variables that select the path (the default: the machine's own choice)
PATHS = {
    "default": {},
    "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
    "MKL_CBWR=AVX2": {"MKL_CBWR": "AVX2"},
    "MKL_CBWR=AVX512": {"MKL_CBWR": "AVX512"},
    "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
}


def load(path: Path | str = RESULTS) -> dict:
    """The committed measurement: ``{"pages": {page: {quantity: {path: value}}}, "paths": ..., "machine": ...}``.
    Under ``scripts/measure_fp_paths.py`` the values this run has recorded so far, as one path named ``"this run"``."""
    target = os.environ.get(RECORD_ENV)
    if target:
        pages = {page: {q: {"this run": v} for q, v in values.items()} for page, values in recorded(target).items()}
        return {"machine": "this run", "paths": {"this run": {}}, "pages": pages}
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run `python scripts/measure_fp_paths.py` to measure it")
    return json.loads(path.read_text())


def recorded(target: Path | str) -> dict[str, dict[str, float]]:
    """``{page: {quantity: value}}`` that ``record`` and ``check`` appended to ``target`` (empty if it does not exist)."""
    pages: dict = {}
    if Path(target).is_file():
        for line in Path(target).read_text().splitlines():
            row = json.loads(line)
            pages.setdefault(row["page"], {})[row["quantity"]] = row["value"]
    return pages


def _values(page: str, quantity: str, data: dict | None) -> dict[str, float]:
    data = load() if data is None else data
    try:
        return data["pages"][page][quantity]
    except KeyError:
        raise KeyError(f"results/fp_paths.json holds no values of {quantity!r} on page {page!r}: run "
                       f"`python scripts/measure_fp_paths.py` again after changing the page's checks") from None


def spread(page: str, quantity: str, data: dict | None = None) -> float:
    """How far ``quantity`` moves between the floating-point paths: largest minus smallest value."""
    values = list(_values(page, quantity, data).values())
    return max(values) - min(values)


def tolerance(page: str, quantity: str, floor: float = 0.0, data: dict | None = None) -> float:
    """The bound a page puts on ``quantity`` (a non-negative distance, such as a live number's gap to a committed
    one): ``MARGIN`` times its largest value over the paths, at least ``floor``."""
    return max(floor, MARGIN * max(abs(v) for v in _values(page, quantity, data).values()))


def record(page: str, quantity: str, value: float) -> float:
    """Keep ``value`` for ``scripts/measure_fp_paths.py`` (a no-op outside it); returns ``value``."""
    value = float(value)
    target = os.environ.get(RECORD_ENV)
    if target:
        with open(target, "a") as fh:
            fh.write(json.dumps({"page": page, "quantity": quantity, "value": value}) + "\n")
    return value


def check(page: str, quantity: str, value: float, floor: float = 0.0) -> None:
    """Assert that ``value`` stays within ``tolerance(page, quantity, floor)``; under ``scripts/measure_fp_paths.py``
    record it instead."""
    value = record(page, quantity, value)
    if os.environ.get(RECORD_ENV):
        return
    bound = tolerance(page, quantity, floor)
    assert math.isfinite(value) and value <= bound, (
        f"{page}, {quantity}: {value:.4g} exceeds {bound:.4g} ({MARGIN:g} × the largest value measured over the "
        f"CPU's floating-point paths in results/fp_paths.json, at least {floor:g})")
