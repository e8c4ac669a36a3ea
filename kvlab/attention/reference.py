"""Attention over the paged quantized cache in pure torch: the oracle of ``kvlab.attention`` (no kernel imports it).

``load_sequences`` decodes each sequence's keys and values from the cache with the reference codecs (model space);
``decode_attention_reference`` / ``prefill_attention_reference`` attend over them in fp64 and round to fp32 once.
"""

from __future__ import annotations

import torch

from ..params import CenteredParams, MSEParams

__all__ = ["decode_attention_reference", "load_sequences", "prefill_attention_reference"]


def load_sequences(cache, block_table, seq_lens, key_codec, value_codec, position_offset: int = 0):
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


def _affine_dim(key_codec, value_codec, slot_bytes: int) -> int:
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

    Computed in fp64 from ``load_sequences`` (model space), rounded to fp32 once.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    seqs = load_sequences(cache, block_table, seq_lens, key_codec, value_codec, position_offset)
    out = [_attend(q[b : b + 1].float(), k, v, scale)[0] for b, (k, v) in enumerate(seqs)]
    return torch.stack(out).float() if out else q.new_zeros(q.shape, dtype=torch.float32)


def prefill_attention_reference(q, cache, block_table, seq_lens, key_codec, value_codec, scale=None,
                                position_offset: int = 0) -> torch.Tensor:
    """fp32 ``[batch, q_len, num_q_heads, dim]``: causal attention of the last ``q_len`` tokens of each sequence."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    seqs = load_sequences(cache, block_table, seq_lens, key_codec, value_codec, position_offset)
    q_len = q.shape[1]
    out = [_attend(q[b].float(), k, v, scale, causal_from=k.shape[0] - q_len) for b, (k, v) in enumerate(seqs)]
    return torch.stack(out).float()
