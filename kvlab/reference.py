"""Pure-torch reference codecs: the readable oracle that kvlab's Triton kernels must reproduce.

Nothing here is fast and nothing here is imported by a kernel. Every operation is one whose result
does not depend on the device or on summation order (fp32 elementwise arithmetic, fp64
accumulation for norms, comparisons), so the kernels can match the packed bytes exactly.

* ``MSECodec``: rotate, take the norm, normalise, pick the nearest Lloyd-Max centroid of the
  rotated coordinate distribution, pack the indices, append the fp16 scale (the norm, divided by the
  length of the picked centroid vector with norm correction, so that decoding is one multiply). The Haar rotation is a
  float32 matrix product; the Hadamard rotation is ``fwht(x * signs) * scale``, a fixed sequence
  of float32 additions (``kvlab.rotation.fwht``), so a kernel can reproduce it exactly.
* ``AffineCodec``: asymmetric min/max quantization with one fp16 scale and one fp16 zero per group
  of ``group_size`` channels of a token (``axis="token"``) or tokens of a channel (``axis="channel"``).
* ``write_slots`` / ``read_slots``: the paged MSE cache of ``kvlab.layout``.

Byte layouts are those of ``kvlab.layout``.
"""

from __future__ import annotations

import torch

from . import _checks as C
from . import layout
from .layout import NORM_BYTES, MSESlot, packed_bytes
from .params import AffineParams, CenteredParams, MSEParams
from .rotation import fwht

__all__ = [
    "AffineCodec",
    "MSECodec",
    "pack_indices",
    "read_slots",
    "unpack_indices",
    "write_slots",
]



# ----------------------------------------------------------------------------- packing


