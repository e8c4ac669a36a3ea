"""The formats measured on the second model, Gemma 3 270M (page 16 and ``scripts/measure_formats.py --model
gemma3-270m``): one definition for the committed run and the page's live check.

``SECOND_MODEL_FORMATS``: name -> (``KVFormat``, ``KVCache`` options) of the decision table's formats that need no
model-specific work; the centred ones take the model's key statistics (a constant mean: Gemma's layers turn keys
by two RoPE bases). ``TRANSFORM_BITS``: the transform codec, calibrated on the model with keys after RoPE, at 3.5
and 2.5 bits per element, kept with ``TRANSFORM_OPTIONS``.
"""

from __future__ import annotations

from typing import Callable

from ..hf.cache import KVCache
from ..hf.formats import KVFormat

__all__ = ["FUSED_BITS", "FUSED_CALIBRATION", "NAMES", "SECOND_MODEL_FORMATS", "TRANSFORM_BITS", "TRANSFORM_OPTIONS", "caches", "committed_windows", "describe", "first_windows",
           "window_nll"]

SECOND_MODEL_FORMATS = {
    "fp16": (KVFormat("fp16"), {}),
    "KIVI k4v4": (KVFormat("affine", 4, 4, key_axis="channel"), {}),
    "KIVI k2v2": (KVFormat("affine", 2, 2, key_axis="channel"), {}),
    "affine k4v4": (KVFormat("affine", 4, 4), {}),
    "MSE k4v4 Hadamard": (KVFormat("mse", 4, 4, rotation="hadamard"), {}),
    "MSE k3v3 Hadamard": (KVFormat("mse", 3, 3, rotation="hadamard"), {}),
    "centred k4v4": (KVFormat("centered", 4, 4), {"sink": 1}),
    "centred k3v3": (KVFormat("centered", 3, 3), {"sink": 1}),
}
TRANSFORM_BITS = {"transform 3.5": 3.5, "transform 2.5": 2.5}
TRANSFORM_OPTIONS = {"sink": 1, "residual": 16}
NAMES = (*SECOND_MODEL_FORMATS, *TRANSFORM_BITS)  # every format, in the committed run's order
# the transform codec in the fused layout (kvlab.transform.fused), bits pooled across layers, keys and values
FUSED_BITS = {"fused 3.5": 3.5, "fused 2.5": 2.5}
FUSED_CALIBRATION = dict(keys="post_rope", groups="head", layout="fused", allocation="global")


def caches(model, calibration_ids, key_stats, names=None, backend: str = "auto") -> dict[str, Callable[[], KVCache]]:
    """name -> a factory of a fresh ``KVCache`` for ``model``, for ``names`` (default: ``NAMES``); transform formats
    are calibrated here on ``calibration_ids`` (``kvlab.transform.calibration.calibrate(..., keys="post_rope")``),
    centred ones take ``key_stats`` (``kvlab.calibration.calibrate_keys(..., mean="constant")``)."""
    from ..transform.calibration import calibrate

    names = list(NAMES if names is None else names)
    unknown = [n for n in names if n not in NAMES and n not in FUSED_BITS]
    if unknown:
        raise ValueError(f"names must be among {list(NAMES) + list(FUSED_BITS)}, got {unknown}")
    cfg, out = model.config, {}
    for name in names:
        if name in SECOND_MODEL_FORMATS:
            fmt, options = SECOND_MODEL_FORMATS[name]
            out[name] = lambda f=fmt, o=options: KVCache(f, config=cfg, key_stats=key_stats, backend=backend, **o)
        elif name in FUSED_BITS:
            kv = calibrate(model, calibration_ids, bits=FUSED_BITS[name], **FUSED_CALIBRATION)
            out[name] = lambda kv=kv: KVCache(KVFormat("transform"), config=cfg, transform=kv, backend=backend,
                                              **TRANSFORM_OPTIONS)
        else:
            kv = calibrate(model, calibration_ids, bits=TRANSFORM_BITS[name], keys="post_rope")
            out[name] = lambda kv=kv: KVCache(KVFormat("transform"), config=cfg, transform=kv, backend=backend,
                                              **TRANSFORM_OPTIONS)
    return out


def describe(name: str) -> str:
    """How the cache of format ``name`` is built, as the committed results record it."""
    if name in SECOND_MODEL_FORMATS:
        fmt, options = SECOND_MODEL_FORMATS[name]
        return repr(fmt) + "".join(f", {k}={v}" for k, v in options.items())
    options = "".join(f", {k}={v}" for k, v in TRANSFORM_OPTIONS.items())
    if name in FUSED_BITS:
        how = "".join(f", {k}={v!r}" for k, v in FUSED_CALIBRATION.items())
        return f"KVFormat('transform'), transform=calibrate(model, ids, bits={FUSED_BITS[name]}{how}){options}"
    return f"KVFormat('transform'), transform=calibrate(model, ids, bits={TRANSFORM_BITS[name]}, keys='post_rope'){options}"


def window_nll(model, ids, caches, w: int, stride: int, bos: int | None = None) -> dict[str, float]:
    """name -> summed NLL (nats) of the ``stride`` scored tokens of window ``w`` of ``ids`` (``2 * stride`` tokens from
    ``w * stride``): the committed run's protocol for one window."""
    from ..hf.model import perplexity

    r = perplexity(model, ids[w * stride : w * stride + 2 * stride], window=2 * stride, stride=stride, cache=caches,
                   bos=bos)
    return {name: x.nll * x.tokens for name, x in r.items()}


def first_windows(model, ids, caches, windows: int, stride: int, bos: int | None = None) -> dict[str, float]:
    """name -> perplexity change (%) against ``"fp16"`` over the first ``windows`` windows of ``ids`` (``2 * stride``
    tokens each, sliding by ``stride``, ``stride`` scored tokens each): the committed run's protocol, window by window
    (page 16's live run and its check across floating-point paths, ``tests/test_fp_paths.py``)."""
    import math

    if "fp16" not in caches:
        raise ValueError(f"caches must hold the baseline 'fp16', got {sorted(caches)}")
    nll = {name: 0.0 for name in caches}
    for w in range(windows):
        for name, x in window_nll(model, ids, caches, w, stride, bos).items():
            nll[name] += x
    return {name: 100 * math.expm1((nll[name] - nll["fp16"]) / (windows * stride)) for name in caches}


def committed_windows(per_window: dict, names, windows: int, stride: int, text: str = "pydoc") -> dict[str, float]:
    """name -> the same change (%) over the first ``windows`` windows of ``text`` in a committed run's ``per_window``."""
    import math
    import statistics

    from .protocol import window_changes

    return {name: 100 * math.expm1(statistics.fmean(window_changes(per_window, name, [text], stride)[:windows]))
            for name in names}
