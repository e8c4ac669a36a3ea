"""The affine codec in pure torch: the oracle of ``kvlab.affine``'s kernels (no kernel imports it).

* ``AffineCodec``: asymmetric min/max quantization with one fp16 scale and one fp16 zero per group of ``group_size``
  channels of a token (``axis="token"``) or tokens of a channel (``axis="channel"``); every operation rounded to
  fp32 on its own, so the kernels match the bytes exactly.
* ``store_affine_reference``: token-axis codes of keys and values into the paged affine cache
  (``kvlab.layout.AffineSlot``), what ``kvlab.affine.store_affine`` does.
"""

from __future__ import annotations

import torch

from .. import _checks as C
from ..packing import fp16_bytes, fp16_from_bytes, pack_valid_indices, unpack_valid_indices
from ..layout import packed_bytes
from ..params import AffineParams

__all__ = ["AffineCodec", "store_affine_reference"]


class AffineCodec(AffineParams):
    """Asymmetric min/max codec, one fp16 scale and fp16 zero per group of ``group_size``.

    ``axis="token"``: groups of channels within each vector; ``encode(x [..., dim])`` ->
    uint8 ``[..., nbytes(dim)]``. ``axis="channel"``: groups of ``group_size`` consecutive tokens
    per channel (keys in KIVI); ``encode(x [..., tokens, dim])`` -> uint8
    ``[..., tokens / group_size, nbytes(dim)]``. ``x_hat = q * scale + zero`` with
    ``q = floor((x - zero) * inv + 1/2)`` clamped to ``[0, 2**bits - 1]``, ``inv = 1 / scale`` (0 where
    the scale is 0), each operation rounded to fp32 on its own.
    """

    def _check_dim(self, dim: int) -> None:
        if self.axis == "token" and dim % self.group_size:
            raise ValueError(f"x's last dimension ({dim}) must be a multiple of group_size={self.group_size}")
        if self.axis == "channel" and dim % 8:
            raise ValueError(f"x's last dimension ({dim}) must be a multiple of 8")

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """View x as [..., groups, group_size] with the group axis last."""
        if self.axis == "token":
            return x.reshape(*x.shape[:-1], x.shape[-1] // self.group_size, self.group_size)
        t, d = x.shape[-2:]
        return x.reshape(*x.shape[:-2], t // self.group_size, self.group_size, d).transpose(-1, -2)

    def _ungrouped(self, g: torch.Tensor, shape) -> torch.Tensor:
        if self.axis == "token":
            return g.reshape(shape)
        return g.transpose(-1, -2).reshape(shape)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        C.check_tensor("x", x, C.FLOAT_DTYPES, ndim_min=1 if self.axis == "token" else 2)
        self._check_dim(x.shape[-1])
        if self.axis == "channel" and x.shape[-2] % self.group_size:
            raise ValueError(
                f"x's token dimension ({x.shape[-2]}) must be a multiple of group_size={self.group_size} for axis='channel'"
            )
        C.check_finite("x", x)
        g = self._grouped(x.float())
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / self.levels).to(torch.float16)
        zero = torch.where(lo == 0, 0.0, lo).to(torch.float16)  # a minimum of -0.0 is stored as +0.0
        if bool(torch.isinf(scale).any()) or bool(torch.isinf(zero).any()):
            raise ValueError("x has groups whose range or minimum overflows fp16 (|value| up to 65504)")
        C.check_tiny_groups("x", scale, zero, g.abs().amax(-1))
        s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
        inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)  # one division per group
        q = torch.floor((g - z) * inv + 0.5).clamp(0, self.levels)
        q = self._ungrouped(q, x.shape)
        packed = pack_valid_indices(q, self.bits)
        if self.axis == "token":
            return torch.cat([packed, fp16_bytes(scale).flatten(-2), fp16_bytes(zero).flatten(-2)], -1)
        # [..., T, P] -> [..., T/G, G*P], then per-channel scales and zeros of the group
        packed = packed.reshape(*packed.shape[:-2], -1, self.group_size * packed.shape[-1])
        return torch.cat([packed, fp16_bytes(scale).flatten(-2), fp16_bytes(zero).flatten(-2)], -1)

    def decode(self, codes: torch.Tensor, dim: int) -> torch.Tensor:
        """uint8 codes -> float32 ``[..., dim]`` (token axis) or ``[..., tokens, dim]`` (channel axis)."""
        C.check_int("dim", dim, minimum=1)
        self._check_dim(dim)
        C.check_tensor("codes", codes, (torch.uint8,), ndim_min=1, last_dim=self.nbytes(dim))
        p = packed_bytes(dim, self.bits)
        ngroups = dim // self.group_size if self.axis == "token" else dim
        if self.axis == "token":
            q = unpack_valid_indices(codes[..., :p], self.bits, dim)
            meta = codes[..., p:]
        else:
            rows = codes[..., : self.group_size * p].reshape(*codes.shape[:-1], self.group_size, p)
            q = unpack_valid_indices(rows, self.bits, dim)  # [..., T/G, G, dim]
            q = q.reshape(*codes.shape[:-2], -1, dim)
            meta = codes[..., self.group_size * p :]
        scale = fp16_from_bytes(meta[..., : 2 * ngroups].reshape(*meta.shape[:-1], ngroups, 2)).float()
        zero = fp16_from_bytes(meta[..., 2 * ngroups :].reshape(*meta.shape[:-1], ngroups, 2)).float()
        g = self._grouped(q.float())
        return self._ungrouped(g * scale.unsqueeze(-1) + zero.unsqueeze(-1), q.shape)


def store_affine_reference(cache, slot_mapping, key, value, key_codec: AffineCodec, value_codec: AffineCodec) -> None:
    """Encode ``key``/``value`` ``[num_tokens, num_kv_heads, dim]`` into the paged affine cache (in place).

    A slot of one head is ``key code | value code``, each ``AffineCodec(bits, group_size, "token").encode``;
    token ``i`` goes to slot ``slot_mapping[i]`` (``-1``: skipped).
    """
    C.check_tensor("cache", cache, (torch.uint8,))
    num_blocks, block_size, num_heads, slot_bytes = cache.shape
    kb, vb = key_codec.nbytes(key.shape[-1]), value_codec.nbytes(key.shape[-1])
    if slot_bytes != kb + vb:
        raise ValueError(f"cache's slot_bytes must be {kb + vb} for these codecs, got {slot_bytes}")
    C.check_slot_mapping(slot_mapping, key.shape[0], num_blocks * block_size, cache.device)
    codes = torch.cat([key_codec.encode(key), value_codec.encode(value)], -1)
    keep = slot_mapping >= 0
    cache.view(num_blocks * block_size, num_heads, slot_bytes)[slot_mapping[keep].long()] = codes[keep]
