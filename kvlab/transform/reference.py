"""Pure-torch reference of the transform codec: the oracle its kernels must reproduce byte for byte.

``transform`` / ``untransform`` are the codec's two matrix products (float32, as ``torch.matmul`` computes
them; kernels take ``y`` as given, so their bytes do not depend on a summation order). Everything after
them is exact: the gain is an fp64 sum of squares rounded to fp16, a component's code is a count of
comparisons ``y > boundary * gain`` (one float32 multiply each), packing is integer arithmetic, and
decoding is one float32 multiply ``centroid * gain``.

Layouts: ``kvlab.transform.codec``.
"""

from __future__ import annotations

import torch

from .codec import TransformCodec, check_gains  # noqa: F401  (the store's check, shared with the kernels' api)

__all__ = ["check_gains", "decode", "dequantize", "encode", "pack", "quantize", "read_rows", "transform", "unpack", "untransform",
           "write_rows"]


def transform(codec: TransformCodec, x: torch.Tensor) -> torch.Tensor:
    """``x [..., groups * dim]`` -> ``y [..., groups, dim]`` float32: ``(x - mean[g]) @ forward[g]``."""
    x = x.float().reshape(*x.shape[:-1], codec.groups, codec.dim)
    return torch.einsum("...gd,gde->...ge", x - codec.mean, codec.forward)


def untransform(codec: TransformCodec, y: torch.Tensor) -> torch.Tensor:
    """``y [..., groups, dim]`` -> ``x [..., groups * dim]`` float32: ``mean[g] + y @ inverse[g]``."""
    x = torch.einsum("...gd,gde->...ge", y.float(), codec.inverse) + codec.mean
    return x.reshape(*x.shape[:-2], codec.groups * codec.dim)


def gains(codec: TransformCodec, y: torch.Tensor) -> torch.Tensor:
    """``[..., groups]`` fp16: the root mean square of each group of ``y``, or ones with ``gain=False``."""
    if not codec.gain:
        return torch.ones(y.shape[:-1], dtype=torch.float16, device=y.device)
    return (y.double().square().sum(-1) / codec.dim).sqrt().to(torch.float16)


