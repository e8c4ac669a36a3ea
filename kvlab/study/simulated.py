"""Simulated key and value codecs for research: encode, decode, keep the decoded vectors.

What
    ``SimulatedCache`` is a ``transformers.Cache`` whose layers pass every new key and value through a
    per-token codec given as a function, ``x_hat = part(x, positions)``, and keep ``x_hat``: what a cache
    holding the codes would return, without the storage. It lets the research page measure codecs
    that kvlab does not store (outlier channels apart, keys quantized before RoPE) with the same
    protocol as ``kvlab.KVCache``: ``prefill="exact"`` (a layer's first call returns its inputs), later
    calls return every stored token decoded, the first ``sink`` and the most recent ``residual`` tokens
    unquantized (fp16). With ``decode_view`` on (as ``kvlab.perplexity`` sets it) every query of a call
    attends as a decoding step at its position would: its own ``residual`` most recent tokens in fp16
    (``kvlab.hf.decode_view``).

    A ``Part`` is ``(fn, bits_per_element)``; ``bits_per_element`` counts codes and per-token metadata
    (norms). The constructors below build the candidates:

    * ``mse_part``: ``kvlab.MSECodec`` (encode, decode), the plain rotated Lloyd-Max codec;
    * ``centered_part``: ``kvlab.centered.reference.CenteredMSECodec`` with one layer's ``ChannelStats``;
    * ``split_part``: the ``n`` channels of largest calibrated spread apart with ``outlier_bits``, the
      others with ``bits``, each group rotated and coded on its own with its own norm (TurboQuant's
      outlier split), optionally centred first;
    * ``pre_rope``: wraps a key part so that it codes the keys before RoPE (the rotation is undone with
      the positions, the code decoded, RoPE applied again), as KVQuant does;
    * ``fp16_part``: unquantized, stored in fp16.

    Everything is pure torch on the CPU; tokens are coded independently (per-token codecs only).

Checks
    ``update`` checks its inputs as ``KVCache.update`` does: ``layer_idx`` in ``[0, layers)``, float key
    and value states ``[batch, heads, tokens, head_dim]`` of one shape, dtype and device, the batch,
    heads, head_dim, dtype and device of the layer's first update, finite values, and values that the
    fp16 parts can hold (the sink and residual tokens, ``fp16_part``): a finite value beyond 65504 or a
    nonzero vector whose values are all below fp16's smallest normal number (6.1e-05) is an error, not
    ``inf`` or zeros. A codec that cannot code the states (an MSE norm outside fp16's range) is an error
    naming the states; a part that returns another shape is an error naming the part. A call that
    raises leaves the layer as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from .. import _checks as C
from ..calibration import ChannelStats
from ..centered.reference import CenteredMSECodec
from ..hf.decode_view import DecodeView, DecodeViewCache, hand_over, quantized_from
from ..mse.reference import MSECodec

__all__ = ["Part", "SimulatedCache", "centered_part", "fp16_part", "mse_part", "pre_rope", "rope_tables", "split_part",
           "transform_part"]

NORM_BITS = 16


@dataclass(frozen=True)
class Part:
    """A per-token codec of one part (K or V) of one layer: ``fn(x [B, H, n, D], positions [n]) -> x_hat``."""

    fn: Callable
    bits_per_element: float
    label: str = ""

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"fn must be callable (x [B, H, n, D], positions [n]) -> x_hat, got {type(self.fn).__name__}")
        bits = self.bits_per_element
        if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 0 < bits < float("inf"):
            raise ValueError(f"bits_per_element must be a positive finite number, got {bits!r}")
        if not isinstance(self.label, str):
            raise TypeError(f"label must be a str, got {type(self.label).__name__}")


def _heads_last(fn):
    """Apply a codec on ``[..., H, D]`` to ``x [B, H, n, D]``."""
    return lambda x: fn(x.transpose(1, 2)).transpose(1, 2)


FP16_WHERE = "fp16, in which the sink, the residual window and fp16 parts are stored"


def _fp16(x: torch.Tensor) -> torch.Tensor:
    """``x`` stored in fp16 (as float32): finite, within fp16's range and no nonzero vector below its normal range."""
    C.check_store("x", x, torch.float16, FP16_WHERE)
    return x.half().float()


