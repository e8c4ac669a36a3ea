"""The pages' bounds on live-vs-committed numbers cover how far the CPU's floating-point paths move them.

``results/fp_paths.json`` (``scripts/measure_fp_paths.py``) holds each checked quantity under every path of
``kvlab.study.fp_paths.PATHS``; a page's bound is ``MARGIN`` times the largest. One page-style measurement runs here
again under two paths, so that a bound that the paths outgrow fails here, not on another reader's CPU.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.study import fp_paths

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from measure_fp_paths import PAGES  # noqa: E402

# page 16's live run, cut to the format whose loss moves most with the path: MSE K4V4 on the first window (the fp16
# cache's NLL moves by 0.001 % between paths, results/fp_paths.json: the committed one is used)
WINDOW = """
import json, kvlab
from kvlab.study import formats
model, tokenizer = kvlab.load_model("gemma3-270m")
ids = tokenizer(kvlab.corpus(), return_tensors="pt", add_special_tokens=False).input_ids[0]
caches = formats.caches(model, None, None, NAMES, backend="reference")
print(json.dumps(formats.window_nll(model, ids, caches, 0, 512, bos=tokenizer.bos_token_id)))
"""


def _window_nll(names, path):
    """Summed NLL of the first window per cache, in a child process under ``path`` (idle OpenMP threads sleeping:
    the machine's cores are shared with the rest of the suite)."""
    env = {**os.environ, **fp_paths.PATHS[path], "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop(fp_paths.RECORD_ENV, None)
    out = subprocess.run([sys.executable, "-c", WINDOW.replace("NAMES", repr(names))], env=env, capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_page_ran_under_every_path():
    data = fp_paths.load()
    assert set(data["paths"]) == set(fp_paths.PATHS), "results/fp_paths.json measured every path"
    assert set(data["page_status"]) == set(PAGES), "results/fp_paths.json measured every page that compares"
    for page, by_path in data["page_status"].items():
        assert by_path == {path: "ok" for path in fp_paths.PATHS}, f"{page}: its claims fail under a path: {by_path}"
        assert data["pages"][page], f"{page} recorded no checked quantity"
    assert data["tests"]["status"] == {path: "passed" for path in fp_paths.PATHS}
    for page, quantities in data["pages"].items():
        for quantity, values in quantities.items():
            assert set(values) == set(fp_paths.PATHS) and all(map(math.isfinite, values.values())), (page, quantity)


def test_page_bound_covers_two_paths():
    """Page 16's live MSE K4V4 loss on one window, under the machine's default path and MKL's reproducible one: each
    lands within the page's bound of the committed run, and the two lie closer together than that bound."""
    committed = json.loads((ROOT / "results" / "formats_perplexity_gemma3_270m.json").read_text())
    from kvlab.study import formats

    stride = committed["stride"]
    reference = formats.committed_windows(committed["per_window"], ["MSE k4v4 Hadamard"], 1, stride)
    bound = fp_paths.tolerance("16_second_model", "gap MSE k4v4 Hadamard", floor=1.0)
    fp16 = committed["per_window"]["pydoc"]["fp16"]["nll"][0]
    live = {path: 100 * math.expm1((_window_nll(["MSE k4v4 Hadamard"], path)["MSE k4v4 Hadamard"] - fp16) / stride)
            for path in ("default", "MKL_CBWR=COMPATIBLE")}
    assert abs(live["default"] - live["MKL_CBWR=COMPATIBLE"]) < bound, (live, bound)
    for path, value in live.items():
        assert abs(value - reference["MSE k4v4 Hadamard"]) < bound, (path, value, reference, bound)


def test_tolerance_is_twice_the_largest_value(tmp_path):
    data = {"pages": {"p": {"gap": {"a": 0.1, "b": -0.7, "c": 0.3}}}}
    assert fp_paths.tolerance("p", "gap", data=data) == pytest.approx(2 * 0.7)
    assert fp_paths.tolerance("p", "gap", floor=5.0, data=data) == 5.0
    assert fp_paths.spread("p", "gap", data=data) == pytest.approx(1.0)
    with pytest.raises(KeyError, match="run `python scripts/measure_fp_paths.py`"):
        fp_paths.tolerance("p", "other", data=data)
    with pytest.raises(FileNotFoundError, match="measure_fp_paths"):
        fp_paths.load(tmp_path / "missing.json")


def test_check_asserts_the_committed_bound(monkeypatch):
    monkeypatch.delenv(fp_paths.RECORD_ENV, raising=False)
    quantity = next(iter(fp_paths.load()["pages"]["16_second_model"]))
    bound = fp_paths.tolerance("16_second_model", quantity)
    fp_paths.check("16_second_model", quantity, 0.5 * bound)
    with pytest.raises(AssertionError, match="floating-point paths"):
        fp_paths.check("16_second_model", quantity, 2 * bound + 1)
    with pytest.raises(AssertionError):
        fp_paths.check("16_second_model", quantity, float("nan"))


def test_record_mode_keeps_values_and_asserts_nothing(tmp_path, monkeypatch):
    target = tmp_path / "values.jsonl"
    monkeypatch.setenv(fp_paths.RECORD_ENV, str(target))
    fp_paths.check("p", "gap", 1e9)
    assert fp_paths.record("p", "live", 2.5) == 2.5
    assert fp_paths.load()["pages"] == {"p": {"gap": {"this run": 1e9}, "live": {"this run": 2.5}}}


def test_codec_fingerprint_is_the_same_under_two_paths():
    """The committed results' codec fingerprint does not depend on the path the CPU's matrix products take."""
    from kvlab.study.fingerprint import codec_fingerprint

    env = {**os.environ, **fp_paths.PATHS["MKL_CBWR=COMPATIBLE"], "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, "-c", "from kvlab.study.fingerprint import codec_fingerprint as f; print(f())"],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == codec_fingerprint()
