"""The grid of a sweep: a notebook's parameters, the values read from the command line, the runs."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import itertools
import json
import math
import re
import sys
from pathlib import Path


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


def notebook_path(notebook) -> Path:
    """``notebook`` as a Path; SweepError unless it names an existing .ipynb file."""
    source = Path(notebook)
    if source.suffix != ".ipynb" or source.is_dir():
        raise SweepError(f"notebook {str(notebook)!r} is not an .ipynb file")
    if not source.is_file():
        raise SweepError(f"notebook {str(notebook)!r}: no such file")
    return source


def read_notebook(source: Path) -> tuple[bytes, dict]:
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
        try:
            return int(text)
        except ValueError:  # past Python's limit on the digits of an int read from text
            raise SweepError(f"-p {name}: {text[:20]}... has {len(text)} digits; an int value has at most "
                             f"{sys.get_int_max_str_digits() or 'unlimited'}") from None
    if _FLOAT.fullmatch(text):
        return float(text)
    if text[:1] in "'\"([{":
        try:
            value = ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise SweepError(f"-p {name}: cannot read {text!r} as a Python literal") from None
        if (part := _not_plain(value)) is not None:
            raise SweepError(f"-p {name}: {text!r} holds {part}; a value is None, a bool, a number, "
                             "a string, or a list or dict (string keys) of them")
        return list(value) if isinstance(value, tuple) else value
    return text


def _not_plain(value) -> str | None:
    """What the first part of ``value`` is that is not None, a bool, a number, a string, a list, a tuple or a dict with
    string keys (None if every part is)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    if isinstance(value, (list, tuple)):
        return next(filter(None, map(_not_plain, value)), None)
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"the dict key {k!r}, which is not a string"
            if (part := _not_plain(v)) is not None:
                return part
        return None
    return _kind(value)


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


def check_grid(grid: dict, defaults: dict) -> None:
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
            canon = canonical(value)
            if canon in seen:
                raise SweepError(f"-p {name}: the value {format_value(value)} is given twice")
            seen.add(canon)
    total = math.prod(len(values) for values in grid.values())
    if total > MAX_RUNS:
        sizes = " x ".join(f"{len(v)} ({n})" for n, v in grid.items())
        raise SweepError(f"the grid has {total} runs ({sizes}), more than {MAX_RUNS}: sweep fewer values")


def canonical(value) -> str:
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


def grid_runs(grid: dict) -> list[Run]:
    names = list(grid)
    runs = []
    for i, combo in enumerate(itertools.product(*(grid[n] for n in names))):
        parameters = dict(zip(names, combo))
        runs.append(Run(i, parameters, run_key(parameters)))
    return runs
