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

Storage, per layer (``B`` sequences, ``H`` KV heads, head dimension ``D``)
    * token-axis affine: uint8 ``[B, H, tokens, code_bytes]`` (``pack_affine``);
    * channel-axis affine keys: uint8 ``[B, H, tokens / group_size, code_bytes]``; the tokens of the
      group that is not yet full stay unquantized until it fills (KIVI);
    * mixed bits per head: uint8 ``[B, tokens, bytes_per_token]`` (``pack_affine_mixed``);
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
    ``backend="triton"`` encodes and decodes with kvlab's Triton kernels (``pack_affine``,
    ``pack_affine_mixed``, ``store_mse``, ``load_mse``, ``store_centered_mse``, ``load_centered_mse`` and
    their inverses); ``backend="reference"`` with
    the pure-torch codecs of ``kvlab.reference``, which produce the same bytes (tested) and are much
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

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import _checks as C
from ..calibration import ChannelStats
from ..centered.reference import CenteredMSECodec
from .decode_view import ATTENTION as DECODE_VIEW_ATTENTION, DecodeView, hand_over, quantized_from
from ..layout import AFFINE_BITS, MSE_BITS, NORM_BYTES, MSESlot, packed_bytes
from ..reference import AffineCodec, MSECodec, read_slots, write_slots
from ..rotation import KINDS as ROTATIONS, MAX_DIM

__all__ = ["KVCache", "KVCacheLayer", "KVFormat"]

CODECS = ("fp16", "affine", "mse", "centered", "transform")
MSE_CODECS = ("mse", "centered")  # the paged MSE slot
KEY_AXES = ("token", "channel")
BACKENDS = ("auto", "triton", "reference")
PREFILL = ("exact", "stored")
STORE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- formats


def _check_bits(name: str, bits, allowed, per_head: bool):
    """An int in ``allowed``, or (``per_head``) a non-empty list/tuple of such ints -> int or tuple."""
    if isinstance(bits, (list, tuple)):
        if not per_head:
            raise ValueError(f"{name} can be a list of bits per head only for codec='affine' on the token axis")
        if not bits:
            raise ValueError(f"{name} must not be an empty list")
        for h, b in enumerate(bits):
            C.check_int(f"{name}[{h}]", b, allowed)
        return tuple(bits)
    if bits is None:
        raise TypeError(f"{name} must be an int (or a list of ints per head), got None")
    return C.check_int(name, bits, allowed)


