"""Per-channel key statistics of a model, measured once on held-out text: what ``CenteredMSECodec`` uses.

``calibrate_keys(model, ids)`` (``key_moments(model, ids, ...).stats(scale)``) runs the model over
``ids`` in windows of ``window`` tokens (positions ``0 .. window - 1`` in each, as in evaluation) and
returns ``ChannelStats``: per layer, KV head and channel, a mean of the keys and a scale, float32
``[layers, heads, dim]``. Keys and queries are read where attention receives them, after RoPE (an
attention function registered with ``transformers.AttentionInterface`` records them, then runs
SDPA), so any model whose attention goes through that interface can be calibrated.

The mean
    * ``mean="rope"`` (default): the mean ``mu`` of the keys *before* RoPE (RoPE undone at each
      position); the key at position ``n`` is centred by ``RoPE_n(mu)``, the mean rotated to that
      position (``ChannelStats.rope`` holds the model's RoPE). RoPE turns a constant mean into one
      that turns with the position, fast in the high-frequency channel pairs: a constant mean after
      RoPE only captures the slow ones.
    * ``mean="constant"``: the mean of the keys after RoPE, the same at every position.

The scale (of the keys once centred)
    * ``scale="query"`` (default): ``(var_k / E[q^2]) ** (1/4)`` per channel, ``var_k`` the variance of
      the centred key channel and ``E[q^2]`` the mean square of that channel of the queries of the KV
      head's group. The codec's error is close to isotropic in the normalised space ``z = (k - mean) /
      scale`` and its size follows ``sum_c var_k / scale^2``; the error of a score ``q . k`` is then
      ``sum_c E[q_c^2] scale_c^2`` times that. This scale minimises the product of the two sums
      (Cauchy-Schwarz), i.e. the expected squared error of the attention scores;
    * ``scale="std"``: the standard deviation of the centred key channel (equal spread in ``z``);
    * ``scale="none"``: ones (centring only).

    Every scale is floored at ``floor`` times the head's mean scale, so that a channel that hardly
    varies is not blown up.

``key_moments(..., before_rope=True)`` measures keys and queries before RoPE instead (for codecs that
quantize keys before RoPE). RoPE is read from the model (``RoPE.from_model``: a module with an
``inv_freq`` buffer, the rotate-half convention of Llama, Mistral, Qwen).

The calibration text must be disjoint from any text the codec is evaluated on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _checks as C

__all__ = ["ChannelStats", "KeyMoments", "RoPE", "calibrate_keys", "key_moments"]

SCALES = ("query", "std", "none")
MEANS = ("rope", "constant")
RECORDER = "kvlab_calibration"  # the attention function registered while calibrating


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


@dataclass(frozen=True)
class RoPE:
    """Rotary position embedding, rotate-half convention: ``inv_freq`` (float64 ``[dim / 2]``), ``scaling``.

    Position ``n`` rotates channel pair ``(j, j + dim / 2)`` by the angle ``n * inv_freq[j]``;
    ``apply(x, n) = scaling * (x * cos + rotate_half(x) * sin)``. Tables are computed on the CPU in
    float64, so a position gives the same numbers on every device.
    """

    inv_freq: torch.Tensor
    scaling: float = 1.0

    def __post_init__(self):
        C.check_tensor("inv_freq", self.inv_freq, (torch.float64,))
        if self.inv_freq.dim() != 1 or not bool(torch.isfinite(self.inv_freq).all()):
            raise ValueError(f"inv_freq must be a finite 1-d tensor, got shape {tuple(self.inv_freq.shape)}")
        if isinstance(self.scaling, bool) or not isinstance(self.scaling, (int, float)) or not self.scaling > 0:
            raise ValueError(f"scaling must be a positive number, got {self.scaling!r}")

    @classmethod
    def from_model(cls, model) -> "RoPE":
        for module in model.modules():
            inv_freq = getattr(module, "inv_freq", None)
            if isinstance(inv_freq, torch.Tensor):
                config = getattr(model, "config", None)
                head_dim = getattr(config, "head_dim", None) or (
                    config.hidden_size // config.num_attention_heads if hasattr(config, "num_attention_heads") else None)
                if head_dim is not None and 2 * inv_freq.numel() != head_dim:
                    raise ValueError(f"the model turns {2 * inv_freq.numel()} of its {head_dim} key channels with RoPE "
                                     f"(a partial rotary embedding), which kvlab.calibration.RoPE does not model; use "
                                     f"mean='constant' (keys='post_rope' for the transform codec)")
                return cls(inv_freq.detach().to("cpu", torch.float64), float(getattr(module, "attention_scaling", 1.0)))
        kinds = sorted({n[: -len("_inv_freq")] for m in model.modules() for n, _ in m.named_buffers(recurse=False)
                        if n.endswith("_inv_freq") and not n.endswith("original_inv_freq")})
        if kinds:
            raise ValueError(f"the model turns keys with one rotary embedding per layer type ({', '.join(kinds)}), which "
                             "kvlab.calibration.RoPE does not model; use mean='constant' (keys='post_rope' for the transform codec)")
        raise ValueError("the model has no rotary embedding (no module with an inv_freq buffer); use mean='constant'")

    @property
    def dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, float64 ``[*positions.shape, dim]`` on the CPU (scaling included)."""
        angle = positions.detach().to("cpu", torch.float64)[..., None] * self.inv_freq
        angle = torch.cat([angle, angle], -1)
        return self.scaling * angle.cos(), self.scaling * angle.sin()

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE at ``positions`` (broadcast against ``x``'s leading dims) on ``x [..., dim]``, in float64."""
        cos, sin = self.tables(positions)
        x = x.to("cpu", torch.float64)
        return x * cos + _rotate_half(x) * sin

    def undo(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The inverse of ``apply`` (float64)."""
        cos, sin = self.tables(positions)
        x = x.to("cpu", torch.float64)
        return (x * cos - _rotate_half(x) * sin) / self.scaling**2  # tables carry one factor of scaling


@dataclass(frozen=True)
class ChannelStats:
    """Per-channel ``mean`` and ``scale`` of the keys, float32 ``[layers, heads, dim]`` (CPU).

    With ``rope`` set, ``mean`` is the mean before RoPE and the key at position ``n`` is centred by
    ``rope.apply(mean, n)``; without, ``mean`` is the same at every position.
    """

    mean: torch.Tensor
    scale: torch.Tensor
    tokens: int  # calibration tokens they were measured on
    rope: RoPE | None = None

    def __post_init__(self):
        C.check_tensor("mean", self.mean, (torch.float32,))
        C.check_tensor("scale", self.scale, (torch.float32,))
        if self.mean.dim() != 3 or self.scale.shape != self.mean.shape:
            raise ValueError(f"mean and scale must both be [layers, heads, dim], got {tuple(self.mean.shape)} "
                             f"and {tuple(self.scale.shape)}")
        C.check_finite("mean", self.mean)
        if not bool((torch.isfinite(self.scale) & (self.scale > 0)).all()):
            raise ValueError("scale must be finite and > 0 everywhere")
        if self.rope is not None:
            if not isinstance(self.rope, RoPE):
                raise TypeError(f"rope must be None or a kvlab.calibration.RoPE, got {type(self.rope).__name__}")
            if self.rope.dim != self.mean.shape[-1]:
                raise ValueError(f"rope has {self.rope.dim} channels, the keys {self.mean.shape[-1]}")

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.mean.shape)

    def nbytes(self, dtype_size: int = 4) -> int:
        """Bytes of the constants (mean and scale), independent of the number of tokens cached."""
        return 2 * self.mean.numel() * dtype_size


@dataclass(frozen=True)
class KeyMoments:
    """What ``ChannelStats`` are made of, per layer, KV head and channel (float64 ``[layers, heads, dim]``).

    ``mean`` of the keys (before RoPE when ``rope`` is set), ``var`` of the centred keys, ``query_square``:
    the mean square of the queries of the KV head's group; ``tokens``: keys measured.
    """

    mean: torch.Tensor
    var: torch.Tensor
    query_square: torch.Tensor
    tokens: int
    rope: RoPE | None = None

    def stats(self, scale: str = "query", floor: float = 0.1) -> ChannelStats:
        C.check_choice("scale", scale, SCALES)
        _check_floor(floor)
        if scale == "none":
            s = torch.ones_like(self.mean)
        else:
            s = self.var.sqrt() if scale == "std" else (self.var / self.query_square.clamp_min(1e-30)).sqrt().sqrt()
            s = torch.maximum(s, floor * s.mean(-1, keepdim=True)).clamp_min(1e-6)
        return ChannelStats(self.mean.float(), s.float(), self.tokens, self.rope)


def _check_floor(floor) -> None:
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 < floor <= 1:
        raise ValueError(f"floor must be a number in (0, 1], got {floor!r}")


def _recording_attention(sums: dict, transform):
    """An attention function that adds ``transform(layer, key, query)``'s moments to ``sums``, then runs SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        k, q = transform(layer, key.detach().double(), query.detach().double())  # [B, H, n, D], [B, Hq, n, D]
        b, heads, n, dim = k.shape
        q = q.reshape(b, heads, q.shape[1] // heads, n, dim)  # the query heads of each KV head's group
        moments = (k.sum((0, 2)).cpu(), k.square().sum((0, 2)).cpu(), q.square().sum((0, 2, 3)).cpu(),
                   b * n, b * q.shape[2] * n)
        sums[layer] = moments if layer not in sums else tuple(a + m for a, m in zip(sums[layer], moments))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention


def _run(model, ids, window, transform) -> dict:
    """Per layer: (sum k, sum k^2, sum q^2, keys, queries) of ``transform``-ed keys and queries over ``ids``."""
    from transformers import AttentionInterface

    device = next(model.parameters()).device
    sums: dict = {}
    AttentionInterface.register(RECORDER, _recording_attention(sums, transform))
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = RECORDER  # read by every attention layer at call time
    try:
        with torch.no_grad():
            for start in range(0, ids.numel() - window + 1, window):
                model(ids[None, start : start + window].to(device), use_cache=False, logits_to_keep=1)
    finally:
        config._attn_implementation = previous
    return sums


def key_moments(model, ids: torch.Tensor, *, window: int = 1024, mean: str = "rope",
                before_rope: bool = False) -> KeyMoments:
    """Key and query moments of ``model`` on the 1-d token ids ``ids`` (see the module docstring)."""
    C.check_tensor("ids", ids, (torch.int32, torch.int64))
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-d token ids, got shape {tuple(ids.shape)}")
    C.check_int("window", window, minimum=2)
    if ids.numel() < window:
        raise ValueError(f"ids has {ids.numel()} tokens, fewer than one window of {window}")
    C.check_choice("mean", mean, MEANS)
    C.check_bool("before_rope", before_rope)
    rope = RoPE.from_model(model) if (mean == "rope" or before_rope) else None

    def positions(x):  # [B, H, n, D] at positions 0 .. n - 1
        return torch.arange(x.shape[2])

    if before_rope:
        sums = _run(model, ids, window, lambda i, k, q: (rope.undo(k, positions(k)), rope.undo(q, positions(q))))
    elif mean == "constant":
        sums = _run(model, ids, window, lambda i, k, q: (k, q))
    else:  # pass 1: the mean before RoPE; pass 2: the keys centred by that mean rotated to their position
        first = _run(model, ids, window, lambda i, k, q: (rope.undo(k, positions(k)), q))
        mu = {i: s[0] / s[3] for i, s in first.items()}  # [H, D]
        sums = _run(model, ids, window, lambda i, k, q: (k.cpu() - rope.apply(mu[i][:, None, :], positions(k)), q))
        sums = {i: (first[i][0], s[1], s[2], s[3], s[4]) for i, s in sums.items()}  # mean from pass 1
    layers = sorted(sums)
    k_sum, k_sq, q_sq = (torch.stack([sums[i][j] for i in layers]) for j in range(3))  # [L, H, D]
    count, q_count = sums[layers[0]][3], sums[layers[0]][4]
    mu = k_sum / count
    # pass 2 of mean="rope" measured keys already centred: their second moment is the variance
    var = k_sq / count if (mean == "rope" and not before_rope) else (k_sq / count - mu.square()).clamp_min(0)
    return KeyMoments(mu, var, q_sq / q_count, count, rope if (mean == "rope" and not before_rope) else None)


def calibrate_keys(model, ids: torch.Tensor, *, window: int = 1024, mean: str = "rope", scale: str = "query",
                   floor: float = 0.1) -> ChannelStats:
    """Key ``ChannelStats`` of ``model`` on the 1-d token ids ``ids``: ``key_moments(...).stats(scale, floor)``."""
    C.check_choice("scale", scale, SCALES)
    _check_floor(floor)
    return key_moments(model, ids, window=window, mean=mean).stats(scale, floor)
