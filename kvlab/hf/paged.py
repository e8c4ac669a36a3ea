"""The paged cache a model decodes from with ``decode_attention``: ``PagedKVCache`` and the ``"kvlab"`` attention.

What
    * **Prompt (prefill).** The prompt attends to its own keys and values at full precision (torch
      SDPA on the exact K/V, as a serving engine's prefill does); then each sequence's tokens are
      stored in the paged cache (padding tokens are not stored: a sequence's tokens are contiguous
      from position 0 of its blocks).
    * **Decode.** Each step stores the new token of each sequence in its slot and calls
      ``kvlab.decode_attention`` over the paged cache: the query is rotated once, scores and the
      weighted sum are formed in rotated space from the codes, the output is rotated back once. No
      cached vector is decoded to model space; a step costs O(tokens held) bytes read, nothing more.
    * **Continuation.** Several new tokens on a cache that holds a context (chunked prefill, a second
      turn) are stored, then attend causally over the whole context through the materialising path
      (``kvlab.prefill_attention``: model-space K/V of the context from one batched inverse rotation,
      then SDPA).

    ``PagedKVCache`` is a ``transformers.Cache`` and ``"kvlab"`` an attention implementation registered
    with ``transformers.AttentionInterface`` (with its mask function in ``AttentionMaskInterface``). A
    model generates through them (importing this module, as building a ``PagedKVCache`` does, registers both)::

        cache = kvlab.PagedKVCache(KVFormat("mse", 4, 4, rotation="hadamard"), config=model.config,
                                   batch_size=2, max_length=4096, device="cuda")
        model.set_attn_implementation("kvlab")
        out = model.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=64)

    The blocks are allocated up front, the slot of a new token and the sequence lengths are computed on
    the device: with ``check_steps=False`` nothing in a decode step syncs with the host, so a step can
    be captured in a CUDA graph (``kvlab.generate``, ``kvlab.hf.generation``).

Formats
    The fused decode reads MSE caches (``KVFormat("mse", kb, vb)``, 2, 3 or 4 bits each, Haar or
    Hadamard rotation), token-axis affine caches (``KVFormat("affine", kb, vb)``, 4 or 8 bits
    each) and transform-codec caches (``KVFormat("transform")`` with ``transform=``, the calibrated
    ``kvlab.transform.TransformKV``: ``kvlab.transform.attention.decode_attention`` scores keys coded
    after RoPE in the transformed space, decodes keys coded before RoPE per tile; a continuation decodes
    the context; codecs calibrated to keep tokens in 16 bit, ``calibrate``'s default, are refused: their bits
    assume those tokens), head dims 64, 128 and 256. Other formats (fp16, channel-axis keys, mixed bits per head,
    centred keys, other head dims) generate through ``kvlab.KVCache``, which decodes the stored
    tokens for every step (the materialising path); ``kvlab.generate`` picks it for them and says so
    in ``GenerateOutput.path``.

Backends
    ``backend="triton"`` stores with ``store_mse`` / ``store_affine`` and attends with
    ``decode_attention`` / ``prefill_attention`` (on a CPU under Triton's interpreter);
    ``"reference"`` stores with the pure-torch codecs (same bytes) and attends with
    ``kvlab.attention.reference.decode_attention_reference`` / ``prefill_attention_reference`` (fp64
    attention over the dequantized cache); ``"auto"`` picks Triton on CUDA and the reference on a
    CPU.
"""

from __future__ import annotations

import threading
import weakref

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import _checks as C
from .cache import KVFormat, check_transform, model_shape
from .held import attend_held, store_held
from ..layout import AffineSlot
from ..affine.paged import AffineStoreStep
from ..attention.api import DecodeStep
from ..attention import decode_attention, prefill_attention
from ..affine import store_affine
from ..layout import ATTENTION_AFFINE_BITS as AFFINE_BITS, HEAD_DIMS, MSESlot
from ..mse.api import MSEStoreStep, store_mse
from ..affine.reference import AffineCodec, store_affine_reference
from ..mse.reference import MSECodec, store_slots
from ..attention.reference import decode_attention_reference, prefill_attention_reference

