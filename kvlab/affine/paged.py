"""The paged affine cache: ``store_affine`` writes token-axis affine codes of keys and values into the slots
of a paged cache (one slot of one head: ``key code | value code``, ``kvlab.layout.AffineSlot``) through the
kernels of ``kvlab.affine.triton``; ``AffineStoreStep`` is the same store recorded once and replayed. The oracle:
``kvlab.affine.reference.store_affine_reference``."""

from __future__ import annotations

import torch

from .. import _checks as C
from ..attention.checks import check_codecs, is_affine
from ..attention.triton import on_device
from ..layout import AffineSlot
from .api import encode_affine


def store_affine(key, value, slot_mapping, cache, key_codec, value_codec, *, check: bool = True) -> None:
    """Encode ``key``/``value`` ``[num_tokens, num_kv_heads, dim]`` into the paged affine cache (in place).

    The bytes equal ``kvlab.affine.reference.store_affine_reference``: ``encode_affine`` codes (token axis), then one
    indexed copy into the slots of ``slot_mapping`` (``-1``: skipped).
    """
    for name, codec in (("key_codec", key_codec), ("value_codec", value_codec)):
        if not is_affine(codec):
            raise TypeError(f"{name} must be a kvlab.AffineCodec, got {type(codec).__name__}")
    C.check_tensor("key", key, C.FLOAT_DTYPES)
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, dim], got {tuple(key.shape)} and {tuple(value.shape)}")
    dim = key.shape[-1]
    check_codecs(key_codec, value_codec, dim)
    layout = AffineSlot(dim, key_codec.bits, value_codec.bits, key_codec.group_size)
    C.check_tensor("cache", cache, (torch.uint8,))
    if cache.dim() != 4 or cache.shape[2:] != (key.shape[1], layout.slot_bytes):
        raise ValueError(f"cache must have shape [num_blocks, block_size, {key.shape[1]}, {layout.slot_bytes}] for {layout}, "
                         f"got {tuple(cache.shape)}")
    num_slots = cache.shape[0] * cache.shape[1]
    C.check_same_device(cache=cache, key=key, value=value, slot_mapping=slot_mapping)
    C.check_kernel_device("cache", cache)
    C.check_slot_mapping(slot_mapping, key.shape[0], num_slots, cache.device, values=check)
    codes = torch.cat([encode_affine(key, key_codec.bits, key_codec.group_size, "token", check=check),
                       encode_affine(value, value_codec.bits, value_codec.group_size, "token", check=check)], -1)
    keep = slot_mapping >= 0
    cache.view(num_slots, key.shape[1], layout.slot_bytes)[slot_mapping[keep].long()] = codes[keep]
    C.record_writer(cache, key_codec, value_codec)


class AffineStoreStep:
    """``store_affine(key, value, slot_mapping, cache, key_codec, value_codec, check=False)`` repeated on
    inputs of one shape and dtype whose slots are all written (a decode step): each call encodes the keys and
    values into one staging slot per row (two launches prepared once, ``kvlab._kernels.replay``), then copies the rows
    into their slots. The bytes are ``store_affine``'s; other inputs go through it."""

    def __init__(self, key, value, slot_mapping, cache, key_codec, value_codec):
        from .._kernels.replay import Launch
        from .api import encode_token_spec

        store_affine(key, value, slot_mapping, cache, key_codec, value_codec, check=False)  # checks
        num_tokens, num_heads, dim = key.shape
        self.cache, self.codecs, self.shape, self.dtype = cache, (key_codec, value_codec), tuple(key.shape), key.dtype
        layout = AffineSlot(dim, key_codec.bits, value_codec.bits, key_codec.group_size)
        self.staging = torch.zeros(num_tokens, num_heads, layout.slot_bytes, dtype=torch.uint8, device=cache.device)
        rows = self.staging.view(num_tokens * num_heads, layout.slot_bytes)
        self.launches = []
        for x, codec, start, size in ((key, key_codec, 0, layout.key_code_bytes),
                                      (value, value_codec, layout.value_offset, layout.value_code_bytes)):
            spec = encode_token_spec(x.reshape(-1, dim), rows[:, start:start + size], codec.bits, codec.group_size)
            self.launches.append(Launch(*spec, variable=("x",)))

    def __call__(self, key, value, slot_mapping) -> None:
        if (tuple(key.shape) != self.shape or value.shape != key.shape or key.dtype != self.dtype
                or value.dtype != self.dtype or not key.is_contiguous() or not value.is_contiguous()):
            store_affine(key, value, slot_mapping, self.cache, *self.codecs, check=False)
            return
        num_tokens, num_heads, dim = key.shape
        with on_device(self.cache.device):
            for launch, x in zip(self.launches, (key, value)):
                launch(x=x.view(-1, dim))
        self.cache.view(-1, num_heads, self.cache.shape[-1]).index_copy_(0, slot_mapping, self.staging)
