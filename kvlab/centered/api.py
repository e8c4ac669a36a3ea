"""Triton path of the centred MSE key codec in the paged KV cache: ``store_centered_mse``, ``load_centered_mse``.

What
    ``store_centered_mse`` writes keys with the centred MSE codec and values with the MSE codec into the
    slots of ``slot_mapping``: it normalises the keys in torch (``z = (k - mean) * inv_scale``, the
    reference's two fp32 roundings; with ``rope`` the mean at each token's position) and hands ``z``
    and the values to ``kvlab.mse.store_mse``, whose kernel rotates, quantizes and packs them. The
    bytes equal the reference's exactly. The normalisation costs one extra pass over the keys, which is
    small beside the store itself; a store writes one token per sequence and step in decoding, which
    attention reading the whole cache dwarfs.

    ``load_centered_mse`` decodes the key part with the MSE load kernel (``kvlab.mse.load_mse``) and maps
    it back: ``z_hat * scale[h]`` (space ``"centered"``, what attention needs: see below) plus
    ``mean[h]`` (space ``"model"``, the key).

Layout (``kvlab.layout``)
    The slot of the MSE codec, unchanged: uint8 ``[num_blocks, block_size, num_heads, slot_bytes]``, one
    slot of one head ``key indices | key norm (fp16) | value indices | value norm (fp16)``; the key
    code is ``MSECodec.encode(z)``. The codec's ``mean``, ``scale`` and ``inv_scale`` (fp32 ``[num_heads,
    dim]``) are per-layer constants; with ``rope`` the launcher expands the mean to the tokens'
    positions (``codec.mean_rows``, computed in float64 on the CPU).

Attention over the codes
    ``q . k_hat = q . (scale * z_hat) + q . m_n``, ``m_n`` the mean at the token's position ``n``. A
    decode kernel scores the query ``(q * scale[h]) @ R`` (per KV head, once per step) against the
    rotated codes, exactly as for the plain MSE codec. With a constant mean (no ``rope``) the second
    term is the same for every token, so the softmax drops it and the kernel never reads the mean (as
    long as every key it attends to is centred: tokens kept unquantized must be centred too, or get
    ``q . mean`` added back). With ``rope`` the mean is ``RoPE_n(mean)`` and the kernel adds
    ``q . RoPE_n(mean) = sum_j a_j cos(n w_j) + b_j sin(n w_j)`` per token, ``a_j, b_j`` from the query
    and the mean (once per step and head), ``cos``/``sin`` from a per-position table shared by all
    heads and layers: one more 64-term dot product per token.

Reference
    ``kvlab.centered.reference.CenteredMSECodec`` with ``kvlab.mse.reference.store_slots`` / ``load_slots``;
    this module does not import it (``tests/ops/test_centered.py`` compares the two: equal cache bytes,
    decoded keys to 1e-6 relative like ``load_mse``).
"""

from __future__ import annotations

import torch

from .. import _checks as C
from ..layout import MSESlot
from ..params import CenteredParams
from ..mse.api import check_codec, load_mse, store_mse

__all__ = ["load_centered_mse", "store_centered_mse"]

def _check_centered_codec(name: str, codec) -> None:
    if not isinstance(codec, CenteredParams):
        raise TypeError(f"{name} must be a centred MSE codec (kvlab.CenteredMSECodec), got {type(codec).__name__}")
    shape = (codec.num_heads, codec.dim)
    for attr in ("mean", "scale", "inv_scale"):
        t = getattr(codec, attr)
        C.check_tensor(f"{name}.{attr}", t, (torch.float32,))
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}.{attr} must have shape {shape}, got {tuple(t.shape)}")


def _table(codec, attr: str, device) -> torch.Tensor:
    return getattr(codec, attr).to(device)


def _mean_rows(codec, positions, num_tokens: int, device) -> torch.Tensor:
    """The codec's mean: ``[num_heads, dim]``, or ``[num_tokens, num_heads, dim]`` at ``positions`` (``rope``)."""
    if codec.rope is None:
        return _table(codec, "mean", device)
    C.check_tensor("positions", positions, (torch.int32, torch.int64))
    if tuple(positions.shape) != (num_tokens,):
        raise ValueError(f"positions must have shape ({num_tokens},) (one position per token), got {tuple(positions.shape)}")
    return codec.mean_rows(positions.cpu(), (num_tokens,)).to(device).contiguous()