@dataclass(frozen=True, init=False)
class KVFormat:
    """How one layer stores its keys and values (see the module docstring).

    ``KVFormat("fp16")``; ``KVFormat("affine", 4)`` (k4v4, per-token, groups of 32 channels);
    ``KVFormat("affine", 2, key_axis="channel")`` (KIVI); ``KVFormat("affine", [8, 4, 4], 4)`` (mixed
    key bits per head); ``KVFormat("mse", 4, 3, rotation="hadamard")`` (k4v3);
    ``KVFormat("centered", 3, 2)`` (centred 3-bit keys, 2-bit values; needs ``KVCache(key_stats=...)``).
    """

    codec: str
    key_bits: int | tuple[int, ...]
    value_bits: int | tuple[int, ...]
    key_axis: str
    group_size: int
    rotation: str
    seed: int

    def __init__(self, codec: str = "fp16", key_bits=None, value_bits=None, *, key_axis: str = "token",
                 group_size: int = 32, rotation: str = "haar", seed: int = 0):
        C.check_choice("codec", codec, CODECS)
        C.check_choice("key_axis", key_axis, KEY_AXES)
        C.check_int("group_size", group_size, minimum=8)
        if group_size % 8:
            raise ValueError(f"group_size must be a multiple of 8, got {group_size}")
        C.check_choice("rotation", rotation, ROTATIONS)
        C.check_int("seed", seed)
        if codec == "transform":  # the bits are the calibrated codecs' (KVCache(transform=...))
            for name, bits in (("key_bits", key_bits), ("value_bits", value_bits)):
                if bits is not None:
                    raise ValueError(f"{name} must be None for codec='transform' (the calibrated codecs set the bits), "
                                     f"got {bits!r}")
            if key_axis != "token":
                raise ValueError("key_axis='channel' needs codec='affine'")
        elif codec == "fp16":
            for name, bits in (("key_bits", key_bits), ("value_bits", value_bits)):
                if bits not in (None, 16):
                    raise ValueError(f"{name} must be None or 16 for codec='fp16', got {bits!r}")
            key_bits = value_bits = 16
            if key_axis != "token":
                raise ValueError("key_axis='channel' needs codec='affine'")
        else:
            value_bits = key_bits if value_bits is None else value_bits
            allowed = AFFINE_BITS if codec == "affine" else MSE_BITS
            key_bits = _check_bits("key_bits", key_bits, allowed, codec == "affine" and key_axis == "token")
            value_bits = _check_bits("value_bits", value_bits, allowed, codec == "affine")
            if codec in MSE_CODECS and key_axis != "token":
                raise ValueError("key_axis='channel' needs codec='affine'")
        for name, value in (("codec", codec), ("key_bits", key_bits), ("value_bits", value_bits),
                            ("key_axis", key_axis), ("group_size", group_size), ("rotation", rotation),
                            ("seed", seed)):
            object.__setattr__(self, name, value)

    @property
    def mixed(self) -> bool:
        """Whether keys or values have a bit width per head."""
        return isinstance(self.key_bits, tuple) or isinstance(self.value_bits, tuple)

    def check(self, num_heads: int, head_dim: int) -> None:
        """Raise ValueError if this format cannot store ``num_heads`` heads of ``head_dim`` elements."""
        for name, bits in (("key_bits", self.key_bits), ("value_bits", self.value_bits)):
            if isinstance(bits, tuple) and len(bits) != num_heads:
                raise ValueError(f"{name} has {len(bits)} entries (bits per head) but the model has {num_heads} KV heads")
        if self.codec == "affine":
            # values are always grouped along channels (and keys too unless key_axis='channel')
            if head_dim % self.group_size:
                raise ValueError(f"group_size ({self.group_size}) must divide head_dim ({head_dim}) for codec='affine'")
        if self.codec in MSE_CODECS:
            C.check_int("head_dim", head_dim, minimum=3)
            if head_dim > MAX_DIM:
                raise ValueError(f"head_dim must be in [3, {MAX_DIM}] for codec={self.codec!r} (a dense rotation), got {head_dim}")
            if self.rotation == "hadamard" and head_dim & (head_dim - 1):
                raise ValueError(f"rotation='hadamard' needs a power-of-two head_dim, got {head_dim}")

    def _part_bits(self, bits, head_dim: int, channel: bool) -> float:
        if self.codec == "fp16":
            return 16.0
        if self.codec == "transform":
            raise ValueError("the bits of KVFormat('transform') are those of its calibrated codecs: "
                             "KVCache(..., transform=...).bits_per_element or TransformKV.bits_per_element()")
        if self.codec in MSE_CODECS:
            return 8.0 * (packed_bytes(head_dim, bits) + NORM_BYTES) / head_dim
        g = self.group_size
        if channel:  # one code: g rows of packed indices, then a scale and a zero per channel
            return 8.0 * (g * packed_bytes(head_dim, bits) + 4 * head_dim) / (g * head_dim)
        per_head = bits if isinstance(bits, tuple) else (bits,)
        code = [packed_bytes(head_dim, b) + 4 * (head_dim // g) for b in per_head]
        return 8.0 * sum(code) / (len(code) * head_dim)

    def key_bits_per_element(self, head_dim: int) -> float:
        """Bits a quantized key element costs, metadata included."""
        return self._part_bits(self.key_bits, head_dim, self.key_axis == "channel")

    def value_bits_per_element(self, head_dim: int) -> float:
        return self._part_bits(self.value_bits, head_dim, False)

    def bits_per_element(self, head_dim: int) -> float:
        """Mean of key and value bits per element (they hold the same number of elements)."""
        return 0.5 * (self.key_bits_per_element(head_dim) + self.value_bits_per_element(head_dim))

    @property
    def label(self) -> str:
        """A short name, e.g. ``affine k4v4``, ``affine k2v2 channel-keys``, ``mse k4v3 hadamard``."""
        if self.codec in ("fp16", "transform"):
            return self.codec

        def b(bits):
            return "[" + ",".join(map(str, bits)) + "]" if isinstance(bits, tuple) else str(bits)

        text = f"{self.codec} k{b(self.key_bits)}v{b(self.value_bits)}"
        if self.codec == "affine":
            text += " channel-keys" if self.key_axis == "channel" else ""
            text += f" g{self.group_size}" if self.group_size != 32 else ""
        else:
            text += f" {self.rotation}"
        return text

    def __repr__(self) -> str:
        if self.codec in ("fp16", "transform"):
            return f"KVFormat({self.codec!r})"
        extra = f", key_axis={self.key_axis!r}" if self.key_axis != "token" else ""
        if self.codec in MSE_CODECS:
            extra += f", rotation={self.rotation!r}" + (f", seed={self.seed}" if self.seed else "")
        return f"KVFormat({self.codec!r}, {self.key_bits!r}, {self.value_bits!r}{extra}, group_size={self.group_size})"


# ----------------------------------------------------------------------------- codec back ends


@functools.lru_cache(maxsize=None)
def _mse_codec(dim: int, bits: int, rotation: str, seed: int) -> MSECodec:
    return MSECodec(dim, bits, rotation=rotation, seed=seed)


@functools.lru_cache(maxsize=None)
def _affine_codec(bits: int, group_size: int, axis: str) -> AffineCodec:
    return AffineCodec(bits, group_size, axis)


def _triton():
    """kvlab's Triton launchers, imported on first use."""
    from .. import affine, mse

    return affine, mse


def _centered_kernels():
    from .. import centered

    return centered


def _centered_codec(dim: int, bits: int, rotation: str, seed: int, stats: ChannelStats, layer: int) -> CenteredMSECodec:
    return CenteredMSECodec(dim, bits, stats.mean[layer], stats.scale[layer], rotation=rotation, seed=seed,
                            rope=stats.rope)


class _AffineStream:
    """Codes of one part (K or V) of one layer with the affine codec.

    ``axis="token"``: uint8 ``[B, H, tokens, code_bytes]``; ``axis="channel"``: ``[B, H, tokens / g,
    code_bytes]``; per-head bits: ``[B, tokens, bytes_per_token]``.
    """

    def __init__(self, bits, group_size: int, axis: str, num_heads: int, head_dim: int, backend: str):
        self.bits, self.group_size, self.axis = bits, group_size, axis
        self.num_heads, self.head_dim, self.backend = num_heads, head_dim, backend
        self.unit = group_size if axis == "channel" else 1  # tokens per encode step
        self.mixed = isinstance(bits, tuple)
        if self.mixed:
            self.heads = [_affine_codec(b, group_size, "token") for b in bits]
            self.head_bytes = [c.nbytes(head_dim) for c in self.heads]
            if backend == "triton":
                affine, _ = _triton()
                self.layout = affine.MixedAffineLayout(list(bits), head_dim, group_size)
        else:
            self.codec = _affine_codec(bits, group_size, axis)
        self.codes: torch.Tensor | None = None
        self.tokens = 0

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, H, n, D]`` -> codes (n a multiple of ``unit``)."""
        if self.mixed:
            x = x.transpose(1, 2)  # [B, n, H, D]
            if self.backend == "triton":
                return _triton()[0].pack_affine_mixed(x, self.layout)
            return torch.cat([c.encode(x[:, :, h]) for h, c in enumerate(self.heads)], -1)
        if self.backend == "triton":
            return _triton()[0].pack_affine(x, self.bits, self.group_size, self.axis)
        return self.codec.encode(x)

    def write(self, x: torch.Tensor) -> None:
        codes = self._encode(x)
        axis = 1 if self.mixed else 2
        self.codes = codes if self.codes is None else torch.cat([self.codes, codes], axis)
        self.tokens += x.shape[2]

    def read(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Decoded ``[B, H, tokens, D]`` in ``dtype``, or None when nothing is stored."""
        if self.codes is None:
            return None
        if self.mixed:
            if self.backend == "triton":
                x = _triton()[0].unpack_affine_mixed(self.codes, self.layout, out_dtype=dtype)
            else:
                parts = self.codes.split(self.head_bytes, -1)
                x = torch.stack([c.decode(p, self.head_dim) for c, p in zip(self.heads, parts)], 2).to(dtype)
            return x.transpose(1, 2)
        if self.backend == "triton":
            return _triton()[0].unpack_affine(self.codes, self.bits, self.group_size, self.axis, self.head_dim, out_dtype=dtype)
        return self.codec.decode(self.codes, self.head_dim).to(dtype)

    def nbytes(self) -> int:
        return 0 if self.codes is None else self.codes.numel()


class _MSEStore:
    """Keys and values of one layer in the paged MSE cache ``[num_blocks, block_size, H, slot_bytes]``.

    ``key_codec`` is an ``MSECodec`` or a ``CenteredMSECodec`` (same slot).
    """

    def __init__(self, key_codec: MSECodec | CenteredMSECodec, value_codec: MSECodec, num_heads: int,
                 block_size: int, batch: int, device, backend: str):
        self.key_codec, self.value_codec = key_codec, value_codec
        self.centered = isinstance(key_codec, CenteredMSECodec)
        self.first_position = 0  # sequence position of the first stored token (after the sink tokens)
        self.layout = MSESlot(key_codec.dim, key_codec.bits, value_codec.bits)
        self.num_heads, self.block_size, self.backend = num_heads, block_size, backend
        self.cache = torch.zeros(0, block_size, num_heads, self.layout.slot_bytes, dtype=torch.uint8, device=device)
        self.block_table: list[list[int]] = [[] for _ in range(batch)]
        self.tokens = 0

    def _slots(self, start: int, stop: int) -> torch.Tensor:
        """slot_mapping of positions [start, stop) of every sequence, sequence-major: [B * (stop - start)]."""
        pos = torch.arange(start, stop)
        table = torch.tensor(self.block_table, dtype=torch.int64).reshape(len(self.block_table), -1)
        slots = table[:, pos // self.block_size] * self.block_size + pos % self.block_size
        return slots.reshape(-1).to(self.cache.device)

    def _positions(self, start: int, stop: int) -> torch.Tensor:
        """Sequence positions of stored tokens [start, stop) of every sequence, sequence-major: [B * (stop - start)]."""
        return (torch.arange(start, stop) + self.first_position).repeat(len(self.block_table))

    def _new_blocks(self, stop: int) -> int:
        """Extend every sequence's block table to hold ``stop`` tokens with blocks after the last one; how many."""
        need = -(-stop // self.block_size)  # blocks per sequence
        first = 1 + max((b for t in self.block_table for b in t), default=-1)
        ids = iter(range(first, first + sum(max(0, need - len(t)) for t in self.block_table)))
        added = 0
        for t in self.block_table:
            new = [next(ids) for _ in range(need - len(t))]
            t.extend(new)
            added += len(new)
        return added

    @staticmethod
    def _grow(cache: torch.Tensor, blocks: int) -> torch.Tensor:
        """``cache`` with ``blocks`` zero blocks appended (a new tensor: the old one is kept for a rollback)."""
        return torch.cat([cache, cache.new_zeros(blocks, *cache.shape[1:])], 0) if blocks else cache

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k``, ``v`` ``[B, H, n, D]`` at positions [tokens, tokens + n) of every sequence."""
        batch, heads, n, dim = k.shape
        stop = self.tokens + n
        self.cache = self._grow(self.cache, self._new_blocks(stop))
        slots = self._slots(self.tokens, stop)
        k_rows = k.transpose(1, 2).reshape(batch * n, heads, dim)  # [B * n, H, D], sequence-major
        v_rows = v.transpose(1, 2).reshape(batch * n, heads, dim)
        if self.backend == "triton" and self.centered:
            _centered_kernels().store_centered_mse(k_rows, v_rows, slots, self.cache, self.key_codec, self.value_codec,
                                                   positions=self._positions(self.tokens, stop))
        elif self.centered:
            k_codes = self.key_codec.encode(k_rows, self._positions(self.tokens, stop) if self.key_codec.rope else None)
            write_slots(self.cache, slots, k_codes, self.value_codec.encode(v_rows), self.layout)
        elif self.backend == "triton":
            _triton()[1].store_mse(k_rows, v_rows, slots, self.cache, self.key_codec, self.value_codec)
        else:
            write_slots(self.cache, slots, self.key_codec.encode(k_rows), self.value_codec.encode(v_rows), self.layout)
        self.tokens = stop

    def _stored(self):
        """``(batch, tokens, slot_mapping)`` of every stored token, or None when there is none."""
        return None if self.tokens == 0 else (len(self.block_table), self.tokens, self._slots(0, self.tokens))

    def read(self, dtype: torch.dtype):
        """Decoded keys and values ``[B, H, tokens, D]`` in ``dtype`` (model space), or (None, None)."""
        if (stored := self._stored()) is None:
            return None, None
        batch, n, slots = stored
        if self.backend == "triton":
            mse = _triton()[1]
            if self.centered:
                k = _centered_kernels().load_centered_mse(self.cache, slots, self.key_codec, space="model", out_dtype=dtype,
                                                          positions=self._positions(0, n))
            else:
                k = mse.load_mse(self.cache, slots, self.key_codec, part="key", space="model", out_dtype=dtype)
            v = mse.load_mse(self.cache, slots, self.value_codec, part="value", space="model", out_dtype=dtype)
        else:
            k_codes, v_codes = read_slots(self.cache, slots, self.layout)
            if self.centered:
                k = self.key_codec.decode(k_codes, "model", self._positions(0, n) if self.key_codec.rope else None).to(dtype)
            else:
                k = self.key_codec.decode(k_codes, "model").to(dtype)
            v = self.value_codec.decode(v_codes, "model").to(dtype)
        shape = (batch, n, self.num_heads, self.key_codec.dim)
        return k.reshape(shape).transpose(1, 2), v.reshape(shape).transpose(1, 2)

    def nbytes(self) -> int:
        """Bytes of the slots that hold tokens (partly filled blocks count their used slots only)."""
        return len(self.block_table) * self.tokens * self.num_heads * self.layout.slot_bytes

    def allocated_nbytes(self) -> int:
        return self.cache.numel()


class _TransformStore(_MSEStore):
    """Keys and values of one layer in two paged caches of transform-codec rows ``[num_blocks, block_size,
    row_bytes]`` (``kvlab.transform``); keys coded before RoPE when ``rope`` is set (undone at each token's
    position before encoding, applied again after decoding)."""

    def __init__(self, key_codec, value_codec, rope, num_heads: int, head_dim: int, block_size: int, batch: int,
                 device, backend: str):
        self.key_codec, self.value_codec, self.rope = key_codec.to(device), value_codec.to(device), rope
        self.first_position = 0
        self.num_heads, self.head_dim, self.block_size, self.backend = num_heads, head_dim, block_size, backend
        self.k_cache = torch.zeros(0, block_size, key_codec.row_bytes, dtype=torch.uint8, device=device)
        self.v_cache = torch.zeros(0, block_size, value_codec.row_bytes, dtype=torch.uint8, device=device)
        self.cache = self.k_cache  # blocks are counted on the key cache
        self.block_table: list[list[int]] = [[] for _ in range(batch)]
        self.tokens = 0

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        from ..transform import api as TA, reference as TR, triton as TK

        batch, heads, n, dim = k.shape
        stop = self.tokens + n
        rows_k = k.transpose(1, 2).reshape(batch * n, heads, dim)
        if self.rope is not None:
            pos = self._positions(self.tokens, stop)[:, None]
            rows_k = self.rope.undo(rows_k, pos).to(k.device, torch.float32)
        rows_k = rows_k.reshape(batch * n, heads * dim)
        rows_v = v.transpose(1, 2).reshape(batch * n, heads * dim)
        M = TA if self.backend == "triton" else TR  # the same matrix products and checks, kernels or oracle
        ys = [M.transform(self.key_codec, rows_k), M.transform(self.value_codec, rows_v)]
        for name, codec, y in (("key_states", self.key_codec, ys[0]), ("value_states", self.value_codec, ys[1])):
            M.check_gains(codec, y, name)  # both checked before anything is written
        grow = self._new_blocks(stop)
        self.k_cache, self.v_cache = self._grow(self.k_cache, grow), self._grow(self.v_cache, grow)
        self.cache = self.k_cache
        slots = self._slots(self.tokens, stop)
        for codec, cache, y in ((self.key_codec, self.k_cache, ys[0]), (self.value_codec, self.v_cache, ys[1])):
            if self.backend == "triton":
                TK.store_transform(y, codec, cache, slots)
            else:
                TR.write_rows(cache.view(-1, codec.row_bytes), slots, TR.pack(codec, *TR.quantize(codec, y)))
        self.tokens = stop

    def read(self, dtype: torch.dtype):
        from ..transform import api as TA, reference as TR, triton as TK

        if (stored := self._stored()) is None:
            return None, None
        batch, n, slots = stored
        out = []
        for codec, cache in ((self.key_codec, self.k_cache), (self.value_codec, self.v_cache)):
            if self.backend == "triton":
                x = TA.untransform(codec, TK.load_transform(cache, codec, slots))
            else:
                rows = TR.read_rows(cache.view(-1, codec.row_bytes), slots)
                x = TR.untransform(codec, TR.dequantize(codec, *TR.unpack(codec, rows)))
            out.append(x.reshape(batch * n, self.num_heads, self.head_dim))
        k, v = out
        if self.rope is not None:
            k = self.rope.apply(k, self._positions(0, n)[:, None]).to(v.device, torch.float32)
        shape = (batch, n, self.num_heads, self.head_dim)
        return k.to(dtype).reshape(shape).transpose(1, 2), v.to(dtype).reshape(shape).transpose(1, 2)

    def nbytes(self) -> int:
        return len(self.block_table) * self.tokens * (self.key_codec.row_bytes + self.value_codec.row_bytes)

    def allocated_nbytes(self) -> int:
        return self.k_cache.numel() + self.v_cache.numel()


def _cat(parts, dim: int):
    parts = [p for p in parts if p is not None and p.shape[dim] > 0]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


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
        self.backend = ("triton" if key_states.device.type == "cuda" else "reference") if want == "auto" else want
        self.k_tail = key_states.new_zeros(batch, heads, 0, dim, dtype=self.dtype)
        self.v_tail = value_states.new_zeros(batch, heads, 0, dim, dtype=self.dtype)
        self.k_sink, self.v_sink = self.k_tail.clone(), self.v_tail.clone()  # the first `sink` tokens
        self.k_codes = self.v_codes = self.mse = None
        self.k_exact, self.v_exact = self.k_tail.clone(), self.v_tail.clone()  # every token, with decode_view
        fmt = self.fmt
        if fmt.codec == "affine":
            self.k_codes = _AffineStream(fmt.key_bits, fmt.group_size, fmt.key_axis, heads, dim, self.backend)
            self.v_codes = _AffineStream(fmt.value_bits, fmt.group_size, "token", heads, dim, self.backend)
        elif fmt.codec == "transform":
            t = self.transform
            self.mse = _TransformStore(t.keys[self.layer_idx], t.values[self.layer_idx], t.rope, heads, dim,
                                       self.block_size, batch, self.device, self.backend)
        elif fmt.codec in MSE_CODECS:
            if fmt.codec == "centered":
                key_codec = _centered_codec(dim, fmt.key_bits, fmt.rotation, fmt.seed, self.key_stats, self.layer_idx)
            else:
                key_codec = _mse_codec(dim, fmt.key_bits, fmt.rotation, fmt.seed)
            self.mse = _MSEStore(key_codec,
                                 _mse_codec(dim, fmt.value_bits, fmt.rotation, fmt.seed),
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
            C.check_tensor(name, x, C.FLOAT_DTYPES)
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
        return (_cat([self.k_sink.to(dtype), k_q, self.k_tail.to(dtype)], 2),
                _cat([self.v_sink.to(dtype), v_q, self.v_tail.to(dtype)], 2))

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


def model_shape(config, who: str = "KVCache") -> tuple[int, int, int]:
    """``(layers, KV heads, head_dim)`` of a transformers config; ValueError unless every layer is full attention."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    num_layers = text.num_hidden_layers
    num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    for kind in set(getattr(text, "layer_types", None) or ["full_attention"]):
        if kind != "full_attention":
            raise ValueError(f"{who} supports models with full attention layers only, got layer type {kind!r}")
    return num_layers, num_kv_heads, head_dim


class KVCache(Cache):
    """A transformers ``Cache`` whose layers store K and V as kvlab codes (see the module docstring).

    ``KVCache(fmt, config=model.config)`` or, without a model config, ``KVCache(fmt, num_layers=...,
    num_kv_heads=..., head_dim=...)``.

    * ``fmt``: a ``KVFormat`` for every layer, or a list with one per layer.
    * ``keep_first`` / ``keep_last``: the first / last layers stored unquantized (fp16).
    * ``residual``: the most recent tokens of every layer stay unquantized (KIVI's window).
    * ``sink``: the first tokens of every sequence stay unquantized (the attention sink).
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
                 keep_first: int = 0, keep_last: int = 0, residual: int = 0, sink: int = 0, prefill: str = "exact",
                 dtype: torch.dtype | None = torch.float16, backend: str = "auto", block_size: int = 16,
                 key_stats: ChannelStats | None = None, transform=None):
        if config is not None:
            if num_layers is not None or num_kv_heads is not None or head_dim is not None:
                raise ValueError("pass either config or num_layers, num_kv_heads and head_dim, not both")
            num_layers, num_kv_heads, head_dim = model_shape(config, "KVCache")
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

    @property
    def decode_view(self) -> bool:
        """Whether calls attend as token-by-token decoding would (``kvlab.hf.decode_view``)."""
        return self.layers[0].decode_view

    @decode_view.setter
    def decode_view(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"decode_view must be a bool, got {type(on).__name__}")
        if on != self.decode_view and self.get_seq_length():
            raise ValueError("decode_view must be set before the cache holds tokens")
        for layer in self.layers:
            layer.decode_view = on

    @property
    def attn_implementation(self) -> str | None:
        """The attention implementation a model must use with this cache (None: the model's own)."""
        return DECODE_VIEW_ATTENTION if self.decode_view else None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the new tokens of layer ``layer_idx``; return what attention uses (``KVCacheLayer.update``)."""
        C.check_int("layer_idx", layer_idx)
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx must be in [0, {len(self.layers)}) (the cache's layers), got {layer_idx}")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

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