__all__ = ["ATTENTION", "PagedKVCache", "PagedKVCacheLayer", "fused_support", "in_fused_layout", "paged_attention"]

ATTENTION = "kvlab"  # the attention implementation name: model.set_attn_implementation("kvlab")
BACKENDS = ("auto", "triton", "reference")
COMPUTE_DTYPES = (torch.float16, torch.bfloat16)


def in_fused_layout(transform, num_kv_heads: int) -> bool:
    """Whether calibrated transform codecs are in the fused layout (``calibrate(..., layout="fused")``): their decode
    merges 16-bit sink and window tokens with the codes, and a step can be captured in a CUDA graph."""
    from ..transform.fused import in_layout

    return transform.rope is None and in_layout((*transform.keys, *transform.values), num_kv_heads)


def fused_support(fmt: KVFormat, head_dim: int) -> str | None:
    """None if ``decode_attention`` reads caches of ``fmt`` at ``head_dim``; else why not (a sentence)."""
    if not isinstance(fmt, KVFormat):
        raise TypeError(f"fmt must be a kvlab.KVFormat, got {type(fmt).__name__}")
    if head_dim not in HEAD_DIMS:
        return f"the fused decode reads head dims {HEAD_DIMS}, the model's is {head_dim}"
    if fmt.codec in ("mse", "transform"):
        return None
    if fmt.codec == "affine":
        if fmt.mixed:
            return "the fused decode reads one bit width per part, not bits per head"
        if fmt.key_axis != "token":
            return "the fused decode reads token-axis affine keys, not channel-axis (KIVI) keys"
        if fmt.key_bits not in AFFINE_BITS or fmt.value_bits not in AFFINE_BITS:
            return f"the fused decode reads affine codes of {AFFINE_BITS} bits"
        return None
    return f"the fused decode reads 'mse', 'affine' and 'transform' caches, not {fmt.codec!r}"


# ----------------------------------------------------------------------------- the cache


def _rope(rope, x: torch.Tensor, positions: torch.Tensor, undo: bool) -> torch.Tensor:
    """RoPE (``undo``: its inverse) of ``x [N, H, D]`` at ``positions [N]``, in float64 on ``x``'s device (no host
    sync, so that a decode step can be captured in a CUDA graph): float32."""
    angle = positions.to(x.device, torch.float64)[:, None] * rope.inv_freq.to(x.device)
    angle = torch.cat([angle, angle], -1)[:, None]  # [N, 1, D]
    cos, sin = rope.scaling * angle.cos(), rope.scaling * angle.sin()
    x = x.double()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    if undo:
        return ((x * cos - rotated * sin) / rope.scaling**2).float()
    return (x * cos + rotated * sin).float()


