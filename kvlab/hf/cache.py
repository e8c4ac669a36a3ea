"""A ``transformers`` KV cache that stores keys and values in kvlab's compressed formats.

What
    ``KVCache`` is a ``transformers.Cache``: pass it as ``model(..., cache=cache)`` or
    ``model.generate(..., cache=cache)``. After RoPE, every attention layer calls
    ``cache.update(key_states, value_states, layer_idx)`` with ``[batch, kv_heads, tokens, head_dim]``
    tensors. The cache encodes the new tokens with kvlab's codecs, keeps only their codes (uint8) plus
    the documented 16-bit parts, and returns decoded keys and values for attention. Nothing is kept in
    full precision besides those parts: the codes are the storage.

    ``KVFormat`` says how one layer stores K and V:

    * ``KVFormat("fp16")``: no quantization (the "16-bit" parts are in ``KVCache(dtype=...)``).
    * ``KVFormat("affine", key_bits, value_bits, key_axis="token" | "channel", group_size=32)``:
      ``kvlab.AffineCodec``. Values are quantized per token (groups of ``group_size`` channels);
      keys per token too, or per channel (``key_axis="channel"``, KIVI): one scale and zero per channel
      for each group of ``group_size`` tokens. ``key_bits`` / ``value_bits`` may be a list with one
      bit width per KV head (mixed precision per head, ``kvlab.affine.MixedAffineLayout``, token axis only).
    * ``KVFormat("mse", key_bits, value_bits, rotation="haar" | "hadamard")``: ``kvlab.MSECodec``,
      keys and values in one slot of the paged cache of ``kvlab.layout`` (``MSESlot``), written
      through a ``slot_mapping`` over a block table per sequence.
    * ``KVFormat("centered", key_bits, value_bits, rotation=...)``: keys with
      ``kvlab.centered.reference.CenteredMSECodec`` (shifted by a calibrated per-channel mean and divided by a
      per-channel scale, then the MSE codec), values with ``kvlab.MSECodec``; the same paged slot as
      ``"mse"``. The cache needs the keys' ``kvlab.calibration.ChannelStats`` (``KVCache(...,
      key_stats=kvlab.calibration.calibrate_keys(model, ids))``, measured on text disjoint from what is evaluated).

    * ``KVFormat("transform")``: ``kvlab.transform`` — per layer a calibrated linear transform of the heads'
      keys (before RoPE when calibrated so) and of their values, a per-token gain and per-component codebooks
      with bits allocated by distortion; the cache needs the calibrated codecs (``KVCache(...,
      transform=kvlab.transform.calibration.calibrate(model, ids))``, on text disjoint from what is evaluated).
      Keys and values in two paged caches of rows ``[num_blocks, block_size, row_bytes]``.

    ``KVCache`` options: one format for every layer or a list with one per layer; ``keep_first`` /
    ``keep_last`` boundary layers left unquantized; a ``residual`` window of the most recent tokens
    left unquantized (KIVI); the first ``sink`` tokens of every sequence left unquantized (the
    attention sink: most heads put much of their attention on the first token).

    Models with sliding-window layers (Gemma 3: five of every six layers attend to the last 512 tokens): a
    sliding layer keeps every token like the others, and the model's attention mask limits what it reads,
    so its outputs are those of a cache that drops older tokens, and its bits per element (a ratio) are
    the same; ``nbytes()`` counts every kept token.

Storage, per layer (``B`` sequences, ``H`` KV heads, head dimension ``D``)
    * token-axis affine: uint8 ``[B, H, tokens, code_bytes]`` (``encode_affine``);
    * channel-axis affine keys: uint8 ``[B, H, tokens / group_size, code_bytes]``; the tokens of the
      group that is not yet full stay unquantized until it fills (KIVI);
    * mixed bits per head: uint8 ``[B, tokens, bytes_per_token]`` (``encode_affine_mixed``);
    * MSE and centred MSE: the paged cache uint8 ``[num_blocks, block_size, H, slot_bytes]`` and a block table per
      sequence;
    * unquantized parts (``fp16`` layers, the sink tokens, the residual window, an open key group) in ``dtype``
      (``float16`` by default; ``None`` keeps the model's dtype, which makes the cache lossless).

    ``nbytes()`` is exactly ``sum over layers and over K, V of quantized_tokens * B * H * D * bits / 8
    + unquantized_tokens * B * H * D * dtype_size``, where ``bits`` is the format's
    ``key_bits_per_element(D)`` / ``value_bits_per_element(D)`` (codes and their metadata). Slots of a
    partly filled MSE block are counted by ``allocated_nbytes()`` only.

When tokens are quantized
    ``update`` first stores the new tokens: the first ``sink`` tokens of a sequence go to an
    unquantized store of their own, the others join the unquantized tail, and the oldest tail tokens
    are encoded until only ``residual`` remain (keys on the channel axis: only whole groups of
    ``group_size`` tokens are encoded). It then returns what attention should see:

    * ``prefill="exact"`` (default): the first call of a layer (the prompt) returns the new keys and
      values as given, so a prompt is processed at full precision, as a serving engine's prefill does;
      every later call returns all tokens as stored (decoded codes, unquantized parts cast back to the
      model's dtype), the new tokens included: a decoding step attends to exactly what the cache holds.
    * ``prefill="stored"``: every call returns the stored tokens, the prompt included.

    For per-token formats (token-axis affine, mixed, MSE) without a residual window, a token's code
    depends on that token only, so with ``prefill="stored"`` (and after the prompt with ``"exact"``) a
    call of n tokens returns the same values as n single-token calls would. In a model another split
    changes the float rounding of deeper layers' keys and values, which can flip a rounding decision of
    a codec. With a residual window or channel-axis keys, a call of several tokens sees the unquantized
    part as it stands after its own write; with ``decode_view`` on, each of its queries sees what a
    decoding step at its position would (``kvlab.hf.decode_view``).

Backends
    ``backend="triton"`` encodes and decodes with kvlab's Triton kernels (``encode_affine``,
    ``encode_affine_mixed``, ``store_mse``, ``load_mse``, ``store_centered_mse``, ``load_centered_mse`` and
    their inverses); ``backend="reference"`` with
    the pure-torch codecs (each op's ``reference``), which produce the same bytes (tested) and are much
    faster than the Triton interpreter on a CPU; ``"auto"`` picks Triton for CUDA tensors and the
    reference otherwise. Codes are byte-equal; decoded affine values are equal too, decoded MSE values
    agree to 1e-6 relative (the load kernel applies the norm correction as one scale per vector,
    the reference divides, then multiplies).

Cost
    Every call decodes the whole quantized part of the layer again (nothing decoded is kept): a call
    costs O(tokens held), so generating n tokens costs O(n^2) decode work in total. Perplexity
    evaluation feeds a window in a few calls (``kvlab.perplexity``), which keeps it linear.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import CacheLayerMixin

from .. import _checks as C
from ..calibration import ChannelStats
from .decode_view import DecodeView, DecodeViewCache, hand_over, quantized_from
from .formats import MSE_CODECS, KVFormat
from .stores import AffineStream, MSEStore, TransformStore, cat_parts, centered_codec, mse_codec

__all__ = ["KVCache", "KVCacheLayer", "KVFormat", "layer_types", "model_shape"]
BACKENDS = ("auto", "triton", "reference")
PREFILL = ("exact", "stored")
STORE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- one layer


class KVCacheLayer(CacheLayerMixin):
    """One layer of a ``KVCache``: its ``KVFormat``, its codes and its unquantized tail."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, fmt: KVFormat, *, num_heads: int, head_dim: int, residual: int, prefill: str,
                 dtype: torch.dtype | None, backend: str, block_size: int,
                 key_stats: ChannelStats | None = None, layer_idx: int = 0, sink: int = 0, transform=None):
        super().__init__()
        self.transform = transform
        self.fmt, self.num_heads, self.head_dim = fmt, num_heads, head_dim
        self.key_stats, self.layer_idx, self.sink = key_stats, layer_idx, sink
        self.residual, self.prefill, self.store_dtype = residual, prefill, dtype
        self.requested_backend, self.block_size = backend, block_size
        self.backend: str | None = None  # resolved at the first update
        self.length = 0
        self.decode_view = False  # keep exact K/V for attention as decoding sees it (kvlab.hf.decode_view)

    def __repr__(self) -> str:
        return f"KVCacheLayer({self.fmt.label}, tokens={self.length})"

    # -- transformers' layer interface

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        if (heads, dim) != (self.num_heads, self.head_dim):
            raise ValueError(
                f"key_states must have {self.num_heads} heads of dimension {self.head_dim}, got shape {tuple(key_states.shape)}"
            )
        self.device, self.batch = key_states.device, batch
        self.dtype = self.store_dtype or key_states.dtype
        want = self.requested_backend
        C.check_backend_device(want, key_states.device)
        self.backend = ("triton" if key_states.device.type == "cuda" else "reference") if want == "auto" else want
        self.k_tail = key_states.new_zeros(batch, heads, 0, dim, dtype=self.dtype)
        self.v_tail = value_states.new_zeros(batch, heads, 0, dim, dtype=self.dtype)
        self.k_sink, self.v_sink = self.k_tail.clone(), self.v_tail.clone()  # the first `sink` tokens
        self.k_codes = self.v_codes = self.mse = None
        self.k_exact, self.v_exact = self.k_tail.clone(), self.v_tail.clone()  # every token, with decode_view
        fmt = self.fmt
        if fmt.codec == "affine":
            self.k_codes = AffineStream(fmt.key_bits, fmt.group_size, fmt.key_axis, heads, dim, self.backend)
            self.v_codes = AffineStream(fmt.value_bits, fmt.group_size, "token", heads, dim, self.backend)
        elif fmt.codec == "transform":
            t = self.transform
            self.mse = TransformStore(t.keys[self.layer_idx], t.values[self.layer_idx], t.rope, heads, dim,
                                       self.block_size, batch, self.device, self.backend)
        elif fmt.codec in MSE_CODECS:
            if fmt.codec == "centered":
                key_codec = centered_codec(dim, fmt.key_bits, fmt.rotation, fmt.seed, self.key_stats, self.layer_idx)
            else:
                key_codec = mse_codec(dim, fmt.key_bits, fmt.rotation, fmt.seed)
            self.mse = MSEStore(key_codec,
                                 mse_codec(dim, fmt.value_bits, fmt.rotation, fmt.seed),
                                 heads, self.block_size, batch, self.device, self.backend)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens; return the keys and values attention uses (see the module docstring).

        The inputs are checked first (``_check_states``); a call that raises leaves the layer exactly as it was.
        """
        self._check_states(key_states, value_states)
        saved = self._snapshot()
        try:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            first = self.length == 0
            self._store(key_states, value_states)
            if first and self.prefill == "exact":
                if self.decode_view:
                    hand_over(self.layer_idx, None)
                return key_states, value_states
            if self.decode_view:
                hand_over(self.layer_idx, self._decode_view())
            return self._read(key_states.dtype)
        except BaseException:
            self._restore(saved)
            raise

    def _check_states(self, key_states, value_states) -> None:
        """Types, dtypes, shapes and devices of an update, and values that the layer can store (one host sync)."""
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            C.check_states(name, x)
            if x.dim() != 4:
                raise ValueError(f"{name} must be [batch, {self.num_heads}, tokens, {self.head_dim}] "
                                 f"(batch, KV heads, tokens, head_dim), got shape {tuple(x.shape)}")
        batch = self.batch if self.is_initialized else key_states.shape[0]
        want = f"[{batch}, {self.num_heads}, tokens, {self.head_dim}]"
        if key_states.shape[0] != batch or key_states.shape[1:2] + key_states.shape[3:] != (self.num_heads, self.head_dim):
            raise ValueError(f"key_states must be {want} (the batch of the layer's first update, its KV heads and head_dim), "
                             f"got shape {tuple(key_states.shape)}")
        if value_states.shape != key_states.shape:
            raise ValueError(f"value_states must have the shape of key_states {tuple(key_states.shape)}, "
                             f"got {tuple(value_states.shape)}")
        if value_states.dtype != key_states.dtype:
            raise TypeError(f"value_states must have the dtype of key_states ({key_states.dtype}), got {value_states.dtype}")
        C.check_same_device(key_states=key_states, value_states=value_states)
        if self.is_initialized and key_states.device != self.device:
            raise ValueError(f"key_states must be on {self.device} (the device of the layer's first update), "
                             f"got {key_states.device}")
        store = self.store_dtype or key_states.dtype
        flags = torch.stack([C.store_flags(key_states, store), C.store_flags(value_states, store)]).tolist()  # one sync
        for name, x, f in zip(("key_states", "value_states"), (key_states, value_states), flags):
            C.raise_store_flags(name, x, f, store, "the dtype of the cache's unquantized parts",
                                " (or pass KVCache(dtype=torch.float32), or dtype=None: the model's dtype)")

    def _snapshot(self):
        """What ``_restore`` needs to undo a failed update (tensors are replaced, not written in place, except the
        paged MSE cache, whose checked writes undo themselves)."""
        parts = {name: dict(part.__dict__) for name in ("k_codes", "v_codes", "mse")
                 if (part := self.__dict__.get(name)) is not None}
        if "mse" in parts:
            parts["mse"]["block_table"] = [list(t) for t in self.mse.block_table]  # the transform store's too
        return dict(self.__dict__), parts

    def _restore(self, saved) -> None:
        state, parts = saved
        self.__dict__.clear()
        self.__dict__.update(state)
        for name, fields in parts.items():
            part = getattr(self, name)
            part.__dict__.clear()
            part.__dict__.update(fields)

    def _mark(self):
        """A snapshot to undo a whole successful update later (``KVCache``'s forward-pass journal). Tensors that
        updates only extend (the exact copies, the sink, an fp16 layer's tail, codes and pages) are kept as their
        lengths and cut back on undo, so the journal holds no second copy of the cache."""
        state, parts = self._snapshot()
        grow = ("k_exact", "v_exact", "k_sink", "v_sink") + (("k_tail", "v_tail") if self.fmt.codec == "fp16" else ())
        lengths = {(None, name): (2, state.pop(name).shape[2]) for name in grow if isinstance(state.get(name), torch.Tensor)}
        for part, fields in parts.items():
            for name, axis in getattr(state[part], "GROWING", {}).items():
                if isinstance(fields.get(name), torch.Tensor):
                    lengths[part, name] = (axis, fields.pop(name).shape[axis])
        return state, parts, lengths

    def _undo(self, mark) -> None:
        state, parts, lengths = mark
        owner = lambda part: self if part is None else self.__dict__[part]
        grown = {key: owner(key[0]).__dict__[key[1]] for key in lengths}
        self._restore((state, parts))
        for (part, name), (axis, n) in lengths.items():
            owner(part).__dict__[name] = grown[part, name].narrow(axis, 0, n)

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.decode_view:
            self.k_exact = torch.cat([self.k_exact, k.to(self.dtype)], 2)
            self.v_exact = torch.cat([self.v_exact, v.to(self.dtype)], 2)
        into_sink = min(max(0, self.sink - self.length), k.shape[2])
        if into_sink and self.fmt.codec != "fp16":
            self.k_sink = torch.cat([self.k_sink, k[:, :, :into_sink].to(self.dtype)], 2)
            self.v_sink = torch.cat([self.v_sink, v[:, :, :into_sink].to(self.dtype)], 2)
            self.length += into_sink
            k, v = k[:, :, into_sink:], v[:, :, into_sink:]
        self.k_tail = torch.cat([self.k_tail, k.to(self.dtype)], 2)
        self.v_tail = torch.cat([self.v_tail, v.to(self.dtype)], 2)
        self.length += k.shape[2]
        if self.fmt.codec == "fp16":
            return
        if self.mse is not None:
            n = max(0, self.k_tail.shape[2] - self.residual)
            if n:
                if self.mse.tokens == 0:
                    self.mse.first_position = self.k_sink.shape[2]  # the sink tokens come first
                self.mse.write(self.k_tail[:, :, :n], self.v_tail[:, :, :n])
                self.k_tail, self.v_tail = self.k_tail[:, :, n:].clone(), self.v_tail[:, :, n:].clone()
            return
        for name, stream in (("k_tail", self.k_codes), ("v_tail", self.v_codes)):
            tail = getattr(self, name)
            n = max(0, tail.shape[2] - self.residual) // stream.unit * stream.unit
            if n:
                stream.write(tail[:, :, :n])
                setattr(self, name, tail[:, :, n:].clone())

    def _decode_view(self) -> DecodeView:
        """The exact keys and values and, for K and V, the length from which decoding reads each token's code."""
        if self.k_exact.shape[2] != self.length:
            raise ValueError("decode_view must be set before a layer's first update")
        quantized = self.fmt.codec != "fp16"
        sink = self.sink if quantized else 0
        k_unit = self.k_codes.unit if self.k_codes is not None else 1
        return DecodeView(self.layer_idx, self.k_exact, self.v_exact,
                          quantized_from(self.length, sink=sink, residual=self.residual, unit=k_unit, quantized=quantized),
                          quantized_from(self.length, sink=sink, residual=self.residual, quantized=quantized))

    def _read(self, dtype: torch.dtype):
        if self.mse is not None:
            k_q, v_q = self.mse.read(dtype)
        elif self.k_codes is not None:
            k_q, v_q = self.k_codes.read(dtype), self.v_codes.read(dtype)
        else:
            k_q = v_q = None
        return (cat_parts([self.k_sink.to(dtype), k_q, self.k_tail.to(dtype)], 2),
                cat_parts([self.v_sink.to(dtype), v_q, self.v_tail.to(dtype)], 2))

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Drop every stored token; the next update starts from scratch (a new prompt)."""
        self.is_initialized = False
        self.length = 0
        self.k_tail = self.v_tail = self.k_codes = self.v_codes = self.mse = self.k_sink = self.v_sink = None
        self.k_exact = self.v_exact = None

    def _unsupported(self, what: str):
        raise NotImplementedError(f"KVCache does not support {what} (greedy decoding and sampling work)")

    def reorder_cache(self, beam_idx) -> None:
        self._unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("crop (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        self._unsupported("batch_select_indices")

    def offload(self):
        self._unsupported("offloading")

    def prefetch(self):
        self._unsupported("offloading")

    # -- memory

    def quantized_tokens(self) -> tuple[int, int]:
        """Tokens whose keys and whose values are stored as codes."""
        if not self.is_initialized or self.fmt.codec == "fp16":
            return 0, 0
        if self.mse is not None:
            return self.mse.tokens, self.mse.tokens
        return self.k_codes.tokens, self.v_codes.tokens

    def nbytes(self) -> int:
        """Bytes of the codes and the unquantized tail held for the stored tokens."""
        if not self.is_initialized:
            return 0
        unquantized = self.k_tail.numel() + self.v_tail.numel() + self.k_sink.numel() + self.v_sink.numel()
        tail = unquantized * self.k_tail.element_size()
        if self.mse is not None:
            return tail + self.mse.nbytes()
        if self.k_codes is not None:
            return tail + self.k_codes.nbytes() + self.v_codes.nbytes()
        return tail

    def allocated_nbytes(self) -> int:
        """``nbytes()`` plus the unused slots of partly filled MSE blocks."""
        extra = self.mse.allocated_nbytes() - self.mse.nbytes() if self.is_initialized and self.mse is not None else 0
        return self.nbytes() + extra


# ----------------------------------------------------------------------------- the cache


def check_transform(transform, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
    """``transform`` must be a ``kvlab.transform.TransformKV`` with codecs for every layer of the model's shape."""
    from ..transform import TransformKV

    if not isinstance(transform, TransformKV):
        raise TypeError(f"transform must be a kvlab.transform.TransformKV (kvlab.transform.calibration.calibrate), "
                        f"got {type(transform).__name__}")
    if transform.layers != num_layers:
        raise ValueError(f"transform has codecs for {transform.layers} layers, the model has {num_layers}")
    for part, codecs in (("keys", transform.keys), ("values", transform.values)):
        for i, c in enumerate(codecs):
            if c.groups * c.dim != num_kv_heads * head_dim:
                raise ValueError(f"transform.{part}[{i}] codes {c.groups} x {c.dim} numbers per token, the "
                                 f"model's layer holds {num_kv_heads} x {head_dim}")
    if transform.rope is not None and transform.rope.dim != head_dim:
        raise ValueError(f"transform.rope rotates {transform.rope.dim} channels, the model's heads have {head_dim}")


def model_shape(config, who: str = "KVCache", sliding: bool = False) -> tuple[int, int, int]:
    """``(layers, KV heads, head_dim)`` of a transformers config. Layers of sliding-window attention are
    allowed with ``sliding=True`` (``KVCache``: it keeps all their tokens, the model's masks limit what they
    read); otherwise a ValueError unless every layer is full attention."""
    if not hasattr(config, "num_hidden_layers") and not hasattr(config, "get_text_config"):
        raise TypeError(f"config must be a transformers model config (model.config), got {type(config).__name__}")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    num_layers = text.num_hidden_layers
    num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    allowed = ("full_attention", "sliding_attention") if sliding else ("full_attention",)
    for kind in sorted(set(layer_types(config))):
        if kind not in allowed:
            raise ValueError(f"{who} supports models with {' and '.join(allowed)} layers only, got layer type {kind!r}"
                             + (" (the config's sliding_window)" if kind == "sliding_attention" else ""))
    return num_layers, num_kv_heads, head_dim


def layer_types(config) -> list[str]:
    """Each layer's attention type: the config's ``layer_types``, or, for configs without them (Mistral, Phi-3), every
    layer ``"sliding_attention"`` where ``sliding_window`` is set (and ``use_sliding_window`` not False)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = getattr(text, "layer_types", None)
    if kinds:
        return list(kinds)
    sliding = getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True) is not False
    return ["sliding_attention" if sliding else "full_attention"] * text.num_hidden_layers


class KVCache(DecodeViewCache):
    """A transformers ``Cache`` whose layers store K and V as kvlab codes (see the module docstring).

    ``KVCache(fmt, config=model.config)`` or, without a model config, ``KVCache(fmt, num_layers=...,
    num_kv_heads=..., head_dim=...)``.

    * ``fmt``: a ``KVFormat`` for every layer, or a list with one per layer.
    * ``keep_first`` / ``keep_last``: the first / last layers stored unquantized (fp16).
    * ``residual``: the most recent tokens of every layer stay unquantized (KIVI's window).
    * ``sink``: the first tokens of every sequence stay unquantized (the attention sink).
      Both default to 0, and with ``KVFormat("transform")`` to what ``transform`` was calibrated for.
    * ``prefill``: ``"exact"`` (a layer's first call returns its inputs as given) or ``"stored"``.
    * ``dtype``: dtype of the unquantized parts (``float16``; ``None``: the model's dtype).
    * ``backend``: ``"auto"`` (Triton on CUDA, the pure-torch reference elsewhere), ``"triton"``,
      ``"reference"``; both give the same bytes.
    * ``block_size``: tokens per block of the paged MSE cache.
    * ``key_stats``: the keys' ``ChannelStats`` (``kvlab.calibration.calibrate_keys``), ``[num_layers,
      num_kv_heads, head_dim]``; required when a layer uses ``KVFormat("centered", ...)``.

    ``decode_view`` (attribute, off by default; set it before the first update): every call attends as
    token-by-token decoding would (``kvlab.hf.decode_view``), through the attention implementation named by
    ``attn_implementation``. ``kvlab.perplexity`` turns it on.
    """

    def __init__(self, fmt: KVFormat | Sequence[KVFormat] = KVFormat("fp16"), *, config=None,
                 num_layers: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None,
                 keep_first: int = 0, keep_last: int = 0, residual: int | None = None, sink: int | None = None,
                 prefill: str = "exact",
                 dtype: torch.dtype | None = torch.float16, backend: str = "auto", block_size: int = 16,
                 key_stats: ChannelStats | None = None, transform=None):
        if config is not None:
            if num_layers is not None or num_kv_heads is not None or head_dim is not None:
                raise ValueError("pass either config or num_layers, num_kv_heads and head_dim, not both")
            num_layers, num_kv_heads, head_dim = model_shape(config, "KVCache", sliding=True)
        elif num_layers is None or num_kv_heads is None or head_dim is None:
            raise TypeError("KVCache needs config= or all of num_layers=, num_kv_heads=, head_dim=")
        C.check_int("num_layers", num_layers, minimum=1)
        C.check_int("num_kv_heads", num_kv_heads, minimum=1)
        C.check_int("head_dim", head_dim, minimum=1)
        if isinstance(fmt, KVFormat):
            formats = [fmt] * num_layers
        elif isinstance(fmt, (list, tuple)):
            if len(fmt) != num_layers:
                raise ValueError(f"fmt has {len(fmt)} formats but the model has {num_layers} layers (one format per layer)")
            for i, f in enumerate(fmt):
                if not isinstance(f, KVFormat):
                    raise TypeError(f"fmt[{i}] must be a KVFormat, got {type(f).__name__}")
            formats = list(fmt)
        else:
            raise TypeError(f"fmt must be a KVFormat or a list of KVFormat (one per layer), got {type(fmt).__name__}")
        C.check_int("keep_first", keep_first, minimum=0)
        C.check_int("keep_last", keep_last, minimum=0)
        if keep_first + keep_last > num_layers:
            raise ValueError(f"keep_first + keep_last ({keep_first} + {keep_last}) exceeds the model's {num_layers} layers")
        uses_transform = any(f.codec == "transform" for f in formats)
        if transform is not None and not uses_transform:
            raise ValueError("transform is for KVFormat('transform') layers; fmt has none")
        if uses_transform and transform is not None:  # by default the tokens the codecs were calibrated to keep
            sink = getattr(transform, "sink", 0) if sink is None else sink
            residual = getattr(transform, "residual", 0) if residual is None else residual
        residual, sink = (0 if residual is None else residual), (0 if sink is None else sink)
        C.check_int("residual", residual, minimum=0)
        C.check_int("sink", sink, minimum=0)
        C.check_choice("prefill", prefill, PREFILL)
        if dtype is not None and dtype not in STORE_DTYPES:
            raise TypeError(f"dtype must be None or one of (float16, bfloat16, float32), got {dtype}")
        C.check_choice("backend", backend, BACKENDS)
        C.check_int("block_size", block_size, minimum=1)
        for f in set(formats):
            f.check(num_kv_heads, head_dim)
        for i in [*range(keep_first), *range(num_layers - keep_last, num_layers)]:
            formats[i] = KVFormat("fp16")
        if key_stats is not None:
            if not isinstance(key_stats, ChannelStats):
                raise TypeError(f"key_stats must be a kvlab.calibration.ChannelStats (calibrate_keys), "
                                f"got {type(key_stats).__name__}")
            if key_stats.shape != (num_layers, num_kv_heads, head_dim):
                raise ValueError(f"key_stats has shape {key_stats.shape}, the model needs "
                                 f"[{num_layers}, {num_kv_heads}, {head_dim}] (layers, KV heads, head_dim)")
        elif any(f.codec == "centered" for f in formats):
            raise ValueError("KVFormat('centered', ...) needs the keys' channel statistics: "
                             "KVCache(..., key_stats=kvlab.calibration.calibrate_keys(model, calibration_ids))")

        if transform is not None:
            check_transform(transform, num_layers, num_kv_heads, head_dim)
        elif any(f.codec == "transform" for f in formats):
            raise ValueError("KVFormat('transform') needs the calibrated codecs: "
                             "KVCache(..., transform=kvlab.transform.calibration.calibrate(model, calibration_ids))")
        self.transform = transform
        self.formats = formats
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.keep_first, self.keep_last, self.residual, self.sink = keep_first, keep_last, residual, sink
        self.prefill, self.store_dtype, self.key_stats = prefill, dtype, key_stats
        layers = [
            KVCacheLayer(f, num_heads=num_kv_heads, head_dim=head_dim, residual=residual, prefill=prefill,
                         dtype=dtype, backend=backend, block_size=block_size, key_stats=key_stats, layer_idx=i,
                         sink=sink, transform=transform)
            for i, f in enumerate(formats)
        ]
        super().__init__(layers=layers)
        self._journal = []  # (layer, mark) of the layers the current forward pass has updated

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the new tokens of layer ``layer_idx``; return what attention uses (the layer's ``update``).

        A forward pass updates layers ``0, 1, ...`` in turn; an update that raises in any layer undoes the pass's
        updates of the layers before it, so the cache is as it was before the pass. A layer index the cache does not
        have changes nothing. (A pass that fails between layers in the model's own code leaves the earlier layers'
        tokens: start again with a new cache.)"""
        self._check_layer_idx(layer_idx)  # a bad index changes nothing, not even the pass's earlier layers
        journal = self._journal if layer_idx != 0 else []
        try:
            layer = self.layers[layer_idx]
            mark = (layer, layer._mark())
            out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException:
            for done, saved in reversed(journal):
                done._undo(saved)
            self._journal = []
            raise
        journal.append(mark)
        self._journal = [] if layer_idx == len(self.layers) - 1 else journal  # the last layer: the pass is complete
        return out

    def reset(self) -> None:
        self._journal = []
        super().reset()

    def __repr__(self) -> str:
        labels = sorted({f.label for f in self.formats})
        return (f"KVCache({', '.join(labels)}; layers={len(self.layers)}, keep_first={self.keep_first}, "
                f"keep_last={self.keep_last}, residual={self.residual}, sink={self.sink}, tokens={self.get_seq_length()})")

    @property
    def bits_per_element(self) -> float:
        """Bits per stored K/V element of the codes, metadata included, averaged over layers.

        Unquantized layers count 16 bits. The sink tokens, the residual window and an open key group are not included:
        ``nbytes()`` counts them at the size of ``dtype``.
        """
        def bits(i, f):
            if f.codec != "transform":
                return f.bits_per_element(self.head_dim)
            return 0.5 * (self.transform.keys[i].bits_per_element + self.transform.values[i].bits_per_element)

        return sum(bits(i, f) for i, f in enumerate(self.formats)) / len(self.formats)

    @property
    def backend(self) -> list[str | None]:
        """The back end of every layer (None before its first update)."""
        return [layer.backend for layer in self.layers]

    def nbytes(self) -> int:
        """Bytes held for the stored tokens: codes with their metadata, plus the unquantized parts."""
        return sum(layer.nbytes() for layer in self.layers)

    def allocated_nbytes(self) -> int:
        """Bytes of every tensor the cache holds, including unused slots of partly filled MSE blocks."""
        return sum(layer.allocated_nbytes() for layer in self.layers)

    def held_bits_per_element(self) -> float:
        """``8 * nbytes()`` per stored key and value element, everything included (nan when empty)."""
        elements = sum(2 * layer.batch * layer.length * self.num_kv_heads * self.head_dim
                       for layer in self.layers if layer.is_initialized)
        return 8.0 * self.nbytes() / elements if elements else float("nan")