def fp16_part() -> Part:
    return Part(lambda x, pos: _fp16(x), 16.0, "fp16")


@functools.lru_cache(maxsize=None)
def _mse(dim: int, bits: int, rotation: str, seed: int) -> MSECodec:
    return MSECodec(dim, bits, rotation=rotation, seed=seed)


def mse_part(dim: int, bits: int, *, rotation: str = "haar", seed: int = 0) -> Part:
    codec = _mse(dim, bits, rotation, seed)
    return Part(lambda x, pos: codec.decode(codec.encode(x)), codec.bits_per_element, f"mse{bits}")


def centered_part(stats: ChannelStats, layer: int, bits: int, *, scale: bool = True, rotation: str = "haar",
                  seed: int = 0) -> Part:
    """``CenteredMSECodec`` of layer ``layer`` (``scale=False``: centring only, scale 1); with ``stats.rope``
    the mean turns with the tokens' positions."""
    mean = stats.mean[layer]
    codec = CenteredMSECodec(mean.shape[-1], bits, mean, stats.scale[layer] if scale else torch.ones_like(mean),
                             rotation=rotation, seed=seed, rope=stats.rope)

    def fn(x, pos):
        rows = x.transpose(1, 2)  # [B, n, H, D]
        p = pos.expand(rows.shape[0], -1) if stats.rope is not None else None
        return codec.decode(codec.encode(rows, p), "model", p).transpose(1, 2)

    return Part(fn, codec.bits_per_element, f"centered{bits}")


def split_part(stats: ChannelStats, layer: int, bits: int, outlier_bits: int, n: int, *, center: bool = True,
               seed: int = 0) -> Part:
    """Outlier channels apart: per head the ``n`` channels of largest calibrated spread (``stats.scale``
    when centred, else root mean square) with ``outlier_bits``, the rest with ``bits``; each group is
    rotated (Haar) and coded with the MSE codec of its own dimension and norm."""
    mean, scale = stats.mean[layer], stats.scale[layer]
    heads, dim = mean.shape
    C.check_int("n", n, minimum=3)
    if dim - n < 3:
        raise ValueError(f"n must leave at least 3 channels of {dim}, got {n}")
    spread = scale.square() if center else scale.square() + mean.square()
    order = spread.argsort(-1, descending=True)
    outlier, inlier = order[:, :n], order[:, n:]
    hi, lo = _mse(n, outlier_bits, "haar", seed), _mse(dim - n, bits, "haar", seed)
    shift = mean if center else torch.zeros_like(mean)

    def fn(x, pos):
        s = shift.to(x.device)[None, :, None, :]
        z = x.float() - s
        idx_hi = outlier.to(x.device)[None, :, None, :].expand(*z.shape[:-1], n)
        idx_lo = inlier.to(x.device)[None, :, None, :].expand(*z.shape[:-1], dim - n)
        out = torch.empty_like(z)
        out.scatter_(-1, idx_hi, hi.decode(hi.encode(torch.gather(z, -1, idx_hi))))
        out.scatter_(-1, idx_lo, lo.decode(lo.encode(torch.gather(z, -1, idx_lo))))
        return out + s

    bits_per_element = (n * outlier_bits + (dim - n) * bits + 2 * NORM_BITS) / dim
    return Part(fn, bits_per_element, f"split{n}@{outlier_bits}+{bits}")


def rope_tables(model) -> Callable:
    """``positions [n] -> (cos, sin) [n, head_dim]`` of a transformers Llama-like model (its ``rotary_emb``)."""
    rotary = model.model.rotary_emb
    dim = model.config.head_dim

    def tables(pos):
        device = rotary.inv_freq.device
        cos, sin = rotary(torch.zeros(1, 1, dim, device=device), pos[None].to(device, torch.int64))
        return cos[0].float(), sin[0].float()

    return tables


