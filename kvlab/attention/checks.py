"""Checks of the paged attention ops: which cache a pair of codecs reads (MSE, centred MSE keys, affine), the
query, the cache and its block table. Shared by ``decode_attention``, ``prefill_attention`` and the affine
paged store; a failed check raises before anything is launched or written."""

from __future__ import annotations

import torch

from .. import _checks as C
from ..layout import ATTENTION_AFFINE_BITS as AFFINE_BITS, MSE_BITS, MSESlot
from ..params import AffineParams, CenteredParams, MSEParams
from ..layout import AffineSlot


def is_mse(codec) -> bool:
    return isinstance(codec, MSEParams)


def is_affine(codec) -> bool:
    return isinstance(codec, AffineParams)


def is_centered(codec) -> bool:
    return isinstance(codec, CenteredParams) and is_mse(codec.mse)


def split_centered(key_codec, position_offset):
    """``(centred codec or None, the MSE codec of the keys' codes)``; checks ``position_offset`` (read by centred keys only)."""
    C.check_int("position_offset", position_offset, minimum=0)
    if not is_centered(key_codec):
        return None, key_codec
    return key_codec, key_codec.mse


def check_codecs(key_codec, value_codec, dim: int) -> str:
    """``"mse"`` or ``"affine"``; raises for anything else or for a mix."""
    kinds = []
    if is_centered(key_codec):
        shape = (key_codec.num_heads, dim)
        for attr in ("mean", "scale"):
            t = getattr(key_codec, attr)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                raise ValueError(f"key_codec.{attr} must be a tensor of shape {shape} (num_kv_heads, dim)")
        rope = key_codec.rope
        if rope is not None and getattr(rope, "dim", None) != dim:
            raise ValueError(f"key_codec.rope must rotate {dim} channels, got {getattr(rope, 'dim', None)}")
        key_codec = key_codec.mse
    for name, codec in (("key_codec", key_codec), ("value_codec", value_codec)):
        if is_mse(codec):
            C.check_int(f"{name}.bits", codec.bits, MSE_BITS)
            if tuple(codec.centroids.shape) != (1 << codec.bits,) or tuple(codec.rotation.shape) != (codec.dim, codec.dim):
                raise ValueError(f"{name} has centroids/rotation of the wrong shape for bits={codec.bits}, dim={codec.dim}")
            kinds.append("mse")
        elif is_affine(codec):
            C.check_int(f"{name}.bits", codec.bits, AFFINE_BITS)
            if codec.axis != "token":
                raise ValueError(f"{name}.axis must be 'token' (per-token keys and values), got {codec.axis!r}")
            gs = codec.group_size
            if gs < 16 or gs & (gs - 1) or dim % gs:
                raise ValueError(f"{name}.group_size must be a power of two >= 16 dividing dim={dim}, got {gs}")
            kinds.append("affine")
        else:
            allowed = "kvlab.MSECodec, a centred MSE codec (keys) or kvlab.AffineCodec"
            raise TypeError(f"{name} must be a {allowed}, got {type(codec).__name__}")
        if is_mse(codec) and codec.dim != dim:
            raise ValueError(f"{name}.dim ({codec.dim}) must equal q's last dimension ({dim})")
    if kinds[0] != kinds[1]:
        raise TypeError("key_codec and value_codec must be the same kind of codec (both MSE or both affine), "
                        f"got {type(key_codec).__name__} and {type(value_codec).__name__}")
    if kinds[0] == "affine" and key_codec.group_size != value_codec.group_size:
        raise ValueError(f"key_codec and value_codec must share group_size, got {key_codec.group_size} and {value_codec.group_size}")
    return kinds[0]


def slot_layout(kind, dim, key_codec, value_codec):
    if kind == "mse":
        return MSESlot(dim, key_codec.bits, value_codec.bits)
    return AffineSlot(dim, key_codec.bits, value_codec.bits, key_codec.group_size)


def check_paged_inputs(q, cache, block_table, seq_lens, layout, check: bool):
    """Shapes, dtypes, devices (always) and block_table / seq_lens values (``check``: one host sync)."""
    C.check_tensor("cache", cache, (torch.uint8,))
    if cache.dim() != 4 or cache.shape[-1] != layout.slot_bytes:
        raise ValueError(f"cache must have shape [num_blocks, block_size, num_kv_heads, {layout.slot_bytes}] "
                         f"for {layout}, got {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError(f"cache must be contiguous in its last (byte) dimension, got strides {cache.stride()}")
    if cache.data_ptr() % 4 or any(s % 4 for s in cache.stride()[:3]):
        raise ValueError("cache must be 4-byte aligned: its address and its block, position and head strides "
                         f"must be multiples of 4 bytes, got strides {cache.stride()}")
    num_blocks, block_size, num_kv_heads, _ = cache.shape
    batch, num_q_heads = q.shape[0], q.shape[-2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q's number of heads ({num_q_heads}) must be a multiple of the cache's num_kv_heads "
                         f"({num_kv_heads}) (grouped-query attention)")
    if num_q_heads // num_kv_heads > 64:
        raise ValueError(f"at most 64 query heads per KV head are supported, got {num_q_heads // num_kv_heads}")
    C.check_tensor("block_table", block_table, (torch.int32,))
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table must have shape [batch={batch}, max_blocks >= 1], got {tuple(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    C.check_tensor("seq_lens", seq_lens, (torch.int32, torch.int64))
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must have shape ({batch},) (one length per sequence), got {tuple(seq_lens.shape)}")
    if seq_lens.shape[0] > 1 and seq_lens.stride(0) != 1:
        raise ValueError(f"seq_lens must be contiguous (stride 1), got stride {seq_lens.stride(0)}: pass seq_lens.contiguous()")
    C.check_same_device(q=q, cache=cache, block_table=block_table, seq_lens=seq_lens)
    C.check_kernel_device("cache", cache)
    capacity = block_table.shape[1] * block_size
    if check and batch:
        if bool((seq_lens < 1).any()):
            raise ValueError("seq_lens must be >= 1 (every sequence attends over at least one cached token)")
        if bool((seq_lens > capacity).any()):
            raise ValueError(f"seq_lens must be <= max_blocks * block_size = {capacity} (the block table's capacity), "
                             f"got max {int(seq_lens.max())}")
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * block_size < seq_lens[:, None]
        bad = used & ((block_table < 0) | (block_table >= num_blocks))
        if bool(bad.any()):
            raise ValueError(f"block_table entries of used blocks must be in [0, {num_blocks}) (num_blocks of the cache)")
    return num_blocks, block_size, num_kv_heads, capacity