class PagedKVCacheLayer(CacheLayerMixin):
    """One layer of a ``PagedKVCache``: the paged codes, a block table and a length per sequence."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: "PagedKVCache", layer_idx: int):
        super().__init__()
        # the cache owns its layers; a layer sees the cache through a weak proxy, so no cycle keeps the codes alive
        self.owner, self.layer_idx, self.batch_size = weakref.proxy(owner), layer_idx, owner.batch
        self.length = 0  # tokens given per sequence, padding included (the model's view of the cache)
        o = owner
        self.kv16 = None
        if o.kind == "transform":  # keys and values in two caches of the layer's codec rows
            self.key_codec, self.value_codec = o.transform.keys[layer_idx], o.transform.values[layer_idx]
            self.k_cache, self.v_cache = (torch.zeros(o.batch * o.max_blocks, o.block_size, c.row_bytes,
                                                      dtype=torch.uint8, device=o.device)
                                          for c in (self.key_codec, self.value_codec))
            self.cache = self.k_cache
            # the first `sink` tokens and a ring of the last `residual` in fp16 (codecs calibrated to keep them)
            held = o.transform.sink + o.transform.residual
            self.kv16 = torch.zeros(o.batch, held, 2, o.num_kv_heads, o.head_dim, dtype=torch.float16,
                                    device=o.device) if held else None  # [B, sink + residual, K/V, H, D]
        else:
            self.cache = torch.zeros(o.batch * o.max_blocks, o.block_size, o.num_kv_heads, o.slot_bytes,
                                     dtype=torch.uint8, device=o.device)
        self.seq_lens = torch.zeros(o.batch, dtype=torch.int32, device=o.device)  # tokens stored per sequence
        self._store_step, self._decode_steps = None, {}  # a decode step's launches, prepared on first use
        self.is_initialized = True

    def __repr__(self) -> str:
        return f"PagedKVCacheLayer({self.owner.fmt.label}, tokens={self.length})"

    # -- transformers' layer interface

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("PagedKVCache.update hands the new keys and values to kvlab's attention")

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return self.owner.max_length

    def reset(self) -> None:
        self.length = 0
        self.seq_lens.zero_()

    # -- storing and reading

    def _slots(self, n: int, valid: torch.Tensor | None) -> torch.Tensor:
        """Slots of ``n`` new tokens per sequence, sequence-major ``[B * n]``; -1 for tokens not stored."""
        o = self.owner
        if valid is None and n == 1:  # a decode step: sequence b's next slot is its first slot plus its length
            return o.first_slot + self.seq_lens
        if valid is None:
            rank = torch.arange(n, device=o.device).expand(o.batch, n)
        else:
            rank = valid.to(torch.int32).cumsum(1) - 1
        pos = (self.seq_lens[:, None] + rank).long()  # [B, n]
        block = o.block_table.long().gather(1, (pos // o.block_size).clamp(0, o.max_blocks - 1))
        slots = block * o.block_size + pos % o.block_size
        if valid is not None:
            slots = torch.where(valid, slots, -1)
        return slots.reshape(-1)

    def store(self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Store ``key``/``value`` ``[B, H, n, D]`` after each sequence's stored tokens (``valid [B, n]``: which). A
        store that raises undoes every store of the forward pass, this layer's included."""
        o = self.owner
        n = key.shape[2]
        step = n == 1 and valid is None and not o.check_steps
        if self.layer_idx == 0:
            o._undo = []  # a new forward pass
        # what undoes this layer's store if the pass fails (a decode step adds one token to every sequence: no copy)
        o._undo.append((self, self.length, None if step else self.seq_lens.clone()))
        try:
            if self.length + n > o.max_length:
                raise ValueError(f"the cache holds max_length={o.max_length} tokens per sequence; it holds "
                                 f"{self.length} and was given {n} more")
            if self.length != (held := o._undo[0][1]):
                raise ValueError(f"layer {self.layer_idx} holds {self.length} tokens but layer 0 held {held} before "
                                 f"this forward pass: an earlier pass failed partway; start again with a new cache")
            self._write(key, value, valid, step)
        except BaseException:
            o._rollback()
            raise

    def _write(self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None, step: bool) -> None:
        o = self.owner
        batch, heads, n, dim = key.shape
        slots = self._slots(n, valid)
        if o.kind == "transform":
            self._store_transform(key, value, slots, n, valid)
            self.seq_lens += n if valid is None else valid.sum(1, dtype=torch.int32)
            self.length += n
            return
        dtype = key.dtype if key.dtype in COMPUTE_DTYPES else torch.float16
        k = key.transpose(1, 2).reshape(batch * n, heads, dim).to(dtype)
        v = value.transpose(1, 2).reshape(batch * n, heads, dim).to(dtype)
        kc, vc = o.key_codec, o.value_codec
        if not step:  # a prompt, a continuation or a checked step: host syncs
            self._store_checked(key, value, k, v, slots, dtype)
        elif o.backend == "triton":  # a decode step: launches prepared once, nothing checked, no sync
            prepared = self._store_step
            if prepared is None or prepared.shape != tuple(k.shape) or prepared.dtype != k.dtype:
                kind = MSEStoreStep if o.kind == "mse" else AffineStoreStep
                prepared = self._store_step = kind(k, v, slots, self.cache, kc, vc)
            prepared(k, v, slots)
        elif o.kind == "mse":
            store_slots(self.cache, slots, kc.encode(k), vc.encode(v), o.layout)
        else:
            store_affine_reference(self.cache, slots, k, v, kc, vc)
        self.seq_lens += n if valid is None else valid.sum(1, dtype=torch.int32)
        self.length += n

    def _store_checked(self, key, value, k, v, slots, dtype) -> None:
        """Store a prompt's (or a continuation's) ``k``/``v`` after checking that they can be stored: finite, within
        ``dtype``'s range (and their norms within fp16's), no nonzero vector below its normal range."""
        o = self.owner
        for name, x, x16 in (("key_states", key, k), ("value_states", value, v)):
            C.check_store(name, x, dtype, f"the {dtype} the kernels read")
            if o.kind == "mse":
                C.check_fp16_scales(name, x16.float().norm(dim=-1).flatten(), "norm")
        if o.backend == "triton" and o.kind == "mse":
            store_mse(k, v, slots, self.cache, o.key_codec, o.value_codec, check=True)
        elif o.backend == "triton":
            store_affine(k, v, slots, self.cache, o.key_codec, o.value_codec, check=True)
        elif o.kind == "mse":
            store_slots(self.cache, slots, o.key_codec.encode(k), o.value_codec.encode(v), o.layout)
        else:
            store_affine_reference(self.cache, slots, k, v, o.key_codec, o.value_codec)

    def _store_transform(self, key, value, slots, n: int, valid) -> None:
        """Keys (RoPE undone at their positions when the codecs code keys before RoPE) and values through the
        transform codec. A prompt or a continuation is checked first (both parts' gains, host syncs) and undone in
        every layer if it fails; a decode step is neither checked nor synced."""
        from ..transform import api as TA, reference as TR, triton as TK

        o = self.owner
        batch, heads, _, dim = key.shape
        k = key.transpose(1, 2).reshape(batch * n, heads, dim).float()
        v = value.transpose(1, 2).reshape(batch * n, heads * dim).float()
        if o.transform.rope is not None:
            rank = torch.arange(n, device=o.device).expand(batch, n) if valid is None else valid.int().cumsum(1) - 1
            k = _rope(o.transform.rope, k, (self.seq_lens[:, None] + rank).clamp_min(0).reshape(-1), undo=True)
        k = k.reshape(batch * n, heads * dim)
        M = TA if o.backend == "triton" else TR
        ys = (M.transform(self.key_codec, k), M.transform(self.value_codec, v))
        if not (n == 1 and valid is None) or o.check_steps:
            keep = slots >= 0
            for name, x, codec, y in (("key_states", key, self.key_codec, ys[0]),
                                      ("value_states", value, self.value_codec, ys[1])):
                C.check_finite(name, x)
                M.check_gains(codec, y[keep], name)
        for codec, cache, y in ((self.key_codec, self.k_cache, ys[0]), (self.value_codec, self.v_cache, ys[1])):
            if o.backend == "triton":
                TK.store_transform(y, codec, cache, slots)
            else:
                TR.write_rows(cache.view(-1, codec.row_bytes), slots, TR.pack(codec, *TR.quantize(codec, y)))
        if self.kv16 is not None:
            store_held(self.kv16, self.seq_lens, key, value, valid, o.transform.sink, o.transform.residual)

    def decode(self, q: torch.Tensor, scale: float, block_table=None, seq_lens=None, backend=None) -> torch.Tensor:
        """Attention of ``q [B, Hq, D]`` (one token per sequence) over the stored tokens: ``[B, Hq, D]``."""
        o = self.owner
        table = o.block_table if block_table is None else block_table
        lens = self.seq_lens if seq_lens is None else seq_lens
        if o.kind == "transform":
            from ..transform import reference as TR
            from ..transform.attention import decode_attention as transform_decode

            if self.kv16 is not None:  # the coded tokens between the sink and the ring, merged with the fp16 ones
                sink, residual = o.transform.sink, o.transform.residual
                args = (q, self.k_cache, self.v_cache, table, (lens - residual).clamp_min(0), self.key_codec,
                        self.value_codec)
                if (backend or o.backend) == "reference":
                    out, lse = TR.decode_attention(*args, scale=scale, first=sink, return_lse=True)
                else:
                    out, lse = transform_decode(*args, scale=scale, check=False, first=sink, return_lse=True)
                return attend_held(self.kv16, q, scale, lens, out, lse, sink, residual).to(q.dtype)
            args = (q, self.k_cache, self.v_cache, table, lens, self.key_codec, self.value_codec)
            if (backend or o.backend) == "reference":
                return TR.decode_attention(*args, scale=scale, rope=o.transform.rope).to(q.dtype)
            return transform_decode(*args, scale=scale, rope=o.transform.rope, check=False).to(q.dtype)
        if (backend or o.backend) == "reference":
            out = decode_attention_reference(q, self.cache, table, lens, o.key_codec, o.value_codec, scale=scale)
            return out.to(q.dtype)
        qh = q if q.dtype in COMPUTE_DTYPES else q.to(torch.float16)
        if block_table is None and seq_lens is None:  # the layer's own tables: launches prepared once
            key = (tuple(qh.shape), qh.dtype, scale)
            step = self._decode_steps.get(key)
            if step is None:
                step = self._decode_steps[key] = DecodeStep(qh, self.cache, table, lens, o.key_codec, o.value_codec,
                                                             scale=scale)
            return step(qh).to(q.dtype)
        out = decode_attention(qh, self.cache, table, lens, o.key_codec, o.value_codec, scale=scale, check=False)
        return out.to(q.dtype)

    def prefill(self, q: torch.Tensor, scale: float, block_table=None, seq_lens=None, backend=None) -> torch.Tensor:
        """Causal attention of ``q [B, n, Hq, D]``, the last ``n`` stored tokens, over the context: ``[B, n, Hq, D]``."""
        o = self.owner
        table = o.block_table if block_table is None else block_table
        lens = self.seq_lens if seq_lens is None else seq_lens
        if o.kind == "transform":
            return self._prefill_transform(q, scale, table, lens, backend or o.backend)
        if (backend or o.backend) == "reference":
            out = prefill_attention_reference(q, self.cache, table, lens, o.key_codec, o.value_codec, scale=scale)
            return out.to(q.dtype)
        qh = q if q.dtype in COMPUTE_DTYPES else q.to(torch.float16)
        out = prefill_attention(qh, self.cache, table, lens, o.key_codec, o.value_codec, scale=scale)
        return out.to(q.dtype)

    def _prefill_transform(self, q, scale, table, lens, backend) -> torch.Tensor:
        """The transform cache's continuation: every sequence's stored keys and values decoded (RoPE applied at their
        positions), then causal attention in float32, the ``n`` queries being the last ``n`` stored tokens."""
        from ..transform import api as TA, reference as TR, triton as TK

        o = self.owner
        batch, n, q_heads, dim = q.shape
        out = torch.empty(batch, n, q_heads, dim, dtype=torch.float32, device=q.device)
        for b in range(batch):
            m = int(lens[b])
            t = torch.arange(m, device=q.device)
            slots = table[b, t // o.block_size].long() * o.block_size + t % o.block_size
            kv = []
            for codec, cache in ((self.key_codec, self.k_cache), (self.value_codec, self.v_cache)):
                if backend == "triton":
                    x = TA.untransform(codec, TK.load_transform(cache, codec, slots))
                else:
                    x = TR.untransform(codec, TR.dequantize(codec, *TR.unpack(codec, TR.read_rows(cache, slots))))
                kv.append(x.view(m, o.num_kv_heads, dim))
            k, v = kv
            if self.kv16 is not None:  # the sink and the last `residual` tokens as the decode step reads them
                sink, residual = o.transform.sink, o.transform.residual
                for i, x in ((0, k), (1, v)):
                    x[: min(sink, m)] = self.kv16[b, : min(sink, m), i].float()
                    if residual:
                        p = torch.arange(max(sink, m - residual), m, device=q.device)
                        x[p] = self.kv16[b, sink + p % residual, i].float()
            if o.transform.rope is not None:
                k = _rope(o.transform.rope, k, t, undo=False)
            group = q_heads // o.num_kv_heads
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [m, Hq, D]
            s = torch.einsum("ihd,jhd->hij", q[b].float(), k) * scale  # [Hq, n, m]
            causal = t[None, :] <= (m - n + torch.arange(n, device=q.device))[:, None]  # [n, m]
            s = s.masked_fill(~causal, float("-inf"))
            out[b] = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v)
        return out.to(q.dtype)

    def nbytes(self) -> int:
        """Bytes of the slots that hold tokens."""
        o = self.owner
        if o.kind == "transform":
            held = 0 if self.kv16 is None else int(self.seq_lens.clamp_max(self.kv16.shape[1]).sum()) * \
                2 * o.num_kv_heads * o.head_dim * 2  # the fp16 copies
            return int(self.seq_lens.sum()) * (self.key_codec.row_bytes + self.value_codec.row_bytes) + held
        return int(self.seq_lens.sum()) * o.num_kv_heads * o.slot_bytes

    def allocated_nbytes(self) -> int:
        if self.owner.kind == "transform":
            return self.k_cache.numel() + self.v_cache.numel() + (0 if self.kv16 is None else 2 * self.kv16.numel())
        return self.cache.numel()


