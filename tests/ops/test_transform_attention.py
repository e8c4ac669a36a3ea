"""Decode attention over paged transform-codec caches (Triton) against its pure-torch reference."""

import pytest
import torch

from kvlab import RoPE
from kvlab.transform import reference as R
from kvlab.transform.attention import decode_attention

from transform_codecs import random_codec  # tests/ops/transform_codecs.py

CASES = [  # batch, KV heads, query heads per KV head, head_dim, groups ("joint" 1 / per head), block size, lengths
    (2, 3, 3, 64, 1, 16, (37, 100)),
    (1, 2, 1, 32, 2, 8, (1,)),
    (3, 1, 4, 16, 1, 16, (64, 5, 33)),
    (2, 3, 1, 16, 3, 8, (63, 17)),  # a transform per head, no query grouping
]


def codec(width, groups, seed, max_bits=4):
    return random_codec(width, groups, seed, min_bits=0, max_bits=max_bits)


@pytest.mark.parametrize("pre_rope", [False, True])
@pytest.mark.parametrize("batch,heads,group,dim,groups,page,lens", CASES)
def test_equals_the_reference(batch, heads, group, dim, groups, page, lens, pre_rope, device):
    width = heads * dim
    kc, vc = codec(width, groups, 1), codec(width, groups, 2)
    g = torch.Generator().manual_seed(3)
    max_blocks = -(-max(lens) // page) + 1
    blocks = batch * max_blocks
    table = torch.randperm(blocks, generator=g).view(batch, max_blocks).int()
    k_cache = torch.zeros(blocks, page, kc.row_bytes, dtype=torch.uint8)
    v_cache = torch.zeros(blocks, page, vc.row_bytes, dtype=torch.uint8)
    for b, n in enumerate(lens):
        t = torch.arange(n)
        slots = table[b, t // page].long() * page + t % page
        R.write_rows(k_cache.view(-1, kc.row_bytes), slots, R.encode(kc, torch.randn(n, width, generator=g)))
        R.write_rows(v_cache.view(-1, vc.row_bytes), slots, R.encode(vc, torch.randn(n, width, generator=g)))
    q = torch.randn(batch, heads * group, dim, generator=g)
    rope = RoPE(1e4 ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)) if pre_rope else None
    lens_t = torch.tensor(lens, dtype=torch.int32)
    ref = R.decode_attention(q, k_cache, v_cache, table, lens_t, kc, vc, scale=dim**-0.5, rope=rope, first_position=2)
    on = lambda *ts: [t.to(device) for t in ts]
    for splits in (None, 3):
        out = decode_attention(*on(q, k_cache, v_cache, table, lens_t), kc.to(device), vc.to(device),
                               scale=dim**-0.5, rope=rope, first_position=2, splits=splits).cpu()
        err = (out - ref).norm() / ref.norm()
        assert err < 5e-3, f"relative error {err:.2e}"


BAD = [  # case, error, message
    ("codec", TypeError, "key_codec must be"),
    ("q_heads", ValueError, "not a multiple"),
    ("q_shape", ValueError, "q must be"),
    ("q_dtype", TypeError, "q must have dtype"),
    ("q_nan", ValueError, "q holds NaN"),
    ("width", ValueError, "both must be KV heads x head_dim"),
    ("table_batch", ValueError, "block_table must be"),
    ("table_dtype", TypeError, "block_table must have dtype"),
    ("table_entry", ValueError, "block_table's entries"),
    ("lens_zero", ValueError, r"seq_lens must be in \[1, 32\]"),
    ("lens_long", ValueError, r"seq_lens must be in \[1, 32\]"),
    ("cache_bytes", ValueError, "k_cache must have last dimension"),
    ("cache_blocks", ValueError, "k_cache and v_cache must have the same"),
    ("scale", ValueError, "scale must be a positive"),
    ("rope", TypeError, "rope must be None or a kvlab.RoPE"),
    ("rope_dim", ValueError, "rope rotates 16 channels"),
    ("splits", ValueError, "splits must be >= 1"),
    ("check", TypeError, "check must be a bool"),
]


@pytest.mark.parametrize("case,error,match", BAD)
def test_bad_arguments(case, error, match, device):
    kc = codec(64, 1, 1)
    args = dict(q=torch.randn(1, 2, 32), k_cache=torch.zeros(2, 16, kc.row_bytes, dtype=torch.uint8),
                v_cache=torch.zeros(2, 16, kc.row_bytes, dtype=torch.uint8), block_table=torch.tensor([[1, 0]]),
                seq_lens=torch.tensor([20]), key_codec=kc, value_codec=kc)
    kwargs = dict(scale=1.0)
    if case == "codec":
        args["key_codec"] = "codec"
    elif case == "q_heads":
        args["q"] = torch.randn(1, 3, 32)
    elif case == "q_shape":
        args["q"] = torch.randn(2, 32)
    elif case == "q_dtype":
        args["q"] = args["q"].double()
    elif case == "q_nan":
        args["q"][0, 1, 2] = float("nan")
    elif case == "width":
        args["q"] = torch.randn(1, 2, 48)
    elif case == "table_batch":
        args["q"] = torch.randn(2, 2, 32)
    elif case == "table_dtype":
        args["block_table"] = args["block_table"].float()
    elif case == "table_entry":
        args["block_table"] = torch.tensor([[1, 2]])
    elif case == "lens_zero":
        args["seq_lens"] = torch.tensor([0])
    elif case == "lens_long":
        args["seq_lens"] = torch.tensor([33])
    elif case == "cache_bytes":
        args["k_cache"] = torch.zeros(2, 16, kc.row_bytes + 1, dtype=torch.uint8)
    elif case == "cache_blocks":
        args["v_cache"] = torch.zeros(3, 16, kc.row_bytes, dtype=torch.uint8)
    elif case == "scale":
        kwargs["scale"] = 0.0
    elif case == "rope":
        kwargs["rope"] = "rope"
    elif case == "rope_dim":
        kwargs["rope"] = RoPE(torch.ones(8, dtype=torch.float64))
    elif case == "splits":
        kwargs["splits"] = 0
    elif case == "check":
        kwargs["check"] = 1
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(error, match=match):
        decode_attention(**args, **kwargs)


def _one_sequence(device, n=20, seed=4):
    kc, vc = codec(64, 1, 1), codec(64, 1, 2)
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(2, 16, kc.row_bytes, dtype=torch.uint8)
    v_cache = torch.zeros(2, 16, vc.row_bytes, dtype=torch.uint8)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    t = torch.arange(n)
    slots = table[0, t // 16].long() * 16 + t % 16
    R.write_rows(k_cache.view(-1, kc.row_bytes), slots, R.encode(kc, torch.randn(n, 64, generator=g)))
    R.write_rows(v_cache.view(-1, vc.row_bytes), slots, R.encode(vc, torch.randn(n, 64, generator=g)))
    return kc, vc, k_cache, v_cache, table, torch.tensor([n], dtype=torch.int32)


@pytest.mark.parametrize("pre_rope", [False, True])
def test_queries_beyond_fp16_are_scaled_into_its_range(pre_rope, device):
    """q * scale past 65504 would make the fp16 copy of the queries infinite: the call scales it by a power of two."""
    kc, vc, k_cache, v_cache, table, lens = _one_sequence(device)
    q = torch.randn(1, 2, 32, generator=torch.Generator().manual_seed(5)) * 4e4
    rope = RoPE(1e4 ** -(torch.arange(0, 32, 2, dtype=torch.float64) / 32)) if pre_rope else None
    ref = R.decode_attention(q, k_cache, v_cache, table, lens, kc, vc, scale=4.0, rope=rope)
    on = lambda *ts: [t.to(device) for t in ts]
    out = decode_attention(*on(q, k_cache, v_cache, table, lens), kc.to(device), vc.to(device), scale=4.0,
                           rope=rope).cpu()
    assert torch.isfinite(out).all()
    assert (out - ref).norm() / ref.norm() < 5e-3


def test_an_empty_batch_and_unchecked_entries(device):
    kc, vc, k_cache, v_cache, table, lens = _one_sequence(device)
    on = lambda *ts: [t.to(device) for t in ts]
    empty = decode_attention(*on(torch.zeros(0, 2, 32), k_cache, v_cache, table[:0], lens[:0]), kc.to(device),
                             vc.to(device), scale=1.0)
    assert empty.shape == (0, 2, 32)
    # check=False: entries and lengths outside the table and caches are clamped into them, never read past them
    bad_table, long_lens = torch.tensor([[1, 10**7]], dtype=torch.int32), torch.tensor([10**6], dtype=torch.int32)
    out = decode_attention(*on(torch.randn(1, 2, 32), k_cache, v_cache, bad_table, long_lens), kc.to(device),
                           vc.to(device), scale=1.0, check=False)
    assert out.shape == (1, 2, 32) and torch.isfinite(out).all()


FUSED = [  # batch, KV heads, query heads per KV head, head_dim, (8-bit, 4-bit, 2-bit components), block size, lengths
    (2, 2, 4, 64, (0, 32, 32), 16, (100, 37)),
    (1, 3, 3, 64, (16, 16, 16), 8, (1,)),
    (3, 1, 1, 32, (0, 0, 32), 16, (64, 5, 130)),
    (2, 2, 2, 128, (16, 48, 48), 16, (200, 71)),  # runs of 6 words: padded tiles
    (1, 1, 5, 16, (16, 0, 0), 8, (9,)),
]


@pytest.mark.parametrize("batch,heads,group,dim,counts,page,lens", FUSED)
def test_fused_layout_equals_the_reference(batch, heads, group, dim, counts, page, lens, device):
    """Codecs in the fused layout take ``kvlab.transform.fused``'s kernel (scores on the codes, no lookup)."""
    from kvlab.transform.fused import fused_layout
    from transform_codecs import fused_codec

    kc, vc = fused_codec(heads, dim, counts, 1), fused_codec(heads, dim, counts[::-1] if sum(counts) == dim and
                                                              counts[0] == counts[2] else counts, 2)
    assert fused_layout(kc) is not None and fused_layout(vc) is not None
    g = torch.Generator().manual_seed(3)
    max_blocks = -(-max(lens) // page) + 1
    blocks = batch * max_blocks
    table = torch.randperm(blocks, generator=g).view(batch, max_blocks).int()
    k_cache = torch.full((blocks, page, kc.row_bytes), 255, dtype=torch.uint8)  # unused slots: all ones
    v_cache = torch.full((blocks, page, vc.row_bytes), 255, dtype=torch.uint8)
    for b, n in enumerate(lens):
        t = torch.arange(n)
        slots = table[b, t // page].long() * page + t % page
        R.write_rows(k_cache.view(-1, kc.row_bytes), slots, R.encode(kc, torch.randn(n, heads * dim, generator=g)))
        R.write_rows(v_cache.view(-1, vc.row_bytes), slots, R.encode(vc, torch.randn(n, heads * dim, generator=g)))
    q = 3 * torch.randn(batch, heads * group, dim, generator=g)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    ref = R.decode_attention(q, k_cache, v_cache, table, lens_t, kc, vc, scale=dim**-0.5)
    on = lambda *ts: [t.to(device) for t in ts]
    for splits in (None, 2):
        out = decode_attention(*on(q, k_cache, v_cache, table, lens_t), kc.to(device), vc.to(device),
                               scale=dim**-0.5, splits=splits).cpu()
        err = (out - ref).norm() / ref.norm()
        assert err < 2e-3, f"relative error {err:.2e}"
    # from token `first` on, with the log-sum-exp of the scores (none read where a sequence is shorter)
    first = 3
    ref, ref_lse = R.decode_attention(q, k_cache, v_cache, table, lens_t, kc, vc, scale=dim**-0.5, first=first,
                                      return_lse=True)
    out, lse = decode_attention(*on(q, k_cache, v_cache, table, lens_t), kc.to(device), vc.to(device),
                                scale=dim**-0.5, first=first, return_lse=True)
    out, lse = out.cpu(), lse.cpu()
    empty = torch.tensor(lens) <= first
    assert torch.equal(torch.isinf(lse), empty[:, None].expand_as(lse)) and not out[empty].any()
    if not empty.all():
        assert (out - ref).norm() / ref.norm() < 2e-3
        assert (lse - ref_lse)[~empty].abs().max() < 1e-2
