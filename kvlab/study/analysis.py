"""Real attention inputs: capture them from a model, describe their channels, measure codec errors per head, allocate bits.

Capture
    ``capture_attention(model, ids)`` runs a ``transformers`` model once over ``ids`` and records what
    every attention layer consumes, after RoPE: ``queries [layers, q_heads, tokens, head_dim]``,
    ``keys`` and ``values [layers, kv_heads, tokens, head_dim]`` (float32, CPU), and the residual stream
    entering each layer, ``residual [layers, tokens, hidden]``. The recording wraps the model's
    attention function (``config._attn_implementation``) for the duration of the call; the model's
    output is unchanged.

Channel statistics, per vector set ``x [..., tokens, dim]``
    * ``top_channel_share(x, top)``: the share of the energy ``sum_t x_tj^2`` held by the ``top``
      channels with the most energy (``top / dim`` when energy is spread evenly).
    * ``channel_kurtosis(x)``: ``E[(x - mean)^4] / var^2`` of each channel over the tokens (3 for a
      Gaussian channel; large for a channel with rare huge entries).
    * ``top_channels(x, n)``: indices of the ``n`` channels with the most energy.
    * ``channel_mean_share(x, group)``: the share of the energy held by each channel's mean over
      consecutive groups of ``group`` tokens, ``sum_groups group * mean^2 / sum x^2``: the part of a
      channel that one offset per group of tokens (a per-channel affine zero point) describes.

Errors per head, with the model's own queries (``head_errors``)
    Query head ``j`` reads KV head ``j // (q_heads / kv_heads)`` (grouped-query attention). The query
    at position ``p`` attends to keys ``0 .. p`` (causal); only these pairs enter every metric, computed
    in float64 with the definitions of ``kvlab.study.metrics``: relative squared error of keys and of values;
    the inner-product fit ``<q, k_hat> - <q, k> = beta <q, k> + eps`` (bias ``beta``, variance
    ``sum eps^2 / sum <q, k>^2``); the attention-score error (total variation distance of the weights,
    mean over queries) and the attention-output error (``sum ||o_hat - o||^2 / sum ||o||^2``). Each
    metric is a ratio of sums per (layer, KV head), the sums running over the head's query heads,
    queries and keys; ``pool_heads=True`` pools the sums over the KV heads of a layer.

    With ``output_weight`` (the layer's output projection ``[..., hidden, q_heads * head_dim]``, as in
    ``o_proj.weight``), ``projected_output`` is what the error writes into the residual stream: the
    sum over queries of ``||sum_j W_j (o_hat_j - o_j)||^2`` over the query heads ``j`` of the KV head,
    ``W_j`` the projection's columns of head ``j`` (an absolute squared error, not a ratio).

Outlier-channel split (``OutlierSplit``)
    TurboQuant's fractional rates: the ``num_high`` channels of a head with the most energy (chosen on
    calibration tokens, fixed per head) are encoded with one ``MSECodec`` at ``bits_high`` bits, the
    other channels with a second ``MSECodec`` at ``bits_low`` bits, each sub-vector with its own norm.
    Cost: ``8 (nbytes_high + nbytes_low) / dim`` bits per element; the channel indices are fixed per
    head and not counted.

Bit allocation (``allocate_bits``)
    Units of equal size (a head's keys, a layer's values, ...) each choose one of a list of options
    (codecs) of known cost in bits per element; ``errors[u, o]`` is unit ``u``'s error with option
    ``o``. The allocator returns the choice that minimizes the summed error with the average cost per
    unit within the budget: the exact optimum of this multiple-choice knapsack, by dynamic programming
    over the spent budget in steps of 1/64 bit per element (costs must lie on that grid, as
    ``b + 32/g`` and ``b + 16/d`` do for the group sizes and head dimensions kvlab uses). Whether the
    errors of different units add up is the caller's assumption.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from .. import _checks as C
from ..mse.reference import MSECodec

__all__ = [
    "AttentionInputs",
    "HeadErrors",
    "OutlierSplit",
    "allocate_bits",
    "allocation_cost",
    "capture_attention",
    "channel_kurtosis",
    "channel_mean_share",
    "head_errors",
    "top_channel_share",
    "top_channels",
]

DTYPES = (*C.FLOAT_DTYPES, torch.float64)
GRID = 64  # allocate_bits: costs in steps of 1/GRID bit


# ----------------------------------------------------------------------------- capture


@dataclass
class AttentionInputs:
    """What every attention layer consumed, after RoPE: float32 ``[layers, heads, tokens, head_dim]``; the residual stream into each layer."""

    queries: torch.Tensor  # [layers, q_heads, tokens, head_dim]
    keys: torch.Tensor  # [layers, kv_heads, tokens, head_dim]
    values: torch.Tensor  # [layers, kv_heads, tokens, head_dim]
    residual: torch.Tensor  # [layers, tokens, hidden]: the input of each decoder layer


@contextlib.contextmanager
def _recording_attention(model, record: dict):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = model.config._attn_implementation
    if impl not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"capture_attention needs a registered attention implementation (sdpa, ...), the model uses {impl!r}")
    original = ALL_ATTENTION_FUNCTIONS[impl]
    had_local = impl in ALL_ATTENTION_FUNCTIONS._local_mapping

    def recording(module, query, key, value, *args, **kwargs):
        record[module.layer_idx] = (query[0].detach().float().cpu(), key[0].detach().float().cpu(), value[0].detach().float().cpu())
        return original(module, query, key, value, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[impl] = recording
    try:
        yield
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS[impl] = original
        else:
            del ALL_ATTENTION_FUNCTIONS[impl]


def capture_attention(model, ids: torch.Tensor) -> AttentionInputs:
    """Queries, keys and values of every attention layer of ``model`` over the token ids ``ids`` ``[tokens]``."""
    C.check_tensor("ids", ids, (torch.int32, torch.int64))
    if ids.dim() != 1 or ids.numel() < 1:
        raise ValueError(f"ids must be 1-d token ids (at least one), got shape {tuple(ids.shape)}")
    record: dict[int, tuple] = {}
    device = next(model.parameters()).device
    with torch.no_grad(), _recording_attention(model, record):
        hidden = model(ids[None].to(device), use_cache=False, output_hidden_states=True).hidden_states
    layers = model.config.num_hidden_layers
    if sorted(record) != list(range(layers)):
        raise ValueError(f"recorded attention layers {sorted(record)}, expected 0 .. {layers - 1}")
    q, k, v = (torch.stack([record[i][j] for i in range(layers)]) for j in range(3))
    residual = torch.stack([h[0].detach().float().cpu() for h in hidden[:layers]])
    return AttentionInputs(queries=q, keys=k, values=v, residual=residual)


# ----------------------------------------------------------------------------- channel statistics


def _vectors(name: str, x: torch.Tensor) -> torch.Tensor:
    C.check_tensor(name, x, DTYPES, ndim_min=2)
    return x.double()


def top_channel_share(x: torch.Tensor, top: int) -> torch.Tensor:
    """Share of the energy of ``x [..., tokens, dim]`` in its ``top`` channels with the most energy -> ``[...]``."""
    x = _vectors("x", x)
    C.check_int("top", top, minimum=1)
    if top > x.shape[-1]:
        raise ValueError(f"top ({top}) must be at most the number of channels ({x.shape[-1]})")
    energy = x.square().sum(-2)  # [..., dim]
    return (energy.topk(top, -1).values.sum(-1) / energy.sum(-1)).float()


def channel_kurtosis(x: torch.Tensor) -> torch.Tensor:
    """Kurtosis ``E[(x - mean)^4] / var^2`` of every channel of ``x [..., tokens, dim]`` over the tokens -> ``[..., dim]``."""
    x = _vectors("x", x)
    if x.shape[-2] < 2:
        raise ValueError(f"x needs at least 2 tokens for a kurtosis, got shape {tuple(x.shape)}")
    centred = x - x.mean(-2, keepdim=True)
    var = centred.square().mean(-2)
    return (centred.pow(4).mean(-2) / var.square().clamp_min(1e-300)).float()


def top_channels(x: torch.Tensor, n: int) -> torch.Tensor:
    """Indices ``[..., n]`` (ascending) of the ``n`` channels of ``x [..., tokens, dim]`` with the most energy."""
    x = _vectors("x", x)
    C.check_int("n", n, minimum=1)
    if n > x.shape[-1]:
        raise ValueError(f"n ({n}) must be at most the number of channels ({x.shape[-1]})")
    return x.square().sum(-2).topk(n, -1).indices.sort(-1).values


def channel_mean_share(x: torch.Tensor, group: int) -> torch.Tensor:
    """Share of the energy of ``x [..., tokens, dim]`` in the channel means over groups of ``group`` tokens -> ``[...]``."""
    x = _vectors("x", x)
    C.check_int("group", group, minimum=1)
    tokens, dim = x.shape[-2:]
    if tokens % group:
        raise ValueError(f"the number of tokens ({tokens}) must be a multiple of group ({group})")
    grouped = x.reshape(*x.shape[:-2], tokens // group, group, dim)
    means = grouped.mean(-2)  # [..., groups, dim]
    return (group * means.square().sum((-2, -1)) / x.square().sum((-2, -1))).float()


# ----------------------------------------------------------------------------- errors per head


@dataclass
class HeadErrors:
    """Errors per (layer, KV head) ``[..., kv_heads]``, or per layer ``[...]`` with ``pool_heads=True``."""

    key_mse: torch.Tensor
    value_mse: torch.Tensor
    ip_bias: torch.Tensor
    ip_variance: torch.Tensor
    attention_score: torch.Tensor
    attention_output: torch.Tensor
    projected_output: torch.Tensor | None = None  # with output_weight: squared error written into the residual stream


def head_errors(queries, keys, values, keys_hat, values_hat, positions, *, pool_heads: bool = False,
                output_weight: torch.Tensor | None = None) -> HeadErrors:
    """Codec errors of attention with real queries (see the module docstring).

    ``queries [..., q_heads, Q, dim]`` are the queries at token ``positions [Q]`` (ints, each
    ``< tokens``); ``keys``, ``values`` and their decoded copies are ``[..., kv_heads, tokens, dim]``.
    """
    C.check_tensor("keys", keys, DTYPES, ndim_min=3)
    for name, t in (("values", values), ("keys_hat", keys_hat), ("values_hat", values_hat)):
        C.check_tensor(name, t, DTYPES, ndim_min=3)
        if t.shape != keys.shape:
            raise ValueError(f"{name} must have the shape of keys {tuple(keys.shape)}, got {tuple(t.shape)}")
    C.check_tensor("queries", queries, DTYPES, ndim_min=3, last_dim=keys.shape[-1])
    C.check_tensor("positions", positions, (torch.int32, torch.int64))
    C.check_bool("pool_heads", pool_heads)
    *batch, kv_heads, tokens, dim = keys.shape
    *q_batch, q_heads, n_q, _ = queries.shape
    if output_weight is not None:
        C.check_tensor("output_weight", output_weight, DTYPES, ndim_min=2)
        if list(output_weight.shape[:-2]) != batch or output_weight.shape[-1] != q_heads * dim:
            raise ValueError(f"output_weight must have shape {(*batch, 'hidden', q_heads * dim)}, got {tuple(output_weight.shape)}")
    if q_batch != batch or q_heads % kv_heads:
        raise ValueError(f"queries {tuple(queries.shape)} must match keys {tuple(keys.shape)} with a multiple of {kv_heads} heads")
    if positions.dim() != 1 or positions.numel() != n_q:
        raise ValueError(f"positions must be 1-d with one position per query ({n_q}), got shape {tuple(positions.shape)}")
    if n_q == 0 or bool(((positions < 0) | (positions >= tokens)).any()):
        raise ValueError(f"positions must lie in [0, {tokens}), got {positions.tolist()}")

    group = q_heads // kv_heads
    # [..., kv_heads, group * Q, dim]: the queries that read each KV head
    q = queries.double().reshape(*batch, kv_heads, group * n_q, dim)
    pos = positions.to(keys.device).repeat(group)
    mask = torch.arange(tokens, device=keys.device)[None, :] <= pos[:, None]  # [group * Q, tokens]
    k, v, k_hat, v_hat = (t.double() for t in (keys, values, keys_hat, values_hat))

    # keys and values: sums over tokens and channels -> [..., kv_heads]
    sums = {}
    sums["key_mse"] = ((k_hat - k).square().sum((-2, -1)), k.square().sum((-2, -1)))
    sums["value_mse"] = ((v_hat - v).square().sum((-2, -1)), v.square().sum((-2, -1)))
    # inner products of the attended pairs
    logits, logits_hat = q @ k.transpose(-1, -2), q @ k_hat.transpose(-1, -2)  # [..., kv_heads, group * Q, tokens]
    s, e = logits * mask, (logits_hat - logits) * mask
    s2 = s.square().sum((-2, -1))
    es = (e * s).sum((-2, -1))
    e2 = e.square().sum((-2, -1))
    # attention with the causal mask
    scale = 1.0 / math.sqrt(dim)
    neg = torch.finfo(torch.float64).min
    p = torch.softmax((logits * scale).masked_fill(~mask, neg), -1)
    p_hat = torch.softmax((logits_hat * scale).masked_fill(~mask, neg), -1)
    o, o_hat = p @ v, p_hat @ v_hat
    tv = 0.5 * (p_hat - p).abs().sum(-1).sum(-1)  # summed over the head's queries
    sums["attention_output"] = ((o_hat - o).square().sum((-2, -1)), o.square().sum((-2, -1)))
    sums["attention_score"] = (tv, torch.full_like(tv, float(group * n_q)))

    projected = None
    if output_weight is not None:
        hidden = output_weight.shape[-2]
        w = output_weight.double().reshape(*batch, hidden, kv_heads, group, dim)
        diff = (o_hat - o).reshape(*batch, kv_heads, group, n_q, dim)
        projected = torch.einsum("...kgqd,...ckgd->...kqc", diff, w).square().sum((-2, -1))  # [..., kv_heads]
        projected = (projected.sum(-1) if pool_heads else projected).float()

    def ratio(num, den):
        if pool_heads:
            num, den = num.sum(-1), den.sum(-1)
        return (num / den).float()

    if pool_heads:
        s2p, esp, e2p = s2.sum(-1), es.sum(-1), e2.sum(-1)
    else:
        s2p, esp, e2p = s2, es, e2
    beta = esp / s2p
    # sum eps^2 with eps = e - beta s: sum e^2 - 2 beta sum e s + beta^2 sum s^2
    variance = (e2p - 2 * beta * esp + beta.square() * s2p) / s2p
    return HeadErrors(
        key_mse=ratio(*sums["key_mse"]),
        value_mse=ratio(*sums["value_mse"]),
        ip_bias=beta.float(),
        ip_variance=variance.clamp_min(0).float(),
        attention_score=ratio(*sums["attention_score"]),
        attention_output=ratio(*sums["attention_output"]),
        projected_output=projected,
    )


# ----------------------------------------------------------------------------- outlier-channel split


class OutlierSplit:
    """Two MSE codes per vector: ``num_high`` chosen channels at ``bits_high``, the rest at ``bits_low`` (see the module docstring)."""

    def __init__(self, dim: int, num_high: int, bits_high: int, bits_low: int, rotation: str = "haar", seed: int = 0):
        C.check_int("dim", dim, minimum=6)
        C.check_int("num_high", num_high, minimum=3)
        if num_high > dim - 3:
            raise ValueError(f"num_high ({num_high}) must leave at least 3 of the {dim} channels to the low-bit code")
        self.dim, self.num_high = dim, num_high
        self.high = MSECodec(num_high, bits_high, rotation=rotation, seed=seed)
        self.low = MSECodec(dim - num_high, bits_low, rotation=rotation, seed=seed + 1)

    @property
    def bits_per_element(self) -> float:
        return 8.0 * (self.high.nbytes + self.low.nbytes) / self.dim

    def __repr__(self) -> str:
        return (f"OutlierSplit(dim={self.dim}, num_high={self.num_high}, bits_high={self.high.bits}, "
                f"bits_low={self.low.bits}, rotation={self.high.rotation_kind!r})")

    def roundtrip(self, x: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
        """Encode and decode ``x [..., tokens, dim]`` with the high-bit channels ``channels [..., num_high]`` of each vector set."""
        C.check_tensor("x", x, C.FLOAT_DTYPES, ndim_min=2, last_dim=self.dim)
        C.check_tensor("channels", channels, (torch.int32, torch.int64), ndim_min=1, last_dim=self.num_high)
        if channels.shape[:-1] != x.shape[:-2]:
            raise ValueError(f"channels must have shape {(*x.shape[:-2], self.num_high)} (one set per vector set), "
                             f"got {tuple(channels.shape)}")
        channels = channels.long()
        if bool(((channels < 0) | (channels >= self.dim)).any()):
            raise ValueError(f"channels must lie in [0, {self.dim})")
        is_high = torch.zeros(*x.shape[:-2], self.dim, dtype=torch.bool, device=x.device)
        is_high.scatter_(-1, channels, True)
        if bool((is_high.sum(-1) != self.num_high).any()):
            raise ValueError("channels must not repeat a channel within a set")
        low = (~is_high).nonzero()[:, -1].reshape(*x.shape[:-2], self.dim - self.num_high)  # ascending per set
        order = torch.cat([channels.sort(-1).values, low], -1)  # [..., dim]
        index = order.unsqueeze(-2).expand(*x.shape)
        gathered = x.float().gather(-1, index)
        high = self.high.decode(self.high.encode(gathered[..., : self.num_high]))
        rest = self.low.decode(self.low.encode(gathered[..., self.num_high :]))
        return torch.empty_like(gathered).scatter_(-1, index, torch.cat([high, rest], -1))


# ----------------------------------------------------------------------------- bit allocation


def allocation_cost(choice: torch.Tensor, costs) -> float:
    """Average cost per unit (bits per element) of the options ``choice [units]``."""
    costs = torch.as_tensor(costs, dtype=torch.float64)
    return costs[choice.long()].mean().item()


def allocate_bits(errors: torch.Tensor, costs, budget: float) -> torch.Tensor:
    """Option index per unit ``[units]`` minimizing the summed error at average cost at most ``budget`` (see the module docstring).

    ``errors [units, options]``: each unit's error under each option; ``costs [options]``: strictly
    increasing cost of the options in bits per element, on a grid of 1/64 bit; ``budget``: the allowed
    average cost.
    """
    C.check_tensor("errors", errors, DTYPES)
    if errors.dim() != 2 or errors.shape[0] < 1 or errors.shape[1] < 1:
        raise ValueError(f"errors must be [units, options] with at least one of each, got shape {tuple(errors.shape)}")
    if not bool(torch.isfinite(errors).all()):
        raise ValueError("errors must be finite")
    costs = torch.as_tensor(costs, dtype=torch.float64)
    if costs.shape != (errors.shape[1],):
        raise ValueError(f"costs must have one entry per option ({errors.shape[1]}), got shape {tuple(costs.shape)}")
    if not bool((costs[1:] > costs[:-1]).all()):
        raise ValueError(f"costs must be strictly increasing, got {costs.tolist()}")
    steps = (costs - costs[0]) * GRID
    if not bool(((steps - steps.round()).abs() < 1e-6).all()):
        raise ValueError(f"costs must lie on a grid of 1/{GRID} bit, got {costs.tolist()}")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget):
        raise TypeError(f"budget must be a finite number, got {budget!r}")
    if budget < costs[0].item():
        raise ValueError(f"budget ({budget}) is below the cheapest option ({costs[0].item()})")
    units, n_options = errors.shape
    steps = steps.round().long()  # extra cost of each option over the cheapest, in grid steps
    total = min(int(math.floor((budget - costs[0].item()) * units * GRID + 1e-6)), int(steps[-1]) * units)
    err = errors.double().cpu()
    # best[t]: least summed error of the units so far with exactly t extra steps (inf: unreachable)
    best = torch.full((total + 1,), math.inf, dtype=torch.float64)
    best[0] = 0.0
    picks = torch.zeros(units, total + 1, dtype=torch.long)
    for u in range(units):
        candidates = torch.full((n_options, total + 1), math.inf, dtype=torch.float64)
        for o in range(n_options):
            s = int(steps[o])
            if s <= total:
                candidates[o, s:] = best[: total + 1 - s] + err[u, o]
        best, picks[u] = candidates.min(0)
    t = int(best.argmin())
    choice = torch.zeros(units, dtype=torch.long)
    for u in range(units - 1, -1, -1):
        choice[u] = picks[u, t]
        t -= int(steps[choice[u]])
    return choice
