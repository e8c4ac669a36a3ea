"""The transform codec in a paged cache: ``store`` and ``load`` (checks, the two matrix products, the kernels).

``cache`` is uint8 ``[num_blocks, block_size, row_bytes]`` (or any shape whose last dimension is
``codec.row_bytes``): one row per token, its groups' slots back to back (``kvlab.transform.codec``).
``store`` writes token ``i`` of ``x [T, groups * dim]`` to row ``slot_mapping[i]`` (``-1``: not written);
``load`` returns the decoded vectors of the rows ``slots``. The kernels (``kvlab.transform.triton``) run on a
CUDA device, or in Triton's interpreter on a CPU; ``kvlab.transform.reference`` is their oracle (not used here).
"""

from __future__ import annotations

import torch

from .. import _checks as C
from . import triton as K
from .codec import TransformCodec, check_gains

__all__ = ["check_gains", "load", "prepare", "store", "transform", "untransform"]


def _on(codec: TransformCodec, device) -> TransformCodec:
    """The codec's tensors on ``device`` (moved once, kept with the codec)."""
    if codec.device == torch.device(device):
        return codec
    moved = codec.__dict__.setdefault("_moved", {})
    key = str(device)
    if key not in moved:
        moved[key] = codec.to(device)
    return moved[key]


def transform(codec: TransformCodec, x: torch.Tensor) -> torch.Tensor:
    """``x [T, groups * dim]`` -> ``y [T, groups, dim]`` float32: ``(x - mean[g]) @ forward[g]``."""
    c = _on(codec, x.device)
    x = x.float().reshape(x.shape[0], c.groups, c.dim)
    return torch.einsum("...gd,gde->...ge", x - c.mean, c.forward).contiguous()


def untransform(codec: TransformCodec, y: torch.Tensor) -> torch.Tensor:
    """``y [..., groups, dim]`` -> ``x [..., groups * dim]`` float32: ``mean[g] + y @ inverse[g]``."""
    c = _on(codec, y.device)
    x = torch.einsum("...gd,gde->...ge", y, c.inverse) + c.mean
    return x.reshape(*x.shape[:-2], c.groups * c.dim)


def _num_slots(cache, codec) -> int:
    K.check_cache(cache, codec)
    return cache.numel() // codec.row_bytes


def _check_slots(name, slots, count, num_slots, device, allow_padding, values) -> None:
    C.check_tensor(name, slots, (torch.int32, torch.int64))
    if slots.dim() != 1 or (count is not None and slots.shape[0] != count):
        expect = f"{count} entries" if count is not None else "any length"
        raise ValueError(f"{name} must be 1-d with {expect}, got shape {tuple(slots.shape)}")
    if slots.device != device:
        raise ValueError(f"{name} is on {slots.device}, the cache on {device}")
    if values and slots.numel():
        low = -1 if allow_padding else 0
        if bool((slots < low).any()) or bool((slots >= num_slots).any()):
            raise ValueError(f"{name} must hold rows in [{low}, {num_slots}) of the cache, got values from "
                             f"{int(slots.min())} to {int(slots.max())}")


def prepare(x: torch.Tensor, codec: TransformCodec, cache: torch.Tensor, slot_mapping: torch.Tensor, *,
            check: bool = True, name: str = "x") -> torch.Tensor:
    """The checks of ``store`` and its first matrix product: ``y [T, groups, dim]`` float32, ready for
    ``kvlab.transform.triton.store_transform`` (a caller storing two parts checks both before writing either)."""
    C.check_bool("check", check)
    num_slots = _num_slots(cache, codec)
    C.check_tensor(name, x, C.FLOAT_DTYPES)
    if x.dim() != 2 or x.shape[1] != codec.groups * codec.dim:
        raise ValueError(f"{name} must be [tokens, groups * dim] = [T, {codec.groups * codec.dim}], "
                         f"got {tuple(x.shape)}")
    if x.device != cache.device:
        raise ValueError(f"{name} is on {x.device}, the cache on {cache.device}")
    _check_slots("slot_mapping", slot_mapping, x.shape[0], num_slots, cache.device, True, check)
    if check:
        C.check_finite(name, x)
    y = transform(codec, x)
    if check:
        check_gains(codec, y, name)
    return y


def store(x: torch.Tensor, codec: TransformCodec, cache: torch.Tensor, slot_mapping: torch.Tensor, *,
          check: bool = True) -> None:
    """Encode ``x [T, groups * dim]`` (float) into the rows ``slot_mapping [T]`` of ``cache``.

    With ``check`` (one host sync): finite values, rows in range, every gain within fp16's range at both
    ends; a failing call writes nothing. Without it, a row outside the cache is not written."""
    y = prepare(x, codec, cache, slot_mapping, check=check)
    K.store_transform(y, codec, cache, slot_mapping)


def load(cache: torch.Tensor, codec: TransformCodec, slots: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """The decoded vectors ``[N, groups * dim]`` float32 of the rows ``slots [N]`` of ``cache``.

    With ``check`` (one host sync): every slot a row of the cache; without it, a slot outside the cache reads as a
    transformed vector of zeros (the codec's mean)."""
    C.check_bool("check", check)
    num_slots = _num_slots(cache, codec)
    _check_slots("slots", slots, None, num_slots, cache.device, False, check)
    return untransform(codec, K.load_transform(cache, codec, slots))
