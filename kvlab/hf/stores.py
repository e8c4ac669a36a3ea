"""Where a ``KVCacheLayer`` keeps its codes: one store per codec (affine streams, the paged MSE slot, the transform
codec's rows), each encoding new tokens and decoding what it holds with the Triton kernels or the pure-torch
reference (``kvlab.hf.cache``)."""

from __future__ import annotations

import functools

import torch

from ..calibration import ChannelStats
from ..centered.reference import CenteredMSECodec
from ..layout import MSESlot
from ..affine.reference import AffineCodec
from ..mse.reference import MSECodec, load_slots, store_slots

__all__ = ["AffineStream", "MSEStore", "TransformStore", "affine_codec", "cat_parts", "centered_codec", "mse_codec"]


@functools.lru_cache(maxsize=None)
def mse_codec(dim: int, bits: int, rotation: str, seed: int) -> MSECodec:
    return MSECodec(dim, bits, rotation=rotation, seed=seed)


@functools.lru_cache(maxsize=None)
def affine_codec(bits: int, group_size: int, axis: str) -> AffineCodec:
    return AffineCodec(bits, group_size, axis)


def triton_ops():
    """kvlab's Triton launchers, imported on first use."""
    from .. import affine, mse

    return affine, mse


def centered_ops():
    from .. import centered

    return centered


def centered_codec(dim: int, bits: int, rotation: str, seed: int, stats: ChannelStats, layer: int) -> CenteredMSECodec:
    return CenteredMSECodec(dim, bits, stats.mean[layer], stats.scale[layer], rotation=rotation, seed=seed,
                            rope=stats.rope)


class AffineStream:
    """Codes of one part (K or V) of one layer with the affine codec.

    ``axis="token"``: uint8 ``[B, H, tokens, code_bytes]``; ``axis="channel"``: ``[B, H, tokens / g,
    code_bytes]``; per-head bits: ``[B, tokens, bytes_per_token]``.
    """

    GROWING = {"codes": 2}  # tensors that writes only extend, and along which axis (a cache's undo cuts them back)

    def __init__(self, bits, group_size: int, axis: str, num_heads: int, head_dim: int, backend: str):
        self.bits, self.group_size, self.axis = bits, group_size, axis
        self.num_heads, self.head_dim, self.backend = num_heads, head_dim, backend
        self.unit = group_size if axis == "channel" else 1  # tokens per encode step
        self.mixed = isinstance(bits, tuple)
        if self.mixed:
            self.heads = [affine_codec(b, group_size, "token") for b in bits]
            self.head_bytes = [c.nbytes(head_dim) for c in self.heads]
            if backend == "triton":
                affine, _ = triton_ops()
                self.layout = affine.MixedAffineLayout(list(bits), head_dim, group_size)
        else:
            self.codec = affine_codec(bits, group_size, axis)
        self.codes: torch.Tensor | None = None
        self.tokens = 0
        if self.mixed:
            self.GROWING = {"codes": 1}

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, H, n, D]`` -> codes (n a multiple of ``unit``)."""
        if self.mixed:
            x = x.transpose(1, 2)  # [B, n, H, D]
            if self.backend == "triton":
                return triton_ops()[0].encode_affine_mixed(x, self.layout)
            return torch.cat([c.encode(x[:, :, h]) for h, c in enumerate(self.heads)], -1)
        if self.backend == "triton":
            return triton_ops()[0].encode_affine(x, self.bits, self.group_size, self.axis)
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
                x = triton_ops()[0].decode_affine_mixed(self.codes, self.layout, out_dtype=dtype)
            else:
                parts = self.codes.split(self.head_bytes, -1)
                x = torch.stack([c.decode(p, self.head_dim) for c, p in zip(self.heads, parts)], 2).to(dtype)
            return x.transpose(1, 2)
        if self.backend == "triton":
            return triton_ops()[0].decode_affine(self.codes, self.bits, self.group_size, self.axis, self.head_dim, out_dtype=dtype)
        return self.codec.decode(self.codes, self.head_dim).to(dtype)

    def nbytes(self) -> int:
        return 0 if self.codes is None else self.codes.numel()


class MSEStore:
    """Keys and values of one layer in the paged MSE cache ``[num_blocks, block_size, H, slot_bytes]``.

    ``key_codec`` is an ``MSECodec`` or a ``CenteredMSECodec`` (same slot).
    """

    GROWING = {"cache": 0}  # blocks are only appended

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
            centered_ops().store_centered_mse(k_rows, v_rows, slots, self.cache, self.key_codec, self.value_codec,
                                                   positions=self._positions(self.tokens, stop))
        elif self.centered:
            k_codes = self.key_codec.encode(k_rows, self._positions(self.tokens, stop) if self.key_codec.rope else None)
            store_slots(self.cache, slots, k_codes, self.value_codec.encode(v_rows), self.layout)
        elif self.backend == "triton":
            triton_ops()[1].store_mse(k_rows, v_rows, slots, self.cache, self.key_codec, self.value_codec)
        else:
            store_slots(self.cache, slots, self.key_codec.encode(k_rows), self.value_codec.encode(v_rows), self.layout)
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
            mse = triton_ops()[1]
            if self.centered:
                k = centered_ops().load_centered_mse(self.cache, slots, self.key_codec, space="model", out_dtype=dtype,
                                                          positions=self._positions(0, n))
            else:
                k = mse.load_mse(self.cache, slots, self.key_codec, part="key", space="model", out_dtype=dtype)
            v = mse.load_mse(self.cache, slots, self.value_codec, part="value", space="model", out_dtype=dtype)
        else:
            k_codes, v_codes = load_slots(self.cache, slots, self.layout)
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


class TransformStore(MSEStore):
    """Keys and values of one layer in two paged caches of transform-codec rows ``[num_blocks, block_size,
    row_bytes]`` (``kvlab.transform``); keys coded before RoPE when ``rope`` is set (undone at each token's
    position before encoding, applied again after decoding)."""

    GROWING = {"k_cache": 0, "v_cache": 0, "cache": 0}

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


def cat_parts(parts, dim: int):
    parts = [p for p in parts if p is not None and p.shape[dim] > 0]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

