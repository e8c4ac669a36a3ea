"""Attention over a cache as token-by-token decoding sees it, computed for many queries at once.

What
    A cache that keeps some tokens unquantized for a while (a ``residual`` window of the most recent
    tokens, the open group of channel-axis keys) shows each decoding step a different mix: the query
    at position ``i`` reads token ``j`` exactly (fp16) while ``j`` is still held unquantized after
    ``i`` was written, and through the codec once it was encoded. A call of ``n`` tokens through
    ``KVCache.update`` instead sees the cache as it stands after its own write: only the last tokens
    of the call are still unquantized, so few of its queries see their own recent tokens exactly.

    With ``decode_view`` on, ``kvlab.KVCache`` and ``kvlab.study.simulated.SimulatedCache`` give every query
    of a call what a decoding step at its position would have read:

    * each layer keeps the exact (fp16) keys and values of its tokens beside its codes, and knows for
      every token ``j`` the cache length ``q_j`` from which a decoder reads it through the codec
      (``j + residual + 1`` for per-token codecs, the length that completes ``j``'s group for
      channel-axis keys, never for the sink tokens and unquantized layers), separately for K and V;
    * ``update`` returns the stored view (decoded codes, unquantized parts) and hands the exact keys
      and values and the ``q_j`` to the attention implementation ``"kvlab-decode-view"``;
    * that attention scores query ``i`` against the exact key ``j`` where ``i + 1 < q_j`` (``j`` still
      unquantized when ``i`` is decoded) and against the stored key otherwise, and accumulates the
      values by the same rule (K and V separately), causally.

    Queries that need nothing but the stored view (no window, or only sink tokens) go through torch
    SDPA exactly as without ``decode_view``: the results are identical. ``kvlab.perplexity`` turns it on
    for the caches that have it (``decode_view=True``, its default). The chunked result equals feeding
    one token at a time (``chunk=1``) up to float rounding (``tests/test_decode_view.py``).

Assumes unpadded sequences (the queries of a call are the last ``n`` positions of every sequence),
as ``kvlab.perplexity`` feeds them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import _checks as C

__all__ = ["ATTENTION", "NEVER", "DecodeView", "DecodeViewCache", "decode_view_attention", "quantized_from"]

ATTENTION = "kvlab-decode-view"
NEVER = 2**62  # q_j of a token that a decoder always reads exactly


def quantized_from(length: int, *, sink: int, residual: int, unit: int = 1, quantized: bool = True) -> torch.Tensor:
    """``q_j`` of tokens ``0 .. length - 1``: the cache length from which decoding reads token ``j`` through the codec.

    The first ``sink`` tokens and every token of an unquantized layer (``quantized=False``): ``NEVER``. The
    others are encoded ``unit`` at a time (1 per token, ``group_size`` for channel-axis keys) once more than
    ``residual`` of them wait: token ``j`` (``m = j - sink``) from length ``sink + residual + (m // unit + 1) * unit``.
    """
    j = torch.arange(length)
    if not quantized:
        return torch.full((length,), NEVER, dtype=torch.int64)
    q = sink + residual + (torch.div(j - sink, unit, rounding_mode="floor") + 1) * unit
    return torch.where(j < sink, torch.full_like(q, NEVER), q)


@dataclass
class DecodeView:
    """What one layer's ``update`` hands to the attention: exact K/V ``[B, H, L, D]`` and ``q_j`` of K and V ``[L]``."""

    layer_idx: int
    keys: torch.Tensor
    values: torch.Tensor
    key_from: torch.Tensor
    value_from: torch.Tensor


class DecodeViewCache(Cache):
    """A ``transformers.Cache`` whose layers can hand the decode view over (``KVCache``, ``SimulatedCache``): the
    ``decode_view`` switch of every layer, the attention implementation it needs, and ``update`` with its layer index
    checked."""

    @property
    def decode_view(self) -> bool:
        """Whether calls attend as token-by-token decoding would (this module); set before the first update."""
        return self.layers[0].decode_view

    @decode_view.setter
    def decode_view(self, on: bool) -> None:
        C.check_bool("decode_view", on)
        if on != self.decode_view and self.get_seq_length():
            raise ValueError("decode_view must be set before the cache holds tokens")
        for layer in self.layers:
            layer.decode_view = on

    @property
    def attn_implementation(self) -> str | None:
        """The attention implementation a model must use with this cache (None: the model's own)."""
        return ATTENTION if self.decode_view else None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the new tokens of layer ``layer_idx``; return what attention uses (the layer's ``update``)."""
        self._check_layer_idx(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_layer_idx(self, layer_idx) -> None:
        C.check_int("layer_idx", layer_idx)
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx must be in [0, {len(self.layers)}) (the cache's layers), got {layer_idx}: "
                             f"build the cache from the config of the model it serves")


class _Handoff(threading.local):
    view: DecodeView | None = None
    layer_idx: int | None = None


_HANDOFF = _Handoff()


def hand_over(layer_idx: int, view: DecodeView | None) -> None:
    """Called by a layer's ``update``: what the next attention call (of that layer) reads (None: the stored view)."""
    _HANDOFF.layer_idx, _HANDOFF.view = layer_idx, view


def _take(layer_idx) -> DecodeView | None:
    if _HANDOFF.layer_idx is None:
        raise ValueError(f"attn_implementation={ATTENTION!r} needs a cache with decode_view on "
                         "(kvlab.KVCache or kvlab.study.simulated.SimulatedCache, as kvlab.perplexity sets it)")
    if layer_idx is not None and layer_idx != _HANDOFF.layer_idx:
        raise ValueError(f"attention of layer {layer_idx} after the cache update of layer {_HANDOFF.layer_idx}")
    view = _HANDOFF.view
    _HANDOFF.layer_idx = _HANDOFF.view = None
    return view


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, 1)


def decode_view_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``"kvlab-decode-view"`` attention implementation (module docstring). ``key``/``value``: the stored view."""
    view = _take(getattr(module, "layer_idx", None))
    n, length = query.shape[2], key.shape[2]
    if view is not None:
        pos = torch.arange(length - n, length, device=query.device)[:, None]  # query positions [n, 1]
        causal = torch.arange(length, device=query.device)[None] <= pos  # [n, L]
        key_from, value_from = view.key_from.to(query.device)[None], view.value_from.to(query.device)[None]
        # exact where the stored view has the token decoded but the decoder at position i still held it exactly
        key_exact = causal & (key_from <= length) & (pos + 1 < key_from)  # [n, L]
        value_exact = causal & (value_from <= length) & (pos + 1 < value_from)
    if view is None or not bool(key_exact.any() or value_exact.any()):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    groups = query.shape[1] // key.shape[1]
    stored = torch.matmul(query, _repeat(key, groups).transpose(-1, -2))  # [B, Hq, n, L]
    exact = torch.matmul(query, _repeat(view.keys.to(query.dtype), groups).transpose(-1, -2))
    scores = torch.where(key_exact, exact, stored).float() * scale
    allowed = causal
    if attention_mask is not None:
        mask = attention_mask[..., -n:, -length:]
        allowed = allowed & (mask if mask.dtype == torch.bool else mask == 0)
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, -1).to(query.dtype)
    out = (torch.matmul(p.masked_fill(value_exact, 0), _repeat(value, groups))
           + torch.matmul(p.masked_fill(~value_exact, 0), _repeat(view.values.to(query.dtype), groups)))
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, decode_view_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
