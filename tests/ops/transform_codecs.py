"""Random transform codecs for the transform codec's tests: an orthogonal transform per group, random widths and
sorted codebooks."""

import torch

from kvlab.transform import TransformCodec


def random_codec(width, groups, seed, *, gain=True, min_bits=1, max_bits=4):
    """A ``TransformCodec`` of ``groups`` groups of ``width // groups`` components, widths in [min_bits, max_bits]."""
    g = torch.Generator().manual_seed(seed)
    dim = width // groups
    q, _ = torch.linalg.qr(torch.randn(groups, dim, dim, generator=g, dtype=torch.float64))
    q = q.float()
    bits = torch.randint(min_bits, max_bits + 1, (groups, dim), generator=g)
    books = torch.sort(torch.randn(groups, dim, 1 << max_bits, generator=g), -1).values
    return TransformCodec(torch.randn(groups, dim, generator=g) * 0.3, q.contiguous(), q.transpose(1, 2).contiguous(),
                          bits, books, gain)


def fused_codec(heads, dim, counts, seed):
    """A ``TransformCodec`` in the fused layout (``kvlab.transform.fused``): an orthogonal transform per head,
    ``counts`` components of 8, 4 and 2 bits (widest first, the rest none) on uniform levels, no gain."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(heads, dim, dim, generator=g, dtype=torch.float64))
    q = q.float()
    row = torch.zeros(dim, dtype=torch.long)
    at = 0
    for n, w in zip(counts, (8, 4, 2)):
        row[at : at + n] = w
        at += n
    lo = -torch.rand(heads, dim, generator=g) - 0.5
    step = -2 * lo / ((1 << row) - 1).clamp_min(1)
    books = lo[..., None] + step[..., None] * torch.arange(256)
    books = torch.where(row[:, None] > 0, books, torch.zeros_like(books))  # 0-bit components: one level, 0
    return TransformCodec(torch.randn(heads, dim, generator=g) * 0.3, q.contiguous(), q.transpose(1, 2).contiguous(),
                          row.expand(heads, dim).contiguous(), books, False)
