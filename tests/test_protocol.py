"""kvlab.study.protocol: the perplexity protocol's changes against fp16, their intervals and paired differences."""

import math

import pytest
from scipy import stats

from kvlab.study.protocol import change, paired, t_interval, window_changes

STRIDE = 512


def _per_window(deltas: dict, bits: dict, base=(1000.0, 1100.0, 900.0)):
    """per_window of two texts whose windows change by ``deltas[name]`` nats per token against fp16."""
    out = {}
    for t in ("a", "b"):
        out[t] = {"fp16": {"nll": list(base), "bits": [16.0] * 3}}
        for name, d in deltas.items():
            out[t][name] = {"nll": [n + STRIDE * x for n, x in zip(base, d)], "bits": [bits[name]] * 3}
    return out


def test_change_is_the_mean_window_change_with_a_t_interval():
    pw = _per_window({"k4": (0.01, 0.02, 0.03)}, {"k4": 4.25})
    d = window_changes(pw, "k4", ("a", "b"), STRIDE)
    assert d == pytest.approx([0.01, 0.02, 0.03] * 2)
    h = stats.t.ppf(0.975, 5) * stats.tstd(d) / math.sqrt(6)
    c = change(pw, "k4", ("a", "b"), STRIDE)
    assert c.delta == pytest.approx(100 * math.expm1(0.02))
    assert (c.lo, c.hi) == pytest.approx((100 * math.expm1(0.02 - h), 100 * math.expm1(0.02 + h)))
    assert (c.bits, c.n) == (4.25, 6)
    assert change(pw, "fp16", ("a",), STRIDE).delta == 0


def test_paired_difference_in_points():
    pw = _per_window({"k4": (0.01, 0.02, 0.03), "k3": (0.03, 0.05, 0.04)}, {"k4": 4.25, "k3": 3.25})
    lo, m, hi = paired(pw, "k3", "k4", ("a", "b"), STRIDE)
    assert m == pytest.approx(2.0) and lo < m < hi
    assert t_interval([1.0])[2] == math.inf


@pytest.mark.parametrize("call, match", [
    (lambda pw: change(pw, "k9", ("a",), STRIDE), "no windows of 'k9'"),
    (lambda pw: change(pw, "k4", ("c",), STRIDE), "for the text 'c'"),
    (lambda pw: change(pw, "k4", (), STRIDE), "texts must name"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call(_per_window({"k4": (0.01, 0.02, 0.03)}, {"k4": 4.25}))


def test_unpaired_windows():
    pw = _per_window({"k4": (0.01, 0.02, 0.03)}, {"k4": 4.25})
    pw["a"]["k4"]["nll"].pop()
    with pytest.raises(ValueError, match="not paired"):
        window_changes(pw, "k4", ("a",), STRIDE)
