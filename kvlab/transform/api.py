"""The transform codec in a paged cache: ``store`` and ``load`` (checks, the two matrix products, the kernels).

``cache`` is uint8 ``[num_blocks, block_size, row_bytes]`` (or any shape whose last dimension is
``codec.row_bytes``): one row per token, its groups' slots back to back (``kvlab.transform.codec``).
``store`` writes token ``i`` of ``x [T, groups * dim]`` to row ``slot_mapping[i]`` (``-1``: not written);
``load`` returns the decoded vectors of the rows ``slots``. The kernels (``kvlab.transform.triton``) run on a
CUDA device, or in Triton's interpreter on a CPU; ``kvlab.transform.reference`` is their oracle.
"""

from __future__ import annotations

import torch

from .. import _checks as C
from . import reference as R
from . import triton as K
from .codec import TransformCodec

__all__ = ["load", "store"]


def _check_cache(cache, codec) -> int:
    if not isinstance(codec, TransformCodec):
        raise TypeError(f"codec must be a kvlab.transform.TransformCodec, got {type(codec).__name__}")
    C.check_tensor("cache", cache, (torch.uint8,), ndim_min=2, last_dim=codec.row_bytes)
    if not cache.is_contiguous():
        raise ValueError("cache must be contiguous")
    C.check_kernel_device("cache", cache)
    return cache.numel() // codec.row_bytes


def _check_slots(name, slots, count, num_slots, device, allow_padding, check) -> None:
    C.check_tensor(name, slots, (torch.int32, torch.int64))
    if slots.dim() != 1 or slots.shape[0] != count:
        raise ValueError(f"{name} must be 1-d with {count} entries, got shape {tuple(slots.shape)}")
    if slots.device != device:
        raise ValueError(f"{name} is on {slots.device}, the cache on {device}")
    if check and count:
        low = -1 if allow_padding else 0
        if bool((slots < low).any()) or bool((slots >= num_slots).any()):
            raise ValueError(f"{name} must hold rows in [{low}, {num_slots}) of the cache, got values from "
                             f"{int(slots.min())} to {int(slots.max())}")


def store(x: torch.Tensor, codec: TransformCodec, cache: torch.Tensor, slot_mapping: torch.Tensor, *,
          check: bool = True) -> None:
    """Encode ``x [T, groups * dim]`` (float) into the rows ``slot_mapping [T]`` of ``cache``.

    With ``check`` (one host sync): finite values, rows in range, every gain within fp16's range at both
    ends; a failing call writes nothing."""
    num_slots = _check_cache(cache, codec)
    C.check_tensor("x", x, C.FLOAT_DTYPES)
    if x.dim() != 2 or x.shape[1] != codec.groups * codec.dim:
        raise ValueError(f"x must be [tokens, groups * dim] = [T, {codec.groups * codec.dim}], got {tuple(x.shape)}")
    if x.device != cache.device:
        raise ValueError(f"x is on {x.device}, the cache on {cache.device}")
    _check_slots("slot_mapping", slot_mapping, x.shape[0], num_slots, cache.device, True, check)
    tables = codec if codec.device == cache.device else codec.to(cache.device)
    y = R.transform(tables, x).contiguous()
    if check:
        C.check_finite("x", x)
        R.check_gains(codec, y, "x")
    codes, gains = K.quantize_rows(y, codec)
    K.pack_rows(codes, gains, codec, cache.view(-1, codec.row_bytes), slot_mapping.contiguous())


def load(cache: torch.Tensor, codec: TransformCodec, slots: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """The decoded vectors ``[N, groups * dim]`` float32 of the rows ``slots [N]`` of ``cache``."""
    num_slots = _check_cache(cache, codec)
    _check_slots("slots", slots, slots.shape[0] if isinstance(slots, torch.Tensor) and slots.dim() == 1 else -1,
                 num_slots, cache.device, False, check)
    y_hat = K.load_rows(cache.view(-1, codec.row_bytes), codec, slots.contiguous())
    tables = codec if codec.device == cache.device else codec.to(cache.device)
    return R.untransform(tables, y_hat)
