"""How much a KV-cache codec distorts keys, inner products and attention; the synthetic vectors measured.

Synthetic vectors (``synthetic_vectors(kind, num, dim)``), one row per token:

* ``gaussian``: i.i.d. N(0, 1) channels.
* ``student_t``: i.i.d. Student-t channels with ``df`` (an integer) degrees of freedom, scaled to
  unit variance: heavy tails, occasional single huge entries.
* ``outlier_channels``: N(0, 1) channels except ``num_outliers`` fixed channels (the same for every
  token, chosen by the seed) scaled by ``outlier_scale``, as in the keys of many trained models.

Metrics. Each pools the whole batch (a ratio of sums, not a mean of per-vector ratios) and is
computed in float64:

* ``relative_mse(x, x_hat) = sum ||x_hat - x||^2 / sum ||x||^2``.
* ``inner_product_error(q, k, k_hat)``: over all pairs, ``s = <q, k>`` and ``s_hat = <q, k_hat>``;
  the least-squares fit ``s_hat - s = beta s + eps`` splits the error into a multiplicative
  ``bias = beta`` (``-0.03``: inner products shrink by 3 %) and a ``variance = mean(eps^2) /
  mean(s^2)`` relative to the spread of the exact inner products.
* ``attention(q, k, v)``: ``softmax(q k^T / sqrt(dim)) v`` with its weights.
* ``attention_error(q, k, v, k_hat, v_hat)``: ``score`` is the mean over queries of the total
  variation distance ``1/2 sum_j |p_j - p_hat_j|`` between the exact and the approximate attention
  weights (0: identical, 1: disjoint); ``output`` is ``sum ||o_hat - o||^2 / sum ||o||^2`` over queries.
* ``codec_errors(codec, keys, values, queries)``: all of the above for one codec applied to keys
  and values alike, with the codec's ``bits_per_element`` (metadata included).

Matched bits. Codecs rarely land on the same ``bits_per_element``. ``frontier(bits, errors)`` is the
lower convex hull of a family's ``(bits, error)`` points, cut where the error stops falling: what
a mix of the family's codecs over heads of equal size reaches (a fraction ``w`` of heads with one
codec and ``1 - w`` with another costs and errs the ``w``-weighted mean of the two).
``frontier_at(bits, errors, at)`` reads it at ``at`` bits per element (NaN below the cheapest codec).

``roundtrip(codec, x)`` encodes and decodes ``x [..., tokens, dim]`` with any kvlab codec
(``MSECodec``, ``AffineCodec`` on either axis, ``QJLCodec``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import _checks as C

__all__ = [
    "KINDS",
    "AttentionError",
    "CodecErrors",
    "InnerProductError",
    "attention",
    "attention_error",
    "codec_errors",
    "frontier",
    "frontier_at",
    "inner_product_error",
    "relative_mse",
    "roundtrip",
    "scaled_queries",
    "synthetic_vectors",
]

KINDS = ("gaussian", "student_t", "outlier_channels")
DTYPES = (*C.FLOAT_DTYPES, torch.float64)  # metrics accept float64 inputs too


# ----------------------------------------------------------------------------- synthetic vectors


def synthetic_vectors(
    kind: str,
    num: int,
    dim: int,
    *,
    seed: int = 0,
    df: int = 3,
    num_outliers: int = 4,
    outlier_scale: float = 10.0,
) -> torch.Tensor:
    """``num`` vectors of ``dim`` channels, float32 ``[num, dim]`` (CPU), drawn from ``kind`` (see the module doc)."""
    C.check_choice("kind", kind, KINDS)
    C.check_int("num", num, minimum=1)
    C.check_int("dim", dim, minimum=1)
    C.check_int("seed", seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(num, dim, generator=gen, dtype=torch.float64)
    if kind == "student_t":
        C.check_int("df", df, minimum=3)  # finite variance
        chi2 = torch.randn(df, num, dim, generator=gen, dtype=torch.float64).square().sum(0)
        x = x / (chi2 / df).sqrt() / math.sqrt(df / (df - 2))  # unit variance
    elif kind == "outlier_channels":
        C.check_int("num_outliers", num_outliers, minimum=0)
        if num_outliers > dim:
            raise ValueError(f"num_outliers ({num_outliers}) must be at most dim ({dim})")
        channels = torch.randperm(dim, generator=gen)[:num_outliers]
        x[:, channels] *= float(outlier_scale)
    return x.float()


def scaled_queries(keys: torch.Tensor, num: int, score_std: float, *, seed: int = 0) -> torch.Tensor:
    """``num`` isotropic Gaussian queries, scaled so that ``<q, k> / sqrt(dim)`` over all pairs with ``keys`` has std ``score_std``.

    ``score_std`` sets how peaked attention is: about 1 spreads the weights over most tokens, 4 puts
    most of the weight on a few.
    """
    C.check_tensor("keys", keys, DTYPES, ndim_min=2)
    C.check_int("num", num, minimum=1)
    if not score_std > 0:
        raise ValueError(f"score_std must be > 0, got {score_std}")
    dim = keys.shape[-1]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(num, dim, generator=gen, dtype=torch.float64).to(keys.device)
    s = (q @ keys.reshape(-1, dim).double().T) / math.sqrt(dim)
    return (q * (score_std / s.std().item())).to(keys.dtype)


# ----------------------------------------------------------------------------- codecs


def roundtrip(codec, x: torch.Tensor) -> torch.Tensor:
    """``codec.decode(codec.encode(x))`` as float32 ``[..., tokens, dim]`` for any kvlab codec.

    An ``AffineCodec`` with ``axis="channel"`` groups tokens, so ``tokens`` must be a multiple of its
    ``group_size``.
    """
    C.check_tensor("x", x, C.FLOAT_DTYPES, ndim_min=1)
    codes = codec.encode(x)
    if getattr(codec, "axis", None) is not None:  # AffineCodec: decode needs dim
        return codec.decode(codes, x.shape[-1]).float()
    return codec.decode(codes).float()


# ----------------------------------------------------------------------------- metrics


def _pair(name_a, a, name_b, b) -> None:
    C.check_tensor(name_a, a, DTYPES, ndim_min=1)
    C.check_tensor(name_b, b, DTYPES, ndim_min=1)
    if a.shape != b.shape:
        raise ValueError(f"{name_b} must have the shape of {name_a} {tuple(a.shape)}, got {tuple(b.shape)}")


def relative_mse(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """``sum ||x_hat - x||^2 / sum ||x||^2``."""
    _pair("x", x, "x_hat", x_hat)
    x = x.double()
    return ((x_hat.double() - x).square().sum() / x.square().sum()).item()


@dataclass(frozen=True)
class InnerProductError:
    """``<q, k_hat> - <q, k> = bias <q, k> + eps``; ``variance = E[eps^2] / E[<q, k>^2]``."""

    bias: float
    variance: float


def inner_product_error(q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor) -> InnerProductError:
    """Bias and variance of ``<q, k_hat>`` as an estimate of ``<q, k>`` over all pairs of ``q [Q, dim]`` and ``k [N, dim]``."""
    _pair("k", k, "k_hat", k_hat)
    C.check_tensor("q", q, DTYPES, ndim_min=1, last_dim=k.shape[-1])
    q, k, k_hat = (t.double().reshape(-1, t.shape[-1]) for t in (q, k, k_hat))
    s = q @ k.T
    e = q @ k_hat.T - s
    s2 = s.square().sum()
    beta = (e * s).sum() / s2
    eps = e - beta * s
    return InnerProductError(bias=beta.item(), variance=(eps.square().sum() / s2).item())


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [..., Q, N], output [..., Q, dim_v])`` of ``softmax(q k^T / sqrt(dim)) v`` (float64)."""
    C.check_tensor("q", q, DTYPES, ndim_min=2)
    C.check_tensor("k", k, DTYPES, ndim_min=2, last_dim=q.shape[-1])
    C.check_tensor("v", v, DTYPES, ndim_min=2)
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v must have one row per key ({k.shape[-2]}), got shape {tuple(v.shape)}")
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    weights = torch.softmax(scores, -1)
    return weights, weights @ v.double()