def _rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def pre_rope(part: Part, tables: Callable) -> Part:
    """Code the keys before RoPE: undo RoPE at the tokens' positions, code, apply RoPE again."""

    def fn(x, pos):
        cos, sin = (t.to(x.device) for t in tables(pos))
        raw = x.float() * cos - _rotate_half(x.float()) * sin  # RoPE's inverse rotation
        y = part.fn(raw, pos).float()
        return y * cos + _rotate_half(y) * sin

    return Part(fn, part.bits_per_element, "pre-RoPE " + part.label)


class _SimulatedLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, key: Part, value: Part, residual: int, sink: int, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.key, self.value, self.residual, self.sink = key, value, residual, sink
        self.length = 0
        self.decode_view = False

    def lazy_initialization(self, key_states, value_states):
        self.decoded = ([], [])  # per call: decoded keys, values [B, H, n, D]
        self.exact = ([], [])  # the same in fp16 (for the residual window)
        self.batch, self.num_heads, _, self.head_dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _check_states(self, key_states, value_states, pos: torch.Tensor) -> None:
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            C.check_states(name, x)
            if x.dim() != 4:
                raise ValueError(f"{name} must be [batch, heads, tokens, head_dim], got shape {tuple(x.shape)}")
        if value_states.shape != key_states.shape:
            raise ValueError(f"value_states must have the shape of key_states {tuple(key_states.shape)}, "
                             f"got {tuple(value_states.shape)}")
        if value_states.dtype != key_states.dtype:
            raise TypeError(f"value_states must have the dtype of key_states ({key_states.dtype}), got {value_states.dtype}")
        C.check_same_device(key_states=key_states, value_states=value_states)
        if self.is_initialized:
            b, h, _, d = key_states.shape
            if (b, h, d) != (self.batch, self.num_heads, self.head_dim):
                raise ValueError(f"key_states must be [{self.batch}, {self.num_heads}, tokens, {self.head_dim}] (the batch, "
                                 f"heads and head_dim of the layer's first update), got shape {tuple(key_states.shape)}")
            if (key_states.dtype, key_states.device) != (self.dtype, self.device):
                raise TypeError(f"key_states must have the dtype and device of the layer's first update ({self.dtype} on "
                                f"{self.device}), got {key_states.dtype} on {key_states.device}")
        fp16 = self.residual > 0 or (self.sink > 0 and pos.numel() > 0 and int(pos[0]) < self.sink)
        flags = torch.stack([C.store_flags(x, torch.float16 if fp16 else torch.float32)
                             for x in (key_states, value_states)]).tolist()  # one sync
        for name, x, f in zip(("key_states", "value_states"), (key_states, value_states), flags):
            C.raise_store_flags(name, x, f, torch.float16 if fp16 else torch.float32, FP16_WHERE if fp16 else "float32")

    def update(self, key_states, value_states, *args, **kwargs):
        """Code the new tokens; return what attention uses. A call that raises leaves the layer as it was."""
        n = key_states.shape[2] if isinstance(key_states, torch.Tensor) and key_states.dim() == 4 else 0
        pos = torch.arange(self.length, self.length + n)
        self._check_states(key_states, value_states, pos)
        decoded, exact = [], []
        for name, x, part, which in (("key_states", key_states, self.key, "key"),
                                     ("value_states", value_states, self.value, "value")):
            try:
                y = part.fn(x, pos)
            except ValueError as exc:
                raise ValueError(f"{name} cannot be coded by the {which} part {part.label or part.fn!r}: {exc}") from None
            if not isinstance(y, torch.Tensor) or y.shape != x.shape:
                got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
                raise ValueError(f"the {which} part {part.label or part.fn!r} must return a tensor of the shape of its "
                                 f"input {tuple(x.shape)}, got {got}")
            y = y.to(x.dtype)
            if self.sink and n and pos[0] < self.sink:
                y = torch.where((pos < self.sink)[:, None].to(x.device), x.half().to(x.dtype), y)
            decoded.append(y)
            exact.append(x.half().to(x.dtype))
        if self.decode_view and self.is_initialized and len(self.exact[0]) != len(self.decoded[0]):
            raise ValueError("decode_view must be set before a layer's first update")
        # everything computed: store it (nothing above changed the layer)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first = self.length == 0
        self.length += n
        for i in range(2):
            self.decoded[i].append(decoded[i])
            if self.residual or self.decode_view:
                self.exact[i].append(exact[i])
        if self.decode_view:
            q = quantized_from(self.length, sink=self.sink, residual=self.residual)
            hand_over(self.layer_idx, None if first else DecodeView(self.layer_idx, torch.cat(self.exact[0], 2),
                                                                    torch.cat(self.exact[1], 2), q, q))
        if first:
            return key_states, value_states
        out = [torch.cat(d, 2) for d in self.decoded]
        r = min(self.residual, self.length)
        if r:
            out = [torch.cat([o[:, :, : self.length - r], torch.cat(e, 2)[:, :, -r:]], 2) for o, e in zip(out, self.exact)]
        return out[0], out[1]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1