def pack_indices(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer indices ``[..., n]`` (values in ``[0, 2**bits)``) into uint8 ``[..., ceil(bits n / 8)]``."""
    C.check_int("bits", bits, layout.PACK_BITS)
    C.check_codes("idx", idx, bits)
    return _pack_indices(idx, bits)


def _pack_indices(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """``pack_indices`` of indices known to be in range (the encoders' own)."""
    n = idx.shape[-1]
    nbytes = packed_bytes(n, bits)
    idx = idx.to(torch.int64)
    if bits == 8:
        return idx.to(torch.uint8)
    # Element j occupies bits [bits*j, bits*j + bits) of a little-endian stream.
    start = torch.arange(n, device=idx.device) * bits
    out = torch.zeros(*idx.shape[:-1], nbytes + 1, dtype=torch.int64, device=idx.device)
    lo_byte, shift = start // 8, start % 8
    out.index_add_(-1, lo_byte, (idx << shift) & 0xFF)
    out.index_add_(-1, lo_byte + 1, idx >> (8 - shift))  # the part that straddles into the next byte
    return out[..., :nbytes].to(torch.uint8)


def unpack_indices(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_indices``: uint8 ``[..., nbytes]`` -> int64 ``[..., n]``.

    ``nbytes`` must be ``packed_bytes(n, bits)``, the bytes ``pack_indices`` writes for ``n`` indices.
    """
    C.check_int("bits", bits, layout.PACK_BITS)
    C.check_int("n", n, minimum=0)
    C.check_tensor("packed", packed, (torch.uint8,), ndim_min=1)
    if packed.shape[-1] != packed_bytes(n, bits):
        raise ValueError(f"packed's last dimension must be packed_bytes(n={n}, bits={bits}) = {packed_bytes(n, bits)}, "
                         f"got shape {tuple(packed.shape)}")
    return _unpack_indices(packed, bits, n)


def _unpack_indices(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """``unpack_indices`` of codes known to fit (the decoders' own slices of a checked code)."""
    data = packed.to(torch.int64)
    if bits == 8:
        return data[..., :n]
    data = torch.cat([data, torch.zeros_like(data[..., :1])], -1)
    start = torch.arange(n, device=packed.device) * bits
    lo_byte, shift = start // 8, start % 8
    word = data[..., lo_byte] | (data[..., lo_byte + 1] << 8)
    return (word >> shift) & ((1 << bits) - 1)


def fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp16 values ``[...]`` -> little-endian bytes ``[..., 2]``."""
    u = x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack([u & 0xFF, u >> 8], -1).to(torch.uint8)


def fp16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes ``[..., 2]`` -> fp16 ``[...]``."""
    u = b[..., 0].to(torch.int32) | (b[..., 1].to(torch.int32) << 8)
    return torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16).view(torch.float16)


# ----------------------------------------------------------------------------- MSE codec


class MSECodec(MSEParams):
    """Rotated Lloyd-Max codec (TurboQuant's MSE variant) for vectors of ``dim`` elements.

    ``encode(x [..., dim]) -> uint8 [..., nbytes]`` and ``decode(codes, space="model"|"rotated")``.
    ``space="rotated"`` returns the vector in rotated coordinates (``y = x @ rotation``), which is
    what attention in rotated space consumes; ``"model"`` rotates it back.

    Each normalised coordinate ``u = y / |y|`` (float32) gets its nearest centroid by an odd
    quantizer: with ``h = 2**(bits - 1)`` and ``m`` the number of positive boundaries strictly below
    ``|u|``, the centroid ``c[h + m]`` where ``u > 0`` and ``c[h - 1 - m]`` elsewhere (centroids and
    boundaries ascending and antisymmetric, the middle boundary 0). So ``-u`` gets the mirrored
    centroid of ``u``'s, and a coordinate exactly on a boundary goes to the centroid of smaller
    magnitude on either side (``torch.bucketize`` over all boundaries would send negative ones to
    the larger: the only difference). The stored code is sign-magnitude (``code_order``): ``m``
    where ``u > 0``, ``h + m`` elsewhere; ``codebook`` is the centroid of each code.

    ``rotation`` is always the dense float32 matrix (decoding uses it). With ``rotation="hadamard"``
    the encoder does not multiply by it but computes the same product as
    ``fwht(x.float() * hadamard_signs) * hadamard_scale`` (``hadamard_signs``: float32 ``+-1``
    ``[dim]``; ``hadamard_scale``: ``1 / sqrt(dim)`` in float32), which is exactly reproducible;
    for Haar codecs ``hadamard_signs`` and ``hadamard_scale`` are ``None``.

    The code ends in one fp16 scale ``s``, and decoding is ``y_hat = codebook[code] * s``. With
    ``norm_correction=True`` (the default) ``s = |y| / |codebook[code]|``, so that the decoded vector has the
    input's norm (up to fp16 rounding) and no decoder has to compute ``|codebook[code]|``; without it
    ``s = |y|``.
    """

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        C.check_tensor("x", x, C.FLOAT_DTYPES, ndim_min=1, last_dim=self.dim)
        C.check_finite("x", x)
        y = self.rotate(x)
        norm = y.double().square().sum(-1).sqrt().float()
        unit = y / torch.where(norm > 0, norm, 1.0).unsqueeze(-1)
        half = 1 << (self.bits - 1)  # odd quantizer: the magnitude, then the sign
        m = torch.bucketize(unit.abs(), self.boundaries[half:].to(x.device))  # positive boundaries < |unit|
        code = torch.where(unit > 0, m, half + m)  # sign-magnitude (code_order)
        scale = norm
        if self.norm_correction:  # |c|: fp64 sum of the (exact) squares, sqrt in fp64, rounded once to fp32
            length = self.codebook.to(x.device)[code].double().square().sum(-1).sqrt().float()
            scale = norm / length  # fp32, correctly rounded; every centroid is nonzero, so length > 0
        C.check_fp16_scales("x", scale)
        return torch.cat([_pack_indices(code, self.bits), fp16_bytes(scale)], -1)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ rotation`` in float32, computed as the encoder does (exactly reproducible for Hadamard)."""
        if self.hadamard_signs is None:
            return x.float() @ self.rotation.to(x.device)
        scale = torch.tensor(self.hadamard_scale, dtype=torch.float32, device=x.device)
        return fwht(x.float() * self.hadamard_signs.to(x.device)) * scale

    def decode(self, codes: torch.Tensor, space: str = "model") -> torch.Tensor:
        """uint8 ``[..., nbytes]`` -> float32 ``[..., dim]``."""
        C.check_tensor("codes", codes, (torch.uint8,), ndim_min=1, last_dim=self.nbytes)
        C.check_choice("space", space, ("model", "rotated"))
        code = _unpack_indices(codes[..., : self.index_bytes], self.bits, self.dim)
        # the stored scale already holds the norm correction: decoding is centroid times scale
        y = self.codebook.to(codes.device)[code] * fp16_from_bytes(codes[..., self.index_bytes :]).float().unsqueeze(-1)
        return y if space == "rotated" else y @ self.rotation.to(codes.device).T


# ----------------------------------------------------------------------------- affine codec


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
        zero = lo.to(torch.float16)
        if bool(torch.isinf(scale).any()) or bool(torch.isinf(zero).any()):
            raise ValueError("x has groups whose range or minimum overflows fp16 (|value| up to 65504)")
        C.check_tiny_groups("x", scale, zero, g.abs().amax(-1))
        s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
        inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)  # one division per group
        q = torch.floor((g - z) * inv + 0.5).clamp(0, self.levels)
        q = self._ungrouped(q, x.shape)
        packed = _pack_indices(q, self.bits)
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
            q = _unpack_indices(codes[..., :p], self.bits, dim)
            meta = codes[..., p:]
        else:
            rows = codes[..., : self.group_size * p].reshape(*codes.shape[:-1], self.group_size, p)
            q = _unpack_indices(rows, self.bits, dim)  # [..., T/G, G, dim]
            q = q.reshape(*codes.shape[:-2], -1, dim)
            meta = codes[..., self.group_size * p :]
        scale = fp16_from_bytes(meta[..., : 2 * ngroups].reshape(*meta.shape[:-1], ngroups, 2)).float()
        zero = fp16_from_bytes(meta[..., 2 * ngroups :].reshape(*meta.shape[:-1], ngroups, 2)).float()
        g = self._grouped(q.float())
        return self._ungrouped(g * scale.unsqueeze(-1) + zero.unsqueeze(-1), q.shape)


# ----------------------------------------------------------------------------- paged cache


def _check_cache(cache, layout: MSESlot):
    C.check_tensor("cache", cache, (torch.uint8,))
    if cache.dim() != 4 or cache.shape[-1] != layout.slot_bytes:
        raise ValueError(
            f"cache must have shape [num_blocks, block_size, num_heads, {layout.slot_bytes}] for {layout}, "
            f"got {tuple(cache.shape)}"
        )


def write_slots(cache, slot_mapping, key_codes, value_codes, layout: MSESlot) -> None:
    """Write MSE codes ``[num_tokens, num_heads, *_code_bytes]`` into their slots (in place)."""
    _check_cache(cache, layout)
    C.check_tensor("key_codes", key_codes, (torch.uint8,), last_dim=layout.key_code_bytes)
    C.check_tensor("value_codes", value_codes, (torch.uint8,), last_dim=layout.value_code_bytes)
    num_blocks, block_size, num_heads, _ = cache.shape
    if key_codes.dim() != 3 or key_codes.shape[1] != num_heads or value_codes.shape[:2] != key_codes.shape[:2]:
        raise ValueError(
            f"key_codes and value_codes must be [num_tokens, {num_heads}, code_bytes], "
            f"got {tuple(key_codes.shape)} and {tuple(value_codes.shape)}"
        )
    C.check_same_device(cache=cache, key_codes=key_codes, value_codes=value_codes)
    C.check_slot_mapping(slot_mapping, key_codes.shape[0], num_blocks * block_size, cache.device)
    keep = slot_mapping >= 0
    flat = cache.view(num_blocks * block_size, num_heads, layout.slot_bytes)
    slots = slot_mapping[keep].long()
    flat[slots] = torch.cat([key_codes[keep], value_codes[keep]], -1)
    C.record_writer(cache, None, None)  # codes of codecs not known here: no checked read can vouch for them


def read_slots(cache, slot_mapping, layout: MSESlot):
    """Read ``(key_codes, value_codes)`` ``[num_tokens, num_heads, *_code_bytes]`` from their slots.

    Padding tokens (slot -1) read as zero bytes.
    """
    _check_cache(cache, layout)
    num_blocks, block_size, num_heads, _ = cache.shape
    C.check_slot_mapping(slot_mapping, slot_mapping.shape[0] if isinstance(slot_mapping, torch.Tensor) and slot_mapping.dim() == 1 else -1, num_blocks * block_size, cache.device)
    flat = cache.view(num_blocks * block_size, num_heads, layout.slot_bytes)
    slots = flat[slot_mapping.long().clamp_min(0)]
    slots = torch.where((slot_mapping >= 0).view(-1, 1, 1), slots, torch.zeros_like(slots))
    return slots[..., : layout.key_code_bytes], slots[..., layout.key_code_bytes :]


# ----------------------------------------------------------------------------- decode attention


def _affine_slot_sizes(dim: int, key_codec: AffineCodec, value_codec: AffineCodec) -> tuple[int, int]:
    """Bytes of the key and of the value code in a slot of the paged affine cache (``kvlab.layout.AffineSlot``)."""
    return key_codec.nbytes(dim), value_codec.nbytes(dim)


def write_affine_slots(cache, slot_mapping, key, value, key_codec: AffineCodec, value_codec: AffineCodec) -> None:
    """Encode ``key``/``value`` ``[num_tokens, num_kv_heads, dim]`` into the paged affine cache (in place).

    A slot of one head is ``key code | value code``, each ``AffineCodec(bits, group_size, "token").encode``;
    token ``i`` goes to slot ``slot_mapping[i]`` (``-1``: skipped).
    """
    C.check_tensor("cache", cache, (torch.uint8,))
    num_blocks, block_size, num_heads, slot_bytes = cache.shape
    kb, vb = _affine_slot_sizes(key.shape[-1], key_codec, value_codec)
    if slot_bytes != kb + vb:
        raise ValueError(f"cache's slot_bytes must be {kb + vb} for these codecs, got {slot_bytes}")
    C.check_slot_mapping(slot_mapping, key.shape[0], num_blocks * block_size, cache.device)
    codes = torch.cat([key_codec.encode(key), value_codec.encode(value)], -1)
    keep = slot_mapping >= 0
    cache.view(num_blocks * block_size, num_heads, slot_bytes)[slot_mapping[keep].long()] = codes[keep]


def dequantize_paged(cache, block_table, seq_lens, key_codec, value_codec, position_offset: int = 0):
    """Model-space fp32 keys and values of each sequence: a list of ``(K, V)`` ``[seq_len, num_kv_heads, dim]``.

    ``MSECodec`` codecs read the cache of ``kvlab.layout``, as does a centred key codec
    (``kvlab.centered.reference.CenteredMSECodec``, token ``t`` at position ``position_offset + t``);
    ``AffineCodec`` codecs (token axis) the paged affine cache (``key code | value code`` per slot).
    """
    num_blocks, block_size, num_heads, slot_bytes = cache.shape
    flat = cache.reshape(num_blocks * block_size, num_heads, slot_bytes)
    out = []
    for b in range(block_table.shape[0]):
        n = int(seq_lens[b])
        t = torch.arange(n, device=cache.device)
        slots = block_table[b].long()[t // block_size] * block_size + t % block_size
        codes = flat[slots]
        if isinstance(key_codec, (MSEParams, CenteredParams)):  # plain or centred MSE keys
            kb = key_codec.nbytes
            # a centred codec whose mean turns with RoPE needs the tokens' positions
            turning = getattr(key_codec, "rope", None) is not None
            k = key_codec.decode(codes[..., :kb], space="model", **({"positions": t + position_offset} if turning else {}))
            v = value_codec.decode(codes[..., kb:], space="model")
        else:
            dim = _affine_dim(key_codec, value_codec, slot_bytes)
            kb = key_codec.nbytes(dim)
            k = key_codec.decode(codes[..., :kb], dim)
            v = value_codec.decode(codes[..., kb:], dim)
        out.append((k, v))
    return out


def _affine_dim(key_codec: AffineCodec, value_codec: AffineCodec, slot_bytes: int) -> int:
    """The head dim whose key and value codes fill ``slot_bytes``."""
    for dim in range(key_codec.group_size, 8 * slot_bytes + 1, key_codec.group_size):
        if key_codec.nbytes(dim) + value_codec.nbytes(dim) == slot_bytes:
            return dim
    raise ValueError(f"no head dim fits slot_bytes={slot_bytes} for {key_codec} and {value_codec}")


def _attend(q, k, v, scale, causal_from=None):
    """fp64 attention of ``q [n_q, num_q_heads, dim]`` over ``k, v [n_k, num_kv_heads, dim]`` (GQA)."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if causal_from is not None:  # query i sits at position causal_from + i
        allowed = torch.arange(k.shape[0])[None, :] <= (causal_from + torch.arange(q.shape[0]))[:, None]
        s = s.masked_fill(~allowed.to(s.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def decode_attention_reference(q, cache, block_table, seq_lens, key_codec, value_codec, scale=None,
                               position_offset: int = 0) -> torch.Tensor:
    """fp32 ``[batch, num_q_heads, dim]``: attention of ``q [batch, num_q_heads, dim]`` over the dequantized cache.

    Computed in fp64 from ``dequantize_paged`` (model space), rounded to fp32 once.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    seqs = dequantize_paged(cache, block_table, seq_lens, key_codec, value_codec, position_offset)
    out = [_attend(q[b : b + 1].float(), k, v, scale)[0] for b, (k, v) in enumerate(seqs)]
    return torch.stack(out).float() if out else q.new_zeros(q.shape, dtype=torch.float32)


def prefill_attention_reference(q, cache, block_table, seq_lens, key_codec, value_codec, scale=None,
                                position_offset: int = 0) -> torch.Tensor:
    """fp32 ``[batch, q_len, num_q_heads, dim]``: causal attention of the last ``q_len`` tokens of each sequence."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    seqs = dequantize_paged(cache, block_table, seq_lens, key_codec, value_codec, position_offset)
    q_len = q.shape[1]
    out = [_attend(q[b].float(), k, v, scale, causal_from=k.shape[0] - q_len) for b, (k, v) in enumerate(seqs)]
    return torch.stack(out).float()
