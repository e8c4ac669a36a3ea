"""The shape of the package: the import graph of kvlab/ has no circle, optimised backends never import a
reference (the oracle stays independent), no module imports another module's private names, and no
module outgrows a file a reader can hold."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "kvlab"
MAX_LINES = 625
# modules still over it, each to be split along its parts (kernels, launchers, checks)
LARGE: set[str] = set()


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: pathlib.Path):
    """(imported module, imported names) for every import of a kvlab module, at any depth of the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "kvlab" or target.startswith("kvlab."):
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    yield (sub, None) if sub in MODULES else (target, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvlab"):
                    yield alias.name, None


def _parents(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts))}


def _graph() -> dict[str, set[str]]:
    """module -> the modules importing it runs: its imports and their parent packages (their __init__)."""
    graph = {}
    for m, p in MODULES.items():
        targets = {t for t, _ in _imports(m, p) if t in MODULES}
        graph[m] = {t for t in targets | {q for t in targets for q in _parents(t)} if t != m and t in MODULES}
    return graph


def _is_backend(module: str) -> bool:
    """Kernels and their launchers: the shared device code, each op's triton / gluon modules, and any other module
    that defines a Triton kernel."""
    last = module.rpartition(".")[2]
    return (module.startswith("kvlab._kernels") or last.startswith(("triton", "gluon"))
            or "@triton.jit" in MODULES[module].read_text())


def _is_reference(module: str) -> bool:
    """An oracle: an op's ``reference`` module, and the pure-torch bit packing they share."""
    return module.rpartition(".")[2] == "reference" or module == "kvlab.packing"


OPS = sorted(p.parent.name for p in ROOT.glob("*/api.py") if p.parent.name not in ("hf", "sweep", "study"))
TESTS = ROOT.parent / "tests" / "ops"


def test_import_graph_has_no_circle():
    graph, state, stack = _graph(), {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if n.startswith(m + "."):  # a package's __init__ importing its own modules is no circle
                continue
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_backends_never_import_a_reference():
    bad = [(m, t) for m, deps in _graph().items() if _is_backend(m) for t in deps if _is_reference(t)]
    assert not bad, f"optimised backends importing a reference: {bad}"


def test_backends_exist():
    assert any(_is_backend(m) for m in MODULES) and any(_is_reference(m) for m in MODULES)


def test_no_module_imports_private_names():
    bad = [(m, t, n) for m, p in MODULES.items() for t, n in _imports(m, p)
           if n is not None and n.startswith("_") and not n.startswith("__")]
    assert not bad, f"private names imported across modules: {bad}"


def test_modules_stay_readable():
    big = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES and m not in LARGE}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_its_api_reference_and_test(op):
    """An op is a folder: its api (checks, then dispatch), its oracle, and tests/ops/test_<op>.py."""
    folder = ROOT / op
    assert (folder / "api.py").exists() and (folder / "reference.py").exists(), f"kvlab/{op}/ needs api.py and reference.py"
    assert (TESTS / f"test_{op}.py").exists(), f"tests/ops/test_{op}.py is missing"


def test_the_ops():
    assert OPS == ["affine", "attention", "centered", "mse", "transform"], OPS