class SimulatedCache(DecodeViewCache):
    """A cache of decoded per-token codes: ``parts`` is one ``(key Part, value Part)`` per layer."""

    prefill = "exact"  # its prompt pass is that of a DynamicCache: kvlab.perplexity shares it

    def __init__(self, parts: Sequence[tuple[Part, Part]], *, residual: int = 0, sink: int = 0):
        C.check_int("residual", residual, minimum=0)
        C.check_int("sink", sink, minimum=0)
        if not isinstance(parts, (list, tuple)) or not parts:
            raise TypeError(f"parts must be a non-empty list with one (key Part, value Part) pair per layer, "
                            f"got {parts!r:.80}")
        for i, p in enumerate(parts):
            if not isinstance(p, (list, tuple)) or len(p) != 2 or not all(isinstance(q, Part) for q in p):
                raise TypeError(f"parts[{i}] must be a (key Part, value Part) pair, got {p!r:.80}")
        self.parts, self.residual, self.sink = list(parts), residual, sink
        super().__init__(layers=[_SimulatedLayer(k, v, residual, sink, i) for i, (k, v) in enumerate(self.parts)])

    def held_bits_per_element(self) -> float:
        """Bits per stored K/V element: codes and norms, plus the sink and residual tokens at 16 bits (nan when empty)."""
        held = elements = 0
        for layer, (k, v) in zip(self.layers, self.parts):
            total = layer.length
            r = min(self.residual + self.sink, total)
            held += (total - r) * (k.bits_per_element + v.bits_per_element) + 2 * r * 16
            elements += 2 * total
        return held / elements if elements else float("nan")


def transform_part(codec, rope_tables: Callable | None = None) -> Part:
    """``kvlab.transform.TransformCodec`` of one layer's keys or values (the layer's heads flattened, then split
    into the codec's groups); with ``rope_tables`` (``rope_tables(model)``) the keys are coded before RoPE. The
    codec may live on another device than the model: it is copied once to the device of the keys and values."""
    from ..transform import reference as TR

    on = {codec.mean.device: codec}

    def fn(x, pos):
        if x.device not in on:
            on[x.device] = codec.to(x.device)
        codec_here = on[x.device]
        b, heads, n, dim = x.shape
        rows = x.transpose(1, 2).reshape(b, n, heads * dim)
        y = TR.transform(codec_here, rows)
        TR.check_gains(codec_here, y, "x")
        out = TR.untransform(codec_here, TR.dequantize(codec_here, *TR.quantize(codec_here, y)))
        return out.reshape(b, n, heads, dim).transpose(1, 2)

    part = Part(fn, codec.bits_per_element, f"transform {codec.bits_per_element:.2f}b")
    return part if rope_tables is None else pre_rope(part, rope_tables)