@dataclass(frozen=True)
class AttentionError:
    """``score``: mean total variation distance of the attention weights; ``output``: relative squared error of the output."""

    score: float
    output: float


def attention_error(q, k, v, k_hat, v_hat) -> AttentionError:
    """Attention of ``q`` over the cache ``(k_hat, v_hat)`` against the exact ``(k, v)``."""
    _pair("k", k, "k_hat", k_hat)
    _pair("v", v, "v_hat", v_hat)
    p, o = attention(q, k, v)
    p_hat, o_hat = attention(q, k_hat, v_hat)
    score = 0.5 * (p_hat - p).abs().sum(-1).mean()
    output = (o_hat - o).square().sum() / o.square().sum()
    return AttentionError(score=score.item(), output=output.item())


@dataclass(frozen=True)
class CodecErrors:
    """Every metric of one codec on one cache; ``bits_per_element`` includes metadata."""

    codec: str
    bits_per_element: float
    relative_mse: float
    ip_bias: float
    ip_variance: float
    attention_score: float
    attention_output: float


def codec_errors(
    codec, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, *, quantize_values: bool = True
) -> CodecErrors:
    """Encode and decode ``keys`` and ``values`` ``[N, dim]`` with ``codec``; measure against ``queries`` ``[Q, dim]``.

    ``relative_mse`` is that of the keys; ``ip_*`` compare ``<q, k_hat>`` with ``<q, k>``. With
    ``quantize_values=False`` the values stay exact, so the attention errors are the keys' alone.
    """
    C.check_bool("quantize_values", quantize_values)
    k_hat = roundtrip(codec, keys)
    v_hat = roundtrip(codec, values) if quantize_values else values
    ip = inner_product_error(queries, keys, k_hat)
    att = attention_error(queries, keys, values, k_hat, v_hat)
    return CodecErrors(
        codec=repr(codec),
        bits_per_element=float(codec.bits_per_element),
        relative_mse=relative_mse(keys, k_hat),
        ip_bias=ip.bias,
        ip_variance=ip.variance,
        attention_score=att.score,
        attention_output=att.output,
    )


