"""Decode attention over paged transform-codec caches (Triton) against its pure-torch reference."""

import pytest
import torch

from kvlab import RoPE
from kvlab.transform import TransformCodec, api
from kvlab.transform import reference as R
from kvlab.transform.attention import decode_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU: Triton's interpreter

CASES = [  # batch, KV heads, query heads per KV head, head_dim, groups ("joint" 1 / per head), block size, lengths
    (2, 3, 3, 64, 1, 16, (37, 100)),
    (1, 2, 1, 32, 2, 8, (1,)),
    (3, 1, 4, 16, 1, 16, (64, 5, 33)),
]


def codec(width, groups, seed, max_bits=4):
    g = torch.Generator().manual_seed(seed)
    dim = width // groups
    q, _ = torch.linalg.qr(torch.randn(groups, dim, dim, generator=g, dtype=torch.float64))
    q = q.float()
    bits = torch.randint(0, max_bits + 1, (groups, dim), generator=g)
    books = torch.sort(torch.randn(groups, dim, 1 << max_bits, generator=g), -1).values
    return TransformCodec(torch.randn(groups, dim, generator=g) * 0.3, q.contiguous(), q.transpose(1, 2).contiguous(),
                          bits, books, True).to(DEVICE)


@pytest.mark.parametrize("pre_rope", [False, True])
@pytest.mark.parametrize("batch,heads,group,dim,groups,page,lens", CASES)
def test_equals_the_reference(batch, heads, group, dim, groups, page, lens, pre_rope):
    width = heads * dim
    kc, vc = codec(width, groups, 1), codec(width, groups, 2)
    g = torch.Generator().manual_seed(3)
    max_blocks = -(-max(lens) // page) + 1
    blocks = batch * max_blocks
    table = torch.randperm(blocks, generator=g).view(batch, max_blocks).int().to(DEVICE)
    k_cache = torch.zeros(blocks, page, kc.row_bytes, dtype=torch.uint8, device=DEVICE)
    v_cache = torch.zeros(blocks, page, vc.row_bytes, dtype=torch.uint8, device=DEVICE)
    for b, n in enumerate(lens):
        t = torch.arange(n, device=DEVICE)
        slots = table[b, t // page].long() * page + t % page
        api.store(torch.randn(n, width, generator=g).to(DEVICE), kc, k_cache, slots)
        api.store(torch.randn(n, width, generator=g).to(DEVICE), vc, v_cache, slots)
    q = torch.randn(batch, heads * group, dim, generator=g).to(DEVICE)
    rope = RoPE(1e4 ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)) if pre_rope else None
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref = R.decode_attention(q, k_cache, v_cache, table, lens_t, kc, vc, scale=dim**-0.5, rope=rope, first_position=2)
    for splits in (None, 3):
        out = decode_attention(q, k_cache, v_cache, table, lens_t, kc, vc, scale=dim**-0.5, rope=rope,
                               first_position=2, splits=splits)
        err = (out - ref).norm() / ref.norm()
        assert err < 5e-3, f"relative error {err:.2e}"


def test_bad_arguments():
    kc = codec(64, 1, 1)
    cache = torch.zeros(2, 16, kc.row_bytes, dtype=torch.uint8, device=DEVICE)
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="key_codec"):
        decode_attention(torch.randn(1, 2, 32, device=DEVICE), cache, cache, table, lens, "codec", kc, scale=1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention(torch.randn(1, 3, 32, device=DEVICE), cache, cache, table, lens, kc, kc, scale=1.0)
    with pytest.raises(ValueError, match="q must be"):
        decode_attention(torch.randn(2, 32, device=DEVICE), cache, cache, table, lens, kc, kc, scale=1.0)
    with pytest.raises(ValueError, match="block_table"):
        decode_attention(torch.randn(2, 2, 32, device=DEVICE), cache, cache, table, lens, kc, kc, scale=1.0)
