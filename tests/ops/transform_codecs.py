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