class PagedKVCache(Cache):
    """A ``transformers.Cache`` of kvlab codes in a paged layout, read by ``decode_attention`` (module docstring).

    ``PagedKVCache(fmt, config=model.config, batch_size=B, max_length=T, device=...)``: ``fmt`` a
    ``KVFormat`` the fused decode reads (``fused_support``), one for every layer; the blocks for
    ``batch_size`` sequences of up to ``max_length`` tokens each (prompt, padding included, plus new
    tokens) are allocated up front. ``block_size`` tokens per block. ``backend``: ``"auto"``,
    ``"triton"`` or ``"reference"``. The model must attend with ``attn_implementation="kvlab"``
    (``model.set_attn_implementation("kvlab")``; ``kvlab.generate`` does it).

    ``check_steps`` (default True): a decode step's keys and values are checked as a prompt's are (finite, within
    the range the kernels store; a host sync per layer) and a failing step leaves the cache as it was, so that
    ``model.generate`` over this cache stops at the first NaN or Inf with a ``ValueError``. ``kvlab.generate``
    turns it off (its steps are captured in a CUDA graph, which cannot sync) and flags non-finite logits on the
    device instead; so must any caller that captures steps in a CUDA graph.
    """

    def __init__(self, fmt: KVFormat, *, config, batch_size: int, max_length: int, device=None, block_size: int = 16,
                 backend: str = "auto", transform=None, check_steps: bool = True):
        if not isinstance(fmt, KVFormat):
            raise TypeError(f"fmt must be a kvlab.KVFormat, got {type(fmt).__name__}")
        C.check_bool("check_steps", check_steps)
        num_layers, num_kv_heads, head_dim = model_shape(config, "PagedKVCache")
        why = fused_support(fmt, head_dim)
        if why is not None:
            raise ValueError(f"PagedKVCache cannot hold {fmt!r}: {why}; kvlab.KVCache holds every format")
        C.check_int("batch_size", batch_size, minimum=1)
        C.check_int("max_length", max_length, minimum=1)
        C.check_int("block_size", block_size, minimum=1)
        C.check_choice("backend", backend, BACKENDS)
        device = C.check_device("device", device)
        self.fmt, self.num_kv_heads, self.head_dim, self.check_steps = fmt, num_kv_heads, head_dim, check_steps
        self.batch, self.max_length, self.block_size, self.device = batch_size, max_length, block_size, device
        self.backend = ("triton" if device.type == "cuda" else "reference") if backend == "auto" else backend
        C.check_backend_device(self.backend, device)
        self.max_blocks = -(-max_length // block_size)
        self.transform = None
        if fmt.codec == "transform" or transform is not None:
            if fmt.codec != "transform":
                raise ValueError(f"transform is for KVFormat('transform'), not {fmt!r}")
            if transform is None:
                raise ValueError("KVFormat('transform') needs the calibrated codecs: PagedKVCache(..., "
                                 "transform=kvlab.transform.calibration.calibrate(model, calibration_ids))")
            check_transform(transform, num_layers, num_kv_heads, head_dim)
            if (transform.sink or transform.residual) and not in_fused_layout(transform, num_kv_heads):
                raise ValueError(f"PagedKVCache stores every token as codes, but these transform codecs were calibrated "
                                 f"to keep the first {transform.sink} and the last {transform.residual} tokens in 16 bit "
                                 f"(their bits assume it): use kvlab.KVCache(KVFormat('transform'), transform=...) "
                                 f"(kvlab.generate does), codecs of calibrate(..., sink=0, residual=0), or codecs in "
                                 f"the fused layout (calibrate(..., layout='fused')), whose decode merges them")
            self.kind, self.transform = "transform", transform.to(device)
            self.key_codec = self.value_codec = self.layout = self.slot_bytes = None  # per layer: the layers' codecs
        elif fmt.codec == "mse":
            self.kind = "mse"
            self.key_codec = MSECodec(head_dim, fmt.key_bits, rotation=fmt.rotation, seed=fmt.seed)
            self.value_codec = MSECodec(head_dim, fmt.value_bits, rotation=fmt.rotation, seed=fmt.seed)
            self.layout = MSESlot(head_dim, fmt.key_bits, fmt.value_bits)
        else:
            self.kind = "affine"
            self.key_codec = AffineCodec(fmt.key_bits, fmt.group_size, "token")
            self.value_codec = AffineCodec(fmt.value_bits, fmt.group_size, "token")
            self.layout = AffineSlot(head_dim, fmt.key_bits, fmt.value_bits, fmt.group_size)
        if self.layout is not None:
            self.slot_bytes = self.layout.slot_bytes
        # sequence b owns blocks [b * max_blocks, (b + 1) * max_blocks): one table for every layer
        self.block_table = torch.arange(batch_size * self.max_blocks, dtype=torch.int32, device=device).view(
            batch_size, self.max_blocks)
        self.first_slot = self.block_table[:, 0].long() * block_size  # blocks of a sequence are consecutive
        self._undo = []  # (layer, length, seq_lens or None) before the stores of the current forward pass
        super().__init__(layers=[PagedKVCacheLayer(self, i) for i in range(num_layers)])

    def __repr__(self) -> str:
        return (f"PagedKVCache({self.fmt.label}; layers={len(self.layers)}, batch_size={self.batch}, "
                f"max_length={self.max_length}, backend={self.backend!r}, tokens={self.get_seq_length()})")

    @torch.compiler.disable  # host bookkeeping: a compiled layer calls it eagerly (``compiled_layers``)
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Hand the new keys and values of layer ``layer_idx`` to kvlab's attention, which stores them."""
        if type(layer_idx) is int and layer_idx == 0:
            self._undo = []  # a new forward pass: the last one is kept as it is
        try:
            return self._hand_over(key_states, value_states, layer_idx)
        except BaseException:
            self._rollback()  # the stores of this forward pass's earlier layers
            raise

    def _hand_over(self, key_states, value_states, layer_idx):
        if _HANDOFF.layer is not None:
            _HANDOFF.layer = None
            raise ValueError("a PagedKVCache is read by kvlab's attention only: load the model with "
                             "attn_implementation='kvlab' or call model.set_attn_implementation('kvlab')")
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx must be an int in [0, {len(self.layers)}), got {layer_idx!r}")
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            C.check_states(name, x)
            if x.dim() != 4:
                raise ValueError(f"{name} must be [batch, KV heads, tokens, head_dim], got shape {tuple(x.shape)}")
        batch, heads, n, dim = key_states.shape
        if (batch, heads, dim) != (self.batch, self.num_kv_heads, self.head_dim) or value_states.shape != key_states.shape:
            raise ValueError(f"key_states and value_states must be [{self.batch}, {self.num_kv_heads}, tokens, "
                             f"{self.head_dim}] (batch_size, KV heads, tokens, head_dim), got {tuple(key_states.shape)} "
                             f"and {tuple(value_states.shape)}")
        _HANDOFF.layer = self.layers[layer_idx]
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_length

    attn_implementation = ATTENTION  # what the model must attend with (kvlab.perplexity switches to it)

    @property
    def bits_per_element(self) -> float:
        """Bits per stored K/V element, codes and their metadata (the format's, or the transform codecs')."""
        if self.kind == "transform":
            return self.transform.bits_per_element()
        return self.fmt.bits_per_element(self.head_dim)

    def held_bits_per_element(self) -> float:
        """``8 * nbytes()`` per stored key and value element (nan when empty)."""
        elements = 2 * int(self.layers[0].seq_lens.sum()) * len(self.layers) * self.num_kv_heads * self.head_dim
        return 8.0 * self.nbytes() / elements if elements else float("nan")

    def nbytes(self) -> int:
        """Bytes of the slots that hold tokens (codes and their metadata), every layer."""
        return sum(layer.nbytes() for layer in self.layers)

    def allocated_nbytes(self) -> int:
        """Bytes allocated for codes, every layer."""
        return sum(layer.allocated_nbytes() for layer in self.layers)

    def reset(self) -> None:
        self._undo = []
        super().reset()

    def _rollback(self) -> None:
        """Undo the stores of the failing forward pass: every layer's lengths as they were before it (the bytes it
        wrote lie past those lengths, where nothing reads them)."""
        for layer, length, seq_lens in reversed(self._undo):
            if seq_lens is None:  # a decode step: one token more in every sequence, if it got as far as counting it
                layer.seq_lens -= layer.length - length
            else:
                layer.seq_lens.copy_(seq_lens)
            layer.length = length
        self._undo = []

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more tokens per sequence on the host (after a decode step replayed from a CUDA graph)."""
        for layer in self.layers:
            layer.length += n


# ----------------------------------------------------------------------------- the attention function


class _Handoff(threading.local):
    layer: PagedKVCacheLayer | None = None


_HANDOFF = _Handoff()


def _valid_tokens(mask, batch: int, n: int) -> torch.Tensor | None:
    """Which of the ``n`` new tokens of each sequence are real (not padding), ``[B, n]`` bool, or None: all."""
    if mask is None:
        return None
    if mask.dim() != 4:
        raise ValueError(f"kvlab attention expects a 4-d attention mask, got shape {tuple(mask.shape)}")
    last = mask[:, 0, -1, -n:]  # the last query sees every earlier real key
    last = last if last.dtype == torch.bool else last == 0
    return last.expand(batch, n)


@torch.compiler.disable  # kvlab's kernels and the cache's host counts: a compiled layer calls it eagerly
def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``"kvlab"`` attention implementation: reads and writes the layer's ``PagedKVCache`` (module docstring)."""
    layer = _HANDOFF.layer
    _HANDOFF.layer = None
    if layer is None or layer.layer_idx != getattr(module, "layer_idx", layer.layer_idx):
        raise ValueError("attn_implementation='kvlab' needs a kvlab.PagedKVCache: pass cache=kvlab.PagedKVCache(...) "
                         "or use kvlab.generate")
    try:
        return _attend(layer, module, query, key, value, attention_mask, scaling, **kwargs)
    except BaseException:
        layer.owner._rollback()  # the forward pass's stores of every layer, this one's included
        raise


def _attend(layer, module, query, key, value, attention_mask, scaling, **kwargs):
    batch, num_q_heads, n, dim = query.shape
    scale = dim**-0.5 if scaling is None else float(scaling)
    if layer.length == 0:  # the prompt: exact attention, then store what is not padding
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=scale, **kwargs)
        layer.store(key, value, _valid_tokens(attention_mask, batch, n))
        return out, None
    valid = _valid_tokens(attention_mask, batch, n) if n > 1 else None
    if valid is not None and not bool(valid.all()):
        raise ValueError("tokens added to a cache that holds a context must not be padding (pad the first prompt only)")
    layer.store(key, value, None)
    if n == 1:
        return layer.decode(query[:, :, 0], scale)[:, None], None
    return layer.prefill(query.transpose(1, 2), scale), None


def _paged_mask(batch_size: int, q_length: int, kv_length: int, **kwargs):
    # decode steps read the sequence lengths, not a mask: none is built (nothing to sync or capture)
    if q_length == 1:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, **kwargs)


AttentionInterface.register(ATTENTION, paged_attention)
AttentionMaskInterface.register(ATTENTION, _paged_mask)