def quantize(codec: TransformCodec, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``y [..., groups, dim]`` float32 -> ``(codes [..., groups, dim] int64, gain [..., groups] fp16)``."""
    gain = gains(codec, y)
    thresholds = codec.boundaries * gain.float()[..., None, None]          # [..., groups, dim, levels - 1]
    codes = (y.float().unsqueeze(-1) > thresholds).sum(-1)
    return codes, gain


def dequantize(codec: TransformCodec, codes: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """``y_hat [..., groups, dim]`` float32 = ``codebooks[g, c, codes] * gain``."""
    book = codec.codebooks.expand(*codes.shape, codec.codebooks.shape[-1])
    return torch.gather(book, -1, codes.long().unsqueeze(-1)).squeeze(-1) * gain.float().unsqueeze(-1)


def pack(codec: TransformCodec, codes: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """``codes [..., groups, dim]``, ``gain [..., groups]`` -> rows ``[..., row_bytes]`` uint8."""
    lead = codes.shape[:-2]
    # two spare bytes: a code that straddles the row's last byte, and a zero-bit component at the row's very end
    out = torch.zeros(*lead, codec.row_bytes + 2, dtype=torch.int64, device=codes.device)
    offsets = codec.offsets.to(codes.device)
    for g, (start, nbytes) in enumerate(zip(codec.group_offsets, codec.group_bytes)):
        bit = offsets[g]
        byte, shift = start + bit // 8, bit % 8
        c = codes[..., g, :].long()
        out.index_add_(-1, byte, (c << shift) & 0xFF)
        out.index_add_(-1, byte + 1, c >> (8 - shift))              # the part that straddles into the next byte
        if codec.gain:
            at = start + nbytes - 2
            half = gain[..., g].contiguous().view(torch.int16).long() & 0xFFFF
            out[..., at] = half & 0xFF
            out[..., at + 1] = half >> 8
    return out[..., : codec.row_bytes].to(torch.uint8)


def unpack(codec: TransformCodec, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``pack``: rows ``[..., row_bytes]`` -> ``(codes [..., groups, dim] int64, gain [..., groups] fp16)``."""
    lead = rows.shape[:-1]
    r = torch.cat([rows.long(), torch.zeros(*lead, 2, dtype=torch.int64, device=rows.device)], -1)  # as in pack
    offsets = codec.offsets.to(rows.device)
    bits = codec.bits.long().to(rows.device)
    codes, gain = [], []
    for g, (start, nbytes) in enumerate(zip(codec.group_offsets, codec.group_bytes)):
        byte, shift = start + offsets[g] // 8, offsets[g] % 8
        word = r[..., byte] | (r[..., byte + 1] << 8)
        codes.append((word >> shift) & ((1 << bits[g]) - 1))
        if codec.gain:
            at = start + nbytes - 2
            half = r[..., at] | (r[..., at + 1] << 8)
            gain.append(((half ^ 0x8000) - 0x8000).to(torch.int16).view(torch.float16))
        else:
            gain.append(torch.ones(lead, dtype=torch.float16, device=rows.device))
    return torch.stack(codes, -2), torch.stack(gain, -1)


def encode(codec: TransformCodec, x: torch.Tensor) -> torch.Tensor:
    """``x [..., groups * dim]`` -> rows ``[..., row_bytes]`` uint8."""
    return pack(codec, *quantize(codec, transform(codec, x)))


def decode(codec: TransformCodec, rows: torch.Tensor) -> torch.Tensor:
    """rows ``[..., row_bytes]`` -> ``x_hat [..., groups * dim]`` float32."""
    return untransform(codec, dequantize(codec, *unpack(codec, rows)))


def write_rows(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """Paged cache ``[num_blocks, block_size, row_bytes]``: token ``i``'s row to slot ``slot_mapping[i]``
    (``block * block_size + offset``; ``-1``: padding, not written)."""
    flat = cache.view(-1, cache.shape[-1])
    keep = slot_mapping >= 0
    flat[slot_mapping[keep].long()] = rows[keep]


def read_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows at ``slots`` (any shape) of a paged cache: ``[*slots.shape, row_bytes]``."""
    return cache.view(-1, cache.shape[-1])[slots.long()]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, key_codec: TransformCodec, value_codec: TransformCodec, *,
                     scale: float, rope=None, first_position: int = 0, first: int = 0, return_lse: bool = False):
    """One decode step over paged transform-codec caches: ``q [B, Hq, D]`` -> ``[B, Hq, D]`` float32.

    Token ``t`` of sequence ``b`` is row ``block_table[b, t // block_size] * block_size + t % block_size`` of
    ``k_cache`` / ``v_cache`` (``[num_blocks, block_size, row_bytes]``), at position ``first_position + t``;
    ``seq_lens[b]`` tokens are read. ``rope`` (a ``kvlab.RoPE``): the keys were coded before RoPE, which is
    applied to the decoded keys at their positions. Query head ``j`` reads KV head ``j // (Hq // H)``. ``first``:
    tokens ``first .. seq_lens[b] - 1`` are read (none: output 0); ``return_lse``: also the log-sum-exp of each query
    head's scores ``[B, Hq]`` float32 (``-inf`` over no token)."""
    batch, q_heads, dim = q.shape
    block_size = k_cache.shape[1]
    out = torch.zeros(batch, q_heads, dim, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, q_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(seq_lens[b])
        t = torch.arange(min(first, n), n, device=q.device)
        n = t.numel()
        if n == 0:
            continue
        slots = block_table[b, t // block_size].long() * block_size + t % block_size
        k = decode(key_codec, read_rows(k_cache.view(-1, k_cache.shape[-1]), slots))  # [n, H * D]
        v = decode(value_codec, read_rows(v_cache.view(-1, v_cache.shape[-1]), slots))
        heads = k.shape[-1] // dim
        k, v = k.view(n, heads, dim), v.view(n, heads, dim)
        if rope is not None:
            k = rope.apply(k, (t + first_position)[:, None]).to(q.device, torch.float32)
        group = q_heads // heads
        kh, vh = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, Hq, D]
        s = torch.einsum("hd,nhd->hn", q[b].float(), kh) * scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vh)
        lse[b] = torch.logsumexp(s, -1)
    return (out, lse) if return_lse else out
