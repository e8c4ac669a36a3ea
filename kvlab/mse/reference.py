"""The MSE codec in pure torch: the oracle that the kernels of ``kvlab.mse`` (and the attention over its codes) must
reproduce byte for byte. Nothing here is fast and no kernel imports it.

Every operation is one whose result does not depend on the device or on summation order (fp32 elementwise
arithmetic, fp64 accumulation for norms, comparisons), so the kernels can match the packed bytes exactly.

* ``MSECodec``: rotate, take the norm, normalise, pick the nearest Lloyd-Max centroid of the rotated coordinate
  distribution, pack the indices, append the fp16 scale (the norm, divided by the length of the picked centroid
  vector with norm correction, so that decoding is one multiply). The Haar rotation is a float32 matrix product;
  the Hadamard rotation is ``fwht(x * signs) * scale``, a fixed sequence of float32 additions
  (``kvlab.rotation.fwht``), so a kernel can reproduce it exactly.
* ``store_slots`` / ``load_slots``: codes into and out of the slots of the paged MSE cache (``kvlab.layout.MSESlot``);
  ``codec.encode`` then ``store_slots`` is what ``kvlab.mse.store_mse`` does, ``load_slots`` then
  ``codec.decode`` what ``kvlab.mse.load_mse`` does.
"""

from __future__ import annotations

import torch

from .. import _checks as C
from ..layout import MSESlot
from ..packing import fp16_bytes, fp16_from_bytes, pack_valid_indices, unpack_valid_indices
from ..params import MSEParams
from ..rotation import fwht

__all__ = ["MSECodec", "load_slots", "store_slots"]


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
        return torch.cat([pack_valid_indices(code, self.bits), fp16_bytes(scale)], -1)

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
        code = unpack_valid_indices(codes[..., : self.index_bytes], self.bits, self.dim)
        # the stored scale already holds the norm correction: decoding is centroid times scale
        y = self.codebook.to(codes.device)[code] * fp16_from_bytes(codes[..., self.index_bytes :]).float().unsqueeze(-1)
        return y if space == "rotated" else y @ self.rotation.to(codes.device).T


def _check_cache(cache, layout: MSESlot):
    C.check_tensor("cache", cache, (torch.uint8,))
    if cache.dim() != 4 or cache.shape[-1] != layout.slot_bytes:
        raise ValueError(
            f"cache must have shape [num_blocks, block_size, num_heads, {layout.slot_bytes}] for {layout}, "
            f"got {tuple(cache.shape)}"
        )


def store_slots(cache, slot_mapping, key_codes, value_codes, layout: MSESlot) -> None:
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


def load_slots(cache, slot_mapping, layout: MSESlot):
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
