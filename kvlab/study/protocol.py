"""The statistics of the perplexity protocol: a cache format's change against the fp16 cache, over windows.

A results file of the protocol (``results/keys_at_three_bits.json``, ``formats_perplexity*.json``,
``transform_codec.json``) holds ``per_window[text][name] = {"nll": [...], "bits": [...]}``: per window, the summed
NLL (nats) of its ``stride`` scored tokens and the bits per element the cache held. Every window is scored with
the fp16 cache too, so a format's change is paired window by window:

* ``window_changes``: per window, the change of the mean NLL per scored token, ``(nll - nll_fp16) / stride``;
* ``change``: their mean as a perplexity change in percent (``100 (exp(mean) - 1)``), with a 95 % Student-t
  interval over the windows, and the mean bits per element;
* ``paired``: the mean difference between two formats' window changes, in points (100 x nats per token, about a
  percentage point of perplexity), with its 95 % interval;
* ``t_interval``: the mean and 95 % interval of any per-window differences (e.g. of two files of one protocol).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

__all__ = ["Change", "change", "paired", "t_interval", "window_changes"]


@dataclass(frozen=True)
class Change:
    """A format's perplexity change against the baseline, in percent, with its 95 % interval over ``n`` windows."""

    delta: float
    lo: float
    hi: float
    bits: float
    n: int


def t_interval(d: list[float]) -> tuple[float, float, float]:
    """``(mean, lo, hi)``: the mean of ``d`` and its 95 % Student-t interval (infinite for one value)."""
    from scipy import stats

    m = statistics.fmean(d)
    h = stats.t.ppf(0.975, len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.inf
    return m, m - h, m + h


def window_changes(per_window: dict, name: str, texts, stride: int, baseline: str = "fp16") -> list[float]:
    """Per window of ``texts`` (in order): nats per scored token of ``name`` minus those of ``baseline``."""
    if not texts:
        raise ValueError("texts must name at least one text of per_window")
    out = []
    for t in texts:
        if t not in per_window or name not in per_window[t] or baseline not in per_window[t]:
            raise ValueError(f"per_window has no windows of {name!r} and {baseline!r} for the text {t!r}")
        a, b = per_window[t][name]["nll"], per_window[t][baseline]["nll"]
        if len(a) != len(b):
            raise ValueError(f"{name!r} and {baseline!r} have {len(a)} and {len(b)} windows of {t!r}: not paired")
        out += [(x - y) / stride for x, y in zip(a, b)]
    return out


def change(per_window: dict, name: str, texts, stride: int, baseline: str = "fp16") -> Change:
    """``name``'s perplexity change against ``baseline`` over the windows of ``texts`` (module docstring)."""
    m, lo, hi = t_interval(window_changes(per_window, name, texts, stride, baseline))
    pct = lambda x: 100 * math.expm1(x)
    bits = statistics.fmean(b for t in texts for b in per_window[t][name]["bits"])
    return Change(pct(m), pct(lo), pct(hi), bits, sum(len(per_window[t][name]["nll"]) for t in texts))


def paired(per_window: dict, name: str, other: str, texts, stride: int, baseline: str = "fp16") -> tuple[float, float, float]:
    """``(lo, mean, hi)`` of ``name``'s window changes minus ``other``'s, in points (100 x nats per token)."""
    a = window_changes(per_window, name, texts, stride, baseline)
    b = window_changes(per_window, other, texts, stride, baseline)
    m, lo, hi = t_interval([x - y for x, y in zip(a, b)])
    return 100 * lo, 100 * m, 100 * hi