# ----------------------------------------------------------------------------- matched bits


def frontier(bits, errors) -> tuple[list[float], list[float]]:
    """Vertices ``(bits, errors)`` of the lower convex hull of the points, ascending in bits, up to the lowest error."""
    pts = sorted(zip(map(float, bits), map(float, errors)))
    if not pts:
        raise ValueError("frontier needs at least one (bits, error) point")
    if any(not math.isfinite(b) or not math.isfinite(e) for b, e in pts):
        raise ValueError("bits and errors must be finite")
    hull: list[tuple[float, float]] = []
    for p in pts:
        if hull and p[0] == hull[-1][0]:
            continue  # same cost: the sorted order put the lower error first
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) <= 0:  # hull[-1] is on or above the chord
                hull.pop()
            else:
                break
        hull.append(p)
    best = min(range(len(hull)), key=lambda i: hull[i][1])
    hull = hull[: best + 1]
    return [p[0] for p in hull], [p[1] for p in hull]


def frontier_at(bits, errors, at: float) -> float:
    """The ``frontier`` read at ``at`` bits per element: linear between vertices, flat past the last, NaN before the first."""
    xs, ys = frontier(bits, errors)
    if at < xs[0]:
        return math.nan
    for (x1, y1), (x2, y2) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if at <= x2:
            return y1 + (y2 - y1) * (at - x1) / (x2 - x1)
    return ys[-1]