def store_centered_mse(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor,
                       key_codec, value_codec, *, positions: torch.Tensor | None = None, check: bool = True,
                       launch=None) -> None:
    """Encode ``key`` (centred MSE) and ``value`` (MSE) ``[num_tokens, num_heads, dim]`` into ``cache`` (in place).

    ``cache`` is uint8 ``[num_blocks, block_size, num_heads, MSESlot(dim, key_bits, value_bits).slot_bytes]``,
    contiguous in its last dimension; token ``i`` goes to slot ``slot_mapping[i]``, ``-1`` skips it. The
    bytes equal ``store_slots(cache, slot_mapping, key_codec.encode(key, positions),
    value_codec.encode(value), layout)``; ``positions`` (int ``[num_tokens]``) is needed when the codec's
    mean turns with the position (``key_codec.rope``). ``check`` and ``launch`` (a ``kvlab.CodecLaunch``) are
    those of ``kvlab.mse.store_mse`` (for keys, the norm checked is that of the normalised ``z``).
    """
    _check_centered_codec("key_codec", key_codec)
    check_codec("key_codec.mse", key_codec.mse)
    check_codec("value_codec", value_codec)
    C.check_tensor("key", key, C.FLOAT_DTYPES)
    C.check_tensor("value", value, C.FLOAT_DTYPES)
    if key.dim() != 3 or tuple(key.shape[1:]) != (key_codec.num_heads, key_codec.dim):
        raise ValueError(f"key must have shape [num_tokens, {key_codec.num_heads}, {key_codec.dim}] for key_codec, "
                         f"got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value must have the shape of key {tuple(key.shape)}, got {tuple(value.shape)}")
    num_tokens, num_heads, dim = key.shape
    if value_codec.dim != dim:
        raise ValueError(f"value_codec.dim ({value_codec.dim}) must equal key's last dimension ({dim})")
    C.check_tensor("cache", cache, (torch.uint8,))
    layout = MSESlot(dim, key_codec.bits, value_codec.bits)
    if cache.dim() != 4 or tuple(cache.shape[2:]) != (num_heads, layout.slot_bytes) or cache.stride(-1) != 1:
        raise ValueError(f"cache must be [num_blocks, block_size, {num_heads}, {layout.slot_bytes}] for {layout}, "
                         f"contiguous in its last dimension, got shape {tuple(cache.shape)}")
    C.check_same_device(cache=cache, key=key, value=value, slot_mapping=slot_mapping)
    C.check_kernel_device("cache", cache)
    C.check_bool("check", check)
    # shape, dtype and device here; the slot range (one host sync) and the launch settings in store_mse
    C.check_slot_mapping(slot_mapping, num_tokens, cache.shape[0] * cache.shape[1], cache.device, values=False)
    key_mean = _mean_rows(key_codec, positions, num_tokens, cache.device)
    z = (key.float() - key_mean) * _table(key_codec, "inv_scale", cache.device)  # CenteredMSECodec.normalize
    store_mse(z, value, slot_mapping, cache, key_codec.mse, value_codec, check=check, launch=launch)


def load_centered_mse(cache: torch.Tensor, slot_mapping: torch.Tensor, codec, space: str = "model",
                      out_dtype: torch.dtype = torch.float16, *, positions: torch.Tensor | None = None,
                      **kwargs) -> torch.Tensor:
    """Decode the key codes of ``slot_mapping``'s slots: ``[num_tokens, num_heads, dim]`` in ``out_dtype``.

    ``space="model"``: the keys (``codec.decode(codes)``); ``"centered"``: the keys without their mean
    (what attention needs); ``"rotated"``: the MSE codec's rotated, normalised vectors (``load_mse``).
    Rows whose slot is -1 decode as ``0`` (``"rotated"``, ``"centered"``) or as the mean (``"model"``).
    ``positions`` (int ``[num_tokens]``): needed for ``"model"`` when the mean turns with the position
    (``codec.rope``). Other arguments as ``kvlab.mse.load_mse``.
    """
    _check_centered_codec("codec", codec)
    C.check_choice("space", space, ("model", "centered", "rotated"))
    if out_dtype not in C.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of (float16, bfloat16, float32), got {out_dtype}")
    C.check_tensor("cache", cache, (torch.uint8,))
    if cache.dim() == 4 and cache.shape[2] != codec.num_heads:
        raise ValueError(f"cache has {cache.shape[2]} heads, codec has {codec.num_heads}")
    if space == "rotated":
        return load_mse(cache, slot_mapping, codec.mse, part="key", space="rotated", out_dtype=out_dtype, **kwargs)
    z = load_mse(cache, slot_mapping, codec.mse, part="key", space="model", out_dtype=torch.float32, **kwargs)
    centered = z * _table(codec, "scale", cache.device)
    if space == "centered":
        return centered.to(out_dtype)
    return (centered + _mean_rows(codec, positions, slot_mapping.shape[0], cache.device)).to(out_dtype)
