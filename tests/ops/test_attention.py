"""Fused decode attention (kvlab.attention.triton) against fp32 attention over the dequantized cache (kvlab.attention.reference).

Caches are written by the reference codecs (``store_slots`` / ``store_affine_reference``), physical blocks
are shuffled, unused block-table entries point far outside the cache, and the output is compared by
relative error (Frobenius norm over the whole output). Both the ``prmt`` lookup (``fast=True``) and the
generic unpack run: compiled on a GPU, and on a CPU in the interpreter at small sizes, the lookup's
inline PTX through the emulator of ``tests/ptx.py``.
"""

import functools

import pytest
import torch
import triton
import triton.language as tl

import kvlab
from kvlab.attention.reference import decode_attention_reference, prefill_attention_reference
from kvlab.affine.reference import store_affine_reference
from kvlab.mse.reference import store_slots
from kvlab.affine import store_affine
from kvlab.attention import DecodeLaunch, decode_attention, prefill_attention, rotate_attention_output
from kvlab.layout import AffineSlot
from kvlab.attention.triton import tile_order
from kvlab._kernels.tables import interpreted

COMPILED = not interpreted()  # kernels compiled for a GPU (else Triton's interpreter runs them)
TOL = 1e-2
UNUSED = 10**6  # block-table entries past a sequence's end: never read

# batch lengths, q heads, kv heads, dim, key bits, value bits, block size, rotation
MSE_CASES = [
    ([1], 4, 4, 64, 4, 4, 16, "haar"),  # one cached token, GQA ratio 1
    ([37, 100, 1], 8, 2, 128, 3, 2, 16, "haar"),  # mixed lengths, not multiples of the block size, ratio 4
    ([45, 130], 16, 2, 64, 2, 3, 8, "haar"),  # ratio 8
    ([77], 8, 1, 128, 4, 3, 32, "hadamard"),  # ratio 8, one KV head
    ([200, 9], 4, 1, 128, 2, 2, 16, "haar"),  # ratio 4
    ([63, 64, 65], 2, 2, 64, 3, 4, 16, "hadamard"),  # ratio 1, around a block boundary
]
MSE_IDS = [f"L{'-'.join(map(str, c[0]))}-hq{c[1]}-hkv{c[2]}-d{c[3]}-k{c[4]}v{c[5]}-bs{c[6]}-{c[7]}" for c in MSE_CASES]
AFFINE_CASES = [
    ([33, 70], 8, 2, 128, 4, 4, 16, 32),
    ([1, 50], 2, 2, 64, 8, 8, 8, 16),
    ([90], 8, 1, 128, 4, 8, 16, 64),
]
AFFINE_IDS = [f"L{'-'.join(map(str, c[0]))}-hq{c[1]}-hkv{c[2]}-d{c[3]}-k{c[4]}v{c[5]}-bs{c[6]}-g{c[7]}" for c in AFFINE_CASES]
FAST = [False, True]  # on a CPU the fast path runs through the PTX emulator of tests/ptx.py


def rel_err(a, b):
    err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
    if err > TOL / 10:
        print(f"rel_err {err:.3e}, max abs diff {(a.double() - b.double()).abs().max().item():.3e}")
    return err


@functools.lru_cache(maxsize=None)
def mse_codecs(dim, key_bits, value_bits, rotation):
    return (kvlab.MSECodec(dim, key_bits, rotation=rotation, seed=3),
            kvlab.MSECodec(dim, value_bits, rotation=rotation, seed=4))


def paged_cache(lens, num_kv_heads, dim, block_size, slot_bytes, write, device, seed=0, spare_blocks=3):
    """A cache with shuffled physical blocks holding random keys/values of ``lens`` tokens per sequence."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = sum(-(-n // block_size) for n in lens) + spare_blocks
    cache = torch.zeros(num_blocks, block_size, num_kv_heads, slot_bytes, dtype=torch.uint8)
    physical = torch.randperm(num_blocks, generator=g)
    block_table = torch.full((len(lens), max_blocks), UNUSED, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        nb = -(-n // block_size)
        block_table[b, :nb] = physical[used : used + nb].int()
        used += nb
        scale = torch.rand(n, num_kv_heads, 1, generator=g) * 3 + 0.1
        key = torch.randn(n, num_kv_heads, dim, generator=g) * scale
        value = torch.randn(n, num_kv_heads, dim, generator=g) * scale.flip(0)
        t = torch.arange(n)
        write(cache, block_table[b].long()[t // block_size] * block_size + t % block_size, key, value)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return cache.to(device), block_table.to(device), seq_lens.to(device)


def mse_setup(case, device, seed=0):
    lens, hq, hkv, dim, kb, vb, block_size, rotation = case
    kc, vc = mse_codecs(dim, kb, vb, rotation)
    layout = kvlab.MSESlot(dim, kb, vb)
    write = lambda c, s, k, v: store_slots(c, s, kc.encode(k), vc.encode(v), layout)  # noqa: E731
    cache, block_table, seq_lens = paged_cache(lens, hkv, dim, block_size, layout.slot_bytes, write, device, seed)
    q = torch.randn(len(lens), hq, dim, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    return q, cache, block_table, seq_lens, kc, vc


def affine_setup(case, device, seed=0):
    lens, hq, hkv, dim, kb, vb, block_size, gs = case
    kc, vc = kvlab.AffineCodec(kb, gs), kvlab.AffineCodec(vb, gs)
    layout = AffineSlot(dim, kb, vb, gs)
    write = lambda c, s, k, v: store_affine_reference(c, s, k, v, kc, vc)  # noqa: E731
    cache, block_table, seq_lens = paged_cache(lens, hkv, dim, block_size, layout.slot_bytes, write, device, seed)
    q = torch.randn(len(lens), hq, dim, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    return q, cache, block_table, seq_lens, kc, vc


# launch options that change the loop's code: none, pipelined reads, transposed products, both
LOOPS = [dict(prefetch=False, keys_as_rows=False), dict(prefetch=True, keys_as_rows=False),
         dict(prefetch=False, keys_as_rows=True), dict(prefetch=True, keys_as_rows=True)]
LOOP_IDS = ["plain", "prefetch", "keys_as_rows", "prefetch-keys_as_rows"]


@pytest.mark.parametrize("loop", LOOPS, ids=LOOP_IDS)
@pytest.mark.parametrize("fast", FAST)
@pytest.mark.parametrize("case", MSE_CASES, ids=MSE_IDS)
def test_mse_decode_matches_reference(case, fast, loop, device):
    q, cache, block_table, seq_lens, kc, vc = mse_setup(case, device)
    expected = decode_attention_reference(q.half().float(), cache, block_table, seq_lens, kc, vc)
    out = decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(fast=fast, num_splits=2, **loop))
    assert out.dtype == torch.float16 and out.shape == q.shape
    assert rel_err(out, expected) <= TOL


@pytest.mark.parametrize("keys_as_rows", [False, True])
@pytest.mark.parametrize("num_warps", [1, 2])
def test_decode_on_one_and_two_warps(num_warps, keys_as_rows, device):
    """Programs of one or two warps (compiled: the MMAs of one warp, not warpgroup MMAs), MSE and affine caches."""
    for setup, case, extra in ((mse_setup, MSE_CASES[1], dict(prefetch=True)), (affine_setup, AFFINE_CASES[0], dict(fast=True))):
        q, cache, block_table, seq_lens, kc, vc = setup(case, device)
        expected = decode_attention_reference(q.half().float(), cache, block_table, seq_lens, kc, vc)
        out = decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(num_splits=3, block_n=32, num_stages=1, num_warps=num_warps, keys_as_rows=keys_as_rows, **extra))
        assert rel_err(out, expected) <= TOL, (setup.__name__, rel_err(out, expected))


@pytest.mark.parametrize("fast", FAST)
def test_mse_decode_without_norm_correction(fast, device):
    """Codecs without norm correction store the plain norm; the same kernel decodes them (c times the scale)."""
    lens, hq, hkv, dim, kb, vb, block_size, rotation = [33, 70], 4, 2, 64, 4, 2, 16, "haar"
    kc, vc = (kvlab.MSECodec(dim, b, rotation=rotation, seed=s, norm_correction=False) for b, s in ((kb, 5), (vb, 6)))
    layout = kvlab.MSESlot(dim, kb, vb)
    write = lambda c, s, k, v: store_slots(c, s, kc.encode(k), vc.encode(v), layout)  # noqa: E731
    cache, block_table, seq_lens = paged_cache(lens, hkv, dim, block_size, layout.slot_bytes, write, device)
    q = torch.randn(len(lens), hq, dim, generator=torch.Generator().manual_seed(9)).to(device).half()
    expected = decode_attention_reference(q.float(), cache, block_table, seq_lens, kc, vc)
    assert rel_err(decode_attention(q, cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(fast=fast, num_splits=2)), expected) <= TOL


# batch lengths, q heads, kv heads, dim, key bits, value bits, block size, rotation, mean turns with RoPE, position offset
CENTERED_CASES = [
    ([37, 100, 1], 8, 2, 128, 4, 3, 16, "haar", True, 0),
    ([45, 130], 6, 2, 64, 3, 3, 8, "hadamard", True, 5),  # GQA ratio 3 (SmolLM2), tokens after 5 kept elsewhere
    ([77], 4, 1, 64, 2, 4, 16, "haar", False, 0),  # a constant mean: the softmax drops its term
]
CENTERED_IDS = [f"L{'-'.join(map(str, c[0]))}-hq{c[1]}-hkv{c[2]}-d{c[3]}-k{c[4]}v{c[5]}-{c[7]}{'-rope' if c[8] else ''}-off{c[9]}"
                for c in CENTERED_CASES]


def centered_setup(case, device, seed=0):
    """Keys with a large per-channel mean (turned by RoPE at their positions) in a centred-key MSE cache."""
    from kvlab.calibration import RoPE
    from kvlab.centered import CenteredMSECodec

    lens, hq, hkv, dim, kb, vb, block_size, rotation, rope, offset = case
    g = torch.Generator().manual_seed(seed + 7)
    mean, spread = torch.randn(hkv, dim, generator=g) * 3, torch.exp(torch.randn(hkv, dim, generator=g))
    rope = RoPE(1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)) if rope else None
    kc = CenteredMSECodec(dim, kb, mean, spread, rotation=rotation, seed=3, rope=rope)
    vc = kvlab.MSECodec(dim, vb, rotation=rotation, seed=4)
    layout = kvlab.MSESlot(dim, kb, vb)

    def write(c, slots, k, v):
        positions = torch.arange(offset, offset + k.shape[0])
        k = kc.mean_rows(positions, (k.shape[0],)) + spread * k  # keys around their (turning) mean
        store_slots(c, slots, kc.encode(k, positions if rope is not None else None), vc.encode(v), layout)

    cache, block_table, seq_lens = paged_cache(lens, hkv, dim, block_size, layout.slot_bytes, write, device, seed)
    q = torch.randn(len(lens), hq, dim, generator=torch.Generator().manual_seed(seed + 1)).to(device) * 0.3
    return q, cache, block_table, seq_lens, kc, vc, offset


@pytest.mark.parametrize("loop", LOOPS[::3] + LOOPS[1:2], ids=LOOP_IDS[::3] + LOOP_IDS[1:2])
@pytest.mark.parametrize("fast", FAST)
@pytest.mark.parametrize("case", CENTERED_CASES, ids=CENTERED_IDS)
def test_centered_decode_matches_reference(case, fast, loop, device):
    q, cache, block_table, seq_lens, kc, vc, offset = centered_setup(case, device)
    expected = decode_attention_reference(q.half().float(), cache, block_table, seq_lens, kc, vc, position_offset=offset)
    out = decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, position_offset=offset, launch=DecodeLaunch(fast=fast, num_splits=2, **loop))
    assert out.dtype == torch.float16 and out.shape == q.shape
    assert rel_err(out, expected) <= TOL
    # the same codes read as plain MSE keys (no scale, no mean) attend elsewhere: the test can tell
    plain = decode_attention(q.half(), cache, block_table, seq_lens, kc.mse, vc, launch=DecodeLaunch(fast=fast, num_splits=2))
    assert rel_err(plain, expected) > 10 * TOL


def test_rope_mean_scores_are_the_query_against_the_turned_mean(device):
    q, cache, block_table, seq_lens, kc, vc, offset = centered_setup(CENTERED_CASES[1], device)
    scores = kvlab.attention.rope_mean_scores(q, kc, 50, position_offset=offset)
    turned = kc.mean_rows(torch.arange(offset, offset + 50), (50,))  # [50, hkv, dim] fp32
    expected = torch.einsum("bhgd,nhd->bhgn", q.cpu().double().view(q.shape[0], kc.num_heads, -1, q.shape[-1]),
                            turned.double()).reshape(q.shape[0], q.shape[1], 50)
    assert rel_err(scores.cpu(), expected) <= 1e-5


@pytest.mark.parametrize("keys_as_rows", [False, True])
@pytest.mark.parametrize("fast", FAST)
@pytest.mark.parametrize("case", AFFINE_CASES, ids=AFFINE_IDS)
def test_affine_decode_matches_reference(case, fast, keys_as_rows, device):
    """fast=True dequantizes in fp16 pairs, in a tile order of its own (4 bit); keys and values of
    different widths (K4V8) have different orders."""
    q, cache, block_table, seq_lens, kc, vc = affine_setup(case, device)
    expected = decode_attention_reference(q.half().float(), cache, block_table, seq_lens, kc, vc)
    out = decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(num_splits=3, keys_as_rows=keys_as_rows, fast=fast))
    assert rel_err(out, expected) <= TOL


def test_splits_scale_and_bf16(device):
    """The split count changes only the summation order; a custom scale and bf16 queries work."""
    case = MSE_CASES[1]
    q, cache, block_table, seq_lens, kc, vc = mse_setup(case, device, seed=5)
    outs = [decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(num_splits=s, block_n=32)).float()
            for s in (1, 2, 7)]
    assert rel_err(outs[1], outs[0]) < 2e-3 and rel_err(outs[2], outs[0]) < 2e-3
    expected = decode_attention_reference(q.half().float(), cache, block_table, seq_lens, kc, vc, scale=0.3)
    out = decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, scale=0.3)
    assert rel_err(out, expected) <= TOL
    expected = decode_attention_reference(q.bfloat16().float(), cache, block_table, seq_lens, kc, vc)
    out = decode_attention(q.bfloat16(), cache, block_table, seq_lens, kc, vc)
    assert out.dtype == torch.bfloat16 and rel_err(out, expected) <= 2 * TOL


@pytest.mark.skipif(not COMPILED, reason="the default split count and launch sizes of the GPU")
def test_longer_context_default_launch(device):
    case = ([3000, 1500, 4097], 32, 8, 128, 4, 4, 16, "haar")
    q, cache, block_table, seq_lens, kc, vc = mse_setup(case, device)
    expected = decode_attention_reference(q.half().float(), cache, block_table, seq_lens, kc, vc)
    assert rel_err(decode_attention(q.half(), cache, block_table, seq_lens, kc, vc), expected) <= TOL


# the loop of kvlab.attention.gluon (MSE keys and values of 2, 3 or 4 bits): batch lengths, q heads, kv heads, dim,
# key bits, value bits, block size, rotation
MMA_CASES = [
    ([1], 4, 4, 64, 4, 4, 16, "haar"),  # one cached token, GQA ratio 1
    ([37, 100, 1], 8, 2, 128, 4, 4, 16, "haar"),  # mixed lengths, not multiples of the block size, ratio 4
    ([45, 130], 16, 2, 64, 4, 4, 8, "hadamard"),  # ratio 8, blocks shorter than a step: a block-table entry per key
    ([300, 77], 32, 2, 128, 4, 4, 32, "haar"),  # ratio 16, two steps a block
    ([517], 8, 1, 128, 4, 4, 16, "hadamard"),  # one KV head, a long split
    ([37, 100, 1], 8, 2, 128, 2, 2, 16, "haar"),  # 2-bit keys and values
    ([300, 77], 32, 2, 128, 4, 2, 32, "hadamard"),
    ([45, 130], 16, 2, 64, 2, 4, 8, "haar"),
    ([37, 100, 1], 8, 2, 128, 3, 3, 16, "haar"),  # 3-bit keys and values (dim 128)
    ([300, 77], 32, 2, 128, 4, 3, 32, "hadamard"),
    ([45, 130], 16, 2, 128, 3, 4, 8, "haar"),
    ([517], 8, 1, 128, 3, 2, 16, "hadamard"),
    ([63, 64, 65], 8, 2, 128, 2, 3, 16, "haar"),
]
MMA_IDS = [f"L{'-'.join(map(str, c[0]))}-hq{c[1]}-hkv{c[2]}-d{c[3]}-k{c[4]}v{c[5]}-bs{c[6]}-{c[7]}" for c in MMA_CASES]


@pytest.mark.skipif(not COMPILED, reason="Gluon kernels run on a GPU only (Triton's interpreter cannot run them)")
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("case", MMA_CASES, ids=MMA_IDS)
def test_mma_decode_matches_reference(case, num_splits, device):
    q, cache, block_table, seq_lens, kc, vc = mse_setup(case, device)
    for dtype in (torch.float16, torch.bfloat16):
        expected = decode_attention_reference(q.to(dtype).float(), cache, block_table, seq_lens, kc, vc, scale=0.2)
        out = decode_attention(q.to(dtype), cache, block_table, seq_lens, kc, vc, scale=0.2, launch=DecodeLaunch(num_splits=num_splits, mma=True))
        assert out.dtype == dtype and out.shape == q.shape
        assert rel_err(out, expected) <= TOL, (dtype, rel_err(out, expected))


def test_mma_loop_choice(device, monkeypatch):
    """mma=None takes the loop of kvlab.attention.gluon exactly where it applies and no split-loop argument is
    given; mma=True says why it cannot run; mma=False never takes it."""
    q, cache, block_table, seq_lens, kc, vc = mse_setup(([40, 7], 8, 2, 64, 4, 4, 16, "haar"), device)
    calls = []
    original = kvlab.attention.api._decode_mma
    monkeypatch.setattr(kvlab.attention.api, "_decode_mma", lambda *a: calls.append(1) or original(*a))
    expected = decode_attention_reference(q.half().float(), cache, block_table, seq_lens, kc, vc)
    assert rel_err(decode_attention(q.half(), cache, block_table, seq_lens, kc, vc), expected) <= TOL
    assert len(calls) == (1 if COMPILED else 0)
    assert rel_err(decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(block_n=32)), expected) <= TOL
    assert rel_err(decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(mma=False)), expected) <= TOL
    assert len(calls) == (1 if COMPILED else 0)
    with pytest.raises(TypeError, match="mma must be a bool or None"):
        decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(mma=1))
    with pytest.raises(TypeError, match="fast must be a bool or None"):
        decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(mma=False, fast=1))
    if not COMPILED:
        with pytest.raises(ValueError, match="mma=True needs a CUDA GPU"):
            decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(mma=True))
        return
    with pytest.raises(ValueError, match="mma=True takes none of the split loop's launch arguments, got block_n"):
        decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(mma=True, block_n=32))
    q3, cache3, block_table3, seq_lens3, kc3, vc3 = mse_setup(MSE_CASES[5], device)  # 3-bit keys at dim 64
    with pytest.raises(ValueError, match="mma=True needs a head dim of 128 for 3-bit keys, got 64"):
        decode_attention(q3.half(), cache3, block_table3, seq_lens3, kc3, vc3, launch=DecodeLaunch(mma=True))
    qc, cachec, block_tablec, seq_lensc, kcc, vcc = affine_setup(AFFINE_CASES[0], device)
    with pytest.raises(ValueError, match="mma=True needs MSE key and value codecs of 2, 3 or 4 bits"):
        decode_attention(qc.half(), cachec, block_tablec, seq_lensc, kcc, vcc, launch=DecodeLaunch(mma=True))
    q2, cache2, block_table2, seq_lens2, kc2, vc2 = mse_setup(([40, 7], 8, 2, 64, 4, 2, 16, "haar"), device)
    with pytest.raises(ValueError, match="mma=True needs a head dim of at least 128 for 2-bit values, got 64"):
        decode_attention(q2.half(), cache2, block_table2, seq_lens2, kc2, vc2, launch=DecodeLaunch(mma=True))
    decode_attention(q2.half(), cache2, block_table2, seq_lens2, kc2, vc2)  # 2-bit values at dim 64: the split loop
    assert len(calls) == 1
    q2, cache2, block_table2, seq_lens2, kc2, vc2 = mse_setup(([40, 7], 8, 2, 128, 2, 2, 16, "haar"), device)
    expected = decode_attention_reference(q2.half().float(), cache2, block_table2, seq_lens2, kc2, vc2)
    assert rel_err(decode_attention(q2.half(), cache2, block_table2, seq_lens2, kc2, vc2), expected) <= TOL
    assert len(calls) == 2  # K2V2 at dim 128: the mma loop
    decode_attention(q3.half(), cache3, block_table3, seq_lens3, kc3, vc3)  # 3-bit keys at dim 64: the split loop
    assert len(calls) == 2
    q3, cache3, block_table3, seq_lens3, kc3, vc3 = mse_setup(MSE_CASES[1], device)  # K3V2 at dim 128: the mma loop
    expected = decode_attention_reference(q3.half().float(), cache3, block_table3, seq_lens3, kc3, vc3)
    assert rel_err(decode_attention(q3.half(), cache3, block_table3, seq_lens3, kc3, vc3), expected) <= TOL
    assert len(calls) == 3
    q8 = torch.randn(2, 64, 64, device=device, dtype=torch.float16)  # 32 query heads per KV head
    with pytest.raises(ValueError, match="mma=True needs at most 16 query heads per KV head, got 32"):
        decode_attention(q8, cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(mma=True))


def test_mma_lookups_give_operand_pairs():
    """The lookups of kvlab.attention.gluon (run by the PTX emulator): two key words give, per coordinate pair r,
    (key a, r) then (key b, r); four value words give, per coordinate, the pair of keys (k0, k1) then (k2, k3)."""
    import numpy as np
    import ptx

    from kvlab.attention import gluon
    from kvlab._kernels import mma_tile
    from kvlab._kernels.tables import prmt_tables as _prmt_tables

    g = np.random.default_rng(0)
    words = g.integers(0, 2**32, size=(4, 64), dtype=np.uint64).astype(np.uint32)
    pair = lambda lo, hi: c16[lo] | (c16[hi] << 16)  # noqa: E731
    # 4 and 3 bit (a 3-bit group is the low 24 bits of a word, the bits above are ignored): the same order
    for bits, two_keys, four_values in ((4, mma_tile.LOOKUP4_TWO_KEYS, gluon.LOOKUP4_FOUR_VALUES),
                                        (3, mma_tile.LOOKUP3_TWO_KEYS, gluon.LOOKUP3_FOUR_VALUES)):
        kc = mse_codecs(128, bits, bits, "haar")[0]
        tables = [np.array([t], dtype=np.int64).astype(np.uint32) for t in _prmt_tables(kc)]
        c16 = kc.codebook.to(torch.float16).view(torch.int16).numpy().astype(np.uint32) & 0xFFFF
        mask = (1 << bits) - 1
        idx = [(words[i][None, :] >> (bits * np.arange(8)[:, None]).astype(np.uint32)) & mask for i in range(4)]  # [8, 64]
        outs = ptx.run(two_keys.value, "=r," * 8 + "r," * 5 + "r", [words[0], words[1], *tables])
        for r in range(4):
            assert np.array_equal(outs[2 * r], pair(idx[0][2 * r], idx[0][2 * r + 1]))
            assert np.array_equal(outs[2 * r + 1], pair(idx[1][2 * r], idx[1][2 * r + 1]))
        outs = ptx.run(four_values.value, "=r," * 16 + "r," * 7 + "r", [*words, *tables])
        for coord in range(8):
            for p in range(2):
                assert np.array_equal(outs[4 * (coord // 2) + 2 * p + coord % 2], pair(idx[2 * p][coord], idx[2 * p + 1][coord]))
    # 2 bit: a word holds 16 indices; lookup pair p of a word holds its coordinates p % 4 + 8 (p // 4) and 4 more
    kc2 = mse_codecs(128, 2, 2, "haar")[0]
    tables2 = [np.array([t], dtype=np.int64).astype(np.uint32) for t in _prmt_tables(kc2)[:2]]
    c16 = kc2.codebook.to(torch.float16).view(torch.int16).numpy().astype(np.uint32) & 0xFFFF
    idx = [(words[i][None, :] >> (2 * np.arange(16)[:, None]).astype(np.uint32)) & 3 for i in range(4)]  # [16, 64]
    outs = ptx.run(mma_tile.LOOKUP2_TWO_KEYS.value, "=r," * 16 + "r," * 3 + "r", [words[0], words[1], *tables2])
    for p in range(8):
        c = p % 4 + 8 * (p // 4)
        for x in range(2):
            assert np.array_equal(outs[2 * p + x], pair(idx[x][c], idx[x][c + 4]))
    for half, asm in enumerate((gluon.LOOKUP2_FOUR_VALUES_LO, gluon.LOOKUP2_FOUR_VALUES_HI)):
        outs = ptx.run(asm.value, "=r," * 16 + "r," * 5 + "r", [*words, *tables2])
        for coord in range(8):
            for p in range(2):
                assert np.array_equal(outs[4 * (coord // 2) + 2 * p + coord % 2],
                                      pair(idx[2 * p][8 * half + coord], idx[2 * p + 1][8 * half + coord]))


def test_mma_launch_reuses_the_compiled_kernel(monkeypatch):
    """gluon.launch: the first launch of a kind goes through Triton's JIT (constants and options by
    name), later ones straight to the compiled kernel (runtime arguments, then the constants, in order);
    an integer that needs 64 bits, another constant or another dtype is another kind."""
    from kvlab.attention import gluon

    calls = []

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args: calls.append(("compiled", grid, args))

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append(("jit", grid, args, kw)) or Compiled()

    monkeypatch.setattr(gluon, "decode_mma_kernel", Kernel())
    monkeypatch.setattr(gluon, "_COMPILED", {})
    x = torch.zeros(4, dtype=torch.float16)
    consts, opts = dict(D=64, BG=8), dict(num_warps=1)
    gluon.launch((2, 3), (x, 5), consts, opts)
    gluon.launch((2, 3), (x, 7), consts, opts)
    assert calls[0] == ("jit", (2, 3, 1), (x, 5), dict(D=64, BG=8, num_warps=1))
    assert calls[1] == ("compiled", (2, 3, 1), (x, 7, 64, 8))
    gluon.launch((2, 3), (x, 2**40), consts, opts)  # a 64-bit integer
    gluon.launch((2, 3), (x, 7), dict(D=128, BG=8), opts)
    gluon.launch((2, 3), (x.float(), 7), consts, opts)
    assert [c[0] for c in calls] == ["jit", "compiled", "jit", "jit", "jit"]


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dim", [64, 128])
def test_mma_orders_are_permutations(dim, bits):
    from kvlab.attention import gluon

    for order in (gluon.query_order(dim, bits), gluon.output_order(dim)):
        assert torch.equal(torch.sort(order).values, torch.arange(dim))


def test_rotate_attention_output_is_one_product(device):
    kc, vc = mse_codecs(64, 4, 3, "haar")
    out = torch.randn(3, 5, 64, device=device)
    torch.testing.assert_close(rotate_attention_output(out, vc), out @ vc.rotation.to(device).T)


@pytest.mark.parametrize("rows", [1, 17, 40])
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rotate_rows_matches_torch(rows, dim, dtype, device):
    """The decode path's query and output rotation, ``(x * s) @ w`` in fp32, against torch in fp64."""
    from kvlab.attention.triton import rotate_rows as _rotate_rows

    g = torch.Generator().manual_seed(rows + dim)
    x = torch.randn(rows, dim, generator=g).to(dtype)
    w = torch.randn(dim, dim, generator=g)
    s = torch.rand(3, dim, generator=g) + 0.5
    for scale in (None, s):
        expected = x.double() @ w.double() if scale is None else (x.double() * s.double().repeat(rows, 1)[:rows]) @ w.double()
        out = _rotate_rows(x.to(device), w.to(device), dtype, None if scale is None else scale.to(device))
        assert out.dtype == dtype and out.shape == x.shape
        rtol, atol = {torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 1e-2), torch.float32: (1e-5, 1e-4)}[dtype]
        torch.testing.assert_close(out.cpu().double(), expected, rtol=rtol, atol=atol)  # a rounding of the output


@pytest.mark.parametrize("num_splits", [1, 3, 64, 65, 130, 400])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_merge_matches_log_sum_exp(num_splits, dim, device):
    """The merge of split partial outputs, against the log-sum-exp merge in fp64; splits with no keys
    (running maximum -1e30, sum 0) weigh nothing, and the output lands in the coordinate order given."""
    from kvlab.attention.triton import merge as _merge

    rows = (2, 3)
    g = torch.Generator().manual_seed(num_splits + dim)
    o = torch.randn(*rows, num_splits, dim, generator=g)
    m = torch.randn(*rows, num_splits, generator=g) * 4
    l = torch.rand(*rows, num_splits, generator=g) + 0.1
    if num_splits > 1:
        m[..., -1], l[..., -1], o[..., -1, :] = -1.0e30, 0.0, 0.0  # a split past the sequence's end
    order = torch.randperm(dim, generator=g).to(torch.int32)
    out = torch.full((*rows, dim), float("nan"), device=device)
    _merge(o.to(device), torch.stack([m, l], -1).to(device).contiguous(), order.to(device), out)
    w = torch.exp2(m.double() - m.double().amax(-1, keepdim=True))
    merged = (w[..., None] * o.double()).sum(-2) / (w * l.double()).sum(-1, keepdim=True)
    expected = torch.empty_like(merged)
    expected[..., order.long()] = merged
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-6)


@triton.jit
def _read_words_kernel(cache_ptr, o_base_ptr, out_ptr, BN: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                       ALIGN4: tl.constexpr, W: tl.constexpr):
    o_n = tl.arange(0, BN)
    o_base = tl.load(o_base_ptr + o_n)
    m_n = o_n < BN - 1  # the last row is masked: it reads zeros
    w0, w1, w2 = kvlab._kernels.mse_tile.mse_words(cache_ptr, o_base, m_n, BN, D, BITS, ALIGN4)
    o_w = tl.arange(0, W)
    tl.store(out_ptr + o_n[:, None] * 3 * W + o_w[None, :], w0)
    if BITS == 3:
        tl.store(out_ptr + o_n[:, None] * 3 * W + W + o_w[None, :], w1)
        tl.store(out_ptr + o_n[:, None] * 3 * W + 2 * W + o_w[None, :], w2)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("align4", [True, False])
def test_fast_path_reads_the_code_words(bits, align4, device):
    """The code words the prmt lookup takes (``_mse_words``): little-endian 32-bit words of the packed
    indices of each row, from 4-byte or (values) 2-byte aligned starts; a masked row reads zeros. (The
    lookup itself is inline PTX, which the decode tests run compiled on a GPU, or through tests/ptx.py.)"""
    bn, dim = 8, 128
    nbytes = dim * bits // 8
    g = torch.Generator().manual_seed(bits)
    cache = torch.randint(0, 256, (bn * 200 + nbytes + 8,), dtype=torch.uint8, generator=g)
    o_base = torch.randperm(bn * 200 // 4, generator=g)[:bn] * 4 + (0 if align4 else 2)
    words = torch.stack([cache[o:o + nbytes] for o in o_base.tolist()]).view(torch.int32)  # [bn, nbytes / 4]
    words[-1] = 0
    w = dim // 32 if bits == 3 else nbytes // 4
    out = torch.full((bn, 3 * w), -1, dtype=torch.int32)
    cache, o_base_d, out = cache.to(device), o_base.to(device), out.to(device)
    _read_words_kernel[(1,)](cache, o_base_d, out, BN=bn, D=dim, BITS=bits, ALIGN4=align4, W=w)
    out = out.cpu()
    if bits == 3:  # three tensors: words 3 t, 3 t + 1, 3 t + 2 of group t
        expected = torch.cat([words[:, i::3] for i in range(3)], dim=1)
        assert torch.equal(out, expected)
    else:
        assert torch.equal(out[:, :w], words)


def test_tile_order_is_a_permutation():
    for bits in (2, 3, 4):
        for dim in (64, 128, 256):
            assert torch.equal(tile_order(bits, dim).sort().values, torch.arange(dim))
    assert not torch.equal(tile_order(2, 64), torch.arange(64))


@pytest.mark.parametrize("kind", ["mse", "affine", "centered"])
def test_prefill_matches_reference(kind, device):
    offset = 0
    if kind == "centered":  # keys around a RoPE-turned mean, tokens after 5 kept elsewhere
        q, cache, block_table, seq_lens, kc, vc, offset = centered_setup(CENTERED_CASES[1], device)
    else:
        setup = mse_setup if kind == "mse" else affine_setup
        q, cache, block_table, seq_lens, kc, vc = setup(MSE_CASES[1] if kind == "mse" else AFFINE_CASES[0], device)
    q_len = int(seq_lens.min())
    hq, dim = q.shape[1:]
    q = torch.randn(q.shape[0], q_len, hq, dim, generator=torch.Generator().manual_seed(9)).to(device).half()
    expected = prefill_attention_reference(q.float(), cache, block_table, seq_lens, kc, vc, position_offset=offset)
    out = prefill_attention(q, cache, block_table, seq_lens, kc, vc, position_offset=offset)
    assert out.shape == q.shape and rel_err(out, expected) <= TOL


def test_store_affine_slots_matches_reference(device):
    kc, vc = kvlab.AffineCodec(4, 32), kvlab.AffineCodec(8, 32)
    layout = AffineSlot(128, 4, 8, 32)
    g = torch.Generator().manual_seed(2)
    key, value = torch.randn(19, 2, 128, generator=g), torch.randn(19, 2, 128, generator=g)
    slots = torch.randperm(48, generator=g)[:19]
    slots[3] = -1
    expected = torch.zeros(3, 16, 2, layout.slot_bytes, dtype=torch.uint8)
    store_affine_reference(expected, slots, key, value, kc, vc)
    cache = torch.zeros_like(expected).to(device)
    store_affine(key.to(device), value.to(device), slots.to(device), cache, kc, vc)
    assert torch.equal(cache.cpu(), expected)


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def good(device):
    return mse_setup(([20, 5], 4, 2, 64, 4, 4, 8, "haar"), device)


def test_bad_inputs(good, device, monkeypatch):
    q, cache, block_table, seq_lens, kc, vc = good
    q = q.half()

    def call(**kw):
        args = dict(q=q, cache=cache, block_table=block_table, seq_lens=seq_lens, key_codec=kc, value_codec=vc)
        args.update(kw)
        knobs = {k: args.pop(k) for k in list(args) if k in DecodeLaunch.__dataclass_fields__}
        return decode_attention(**args, launch=DecodeLaunch(**knobs))

    with pytest.raises(TypeError, match="q must have dtype"):
        call(q=q.float())
    with pytest.raises(ValueError, match=r"q must have shape \[batch, num_q_heads, dim\]"):
        call(q=q[0])
    with pytest.raises(ValueError, match="head dim"):
        call(q=torch.zeros(2, 4, 96, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="key_codec.dim"):
        call(key_codec=kvlab.MSECodec(128, 4))
    with pytest.raises(ValueError, match="multiple of the cache's num_kv_heads"):
        call(q=q[:, :3].contiguous())
    with pytest.raises(TypeError, match="block_table must have dtype"):
        call(block_table=block_table.long())
    with pytest.raises(ValueError, match="block_table must have shape"):
        call(block_table=block_table[:1])
    bad = block_table.clone()
    bad[1, 0] = cache.shape[0]
    with pytest.raises(ValueError, match="block_table entries of used blocks"):
        call(block_table=bad)
    bad[1, 0] = -1
    with pytest.raises(ValueError, match="block_table entries of used blocks"):
        call(block_table=bad)
    with pytest.raises(ValueError, match="seq_lens must be <= max_blocks"):
        call(seq_lens=seq_lens + 100)
    with pytest.raises(ValueError, match="seq_lens must be >= 1"):
        call(seq_lens=seq_lens * 0)
    with pytest.raises(ValueError, match="seq_lens must have shape"):
        call(seq_lens=seq_lens[:1])
    with pytest.raises(TypeError, match="seq_lens must have dtype"):
        call(seq_lens=seq_lens.float())
    with pytest.raises(ValueError, match="cache must have shape"):
        call(cache=cache[..., :-4])
    with pytest.raises(ValueError, match="4-byte aligned"):
        call(cache=torch.zeros(cache.numel() + 2, dtype=torch.uint8, device=device)[2:].view(cache.shape))
    with pytest.raises(ValueError, match="seq_lens is on the meta device, which holds shapes but no data"):
        call(seq_lens=torch.zeros(2, dtype=torch.int32, device="meta"))
    with pytest.raises(TypeError, match="same kind of codec"):
        call(value_codec=kvlab.AffineCodec(4, 32))
    with pytest.raises(TypeError, match=r"key_codec must be a kvlab.MSECodec, a centred MSE codec \(keys\) or kvlab.AffineCodec"):
        call(key_codec="mse")
    with pytest.raises(ValueError, match="key_codec.bits"):
        call(key_codec=kvlab.AffineCodec(2, 32), value_codec=kvlab.AffineCodec(2, 32))
    with pytest.raises(ValueError, match="scale must be a positive finite float"):
        call(scale=float("nan"))
    with pytest.raises(ValueError, match="scale must be a positive finite float"):
        call(scale=-1.0)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        call(num_splits=0)
    with pytest.raises(ValueError, match="block_n must be one of"):
        call(block_n=48)
    with pytest.raises(ValueError, match="max_registers must be >= 32"):
        call(max_registers=16)
    with pytest.raises(ValueError, match="max_registers must be at most 255"):
        call(max_registers=256)
    with pytest.raises(TypeError, match="max_registers"):
        call(max_registers=128.0)
    if not COMPILED:  # an interpreter that cannot run inline PTX (no emulator installed)
        from triton.runtime import interpreter

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", lambda *a, **k: None)
        with pytest.raises(ValueError, match="fast=True needs a CUDA device"):
            call(fast=True)


def test_bad_prefill_inputs(good):
    q, cache, block_table, seq_lens, kc, vc = good
    q4 = q.half()[:, None]
    with pytest.raises(ValueError, match=r"q must have shape \[batch, q_len, num_q_heads, dim\]"):
        prefill_attention(q.half(), cache, block_table, seq_lens, kc, vc)
    with pytest.raises(ValueError, match="seq_lens must be >= q_len"):
        prefill_attention(q4.expand(-1, 6, -1, -1).contiguous(), cache, block_table, seq_lens, kc, vc)
    with pytest.raises(TypeError, match="check must be a bool"):
        prefill_attention(q4, cache, block_table, seq_lens, kc, vc, check="yes")
    with pytest.raises(TypeError, match="position_offset must be an int"):
        prefill_attention(q4, cache, block_table, seq_lens, kc, vc, position_offset="a")
    empty = prefill_attention(q4[:0], cache, block_table[:0], seq_lens[:0], kc, vc)
    assert empty.shape == (0, *q4.shape[1:])


def test_strided_lengths_are_refused_and_numpy_scales_taken(good):
    """The kernels read seq_lens with stride 1: a strided view is refused, not read as another length."""
    import numpy as np

    q, cache, block_table, seq_lens, kc, vc = good
    q = q.half()
    every_other = torch.stack([seq_lens, seq_lens * 0], 1).reshape(-1)[::2]  # the same values, stride 2
    with pytest.raises(ValueError, match=r"seq_lens must be contiguous \(stride 1\), got stride 2"):
        decode_attention(q, cache, block_table, every_other, kc, vc)
    with pytest.raises(ValueError, match="seq_lens must be contiguous"):
        prefill_attention(q[:, None], cache, block_table, every_other, kc, vc)
    out = decode_attention(q, cache, block_table, every_other.contiguous(), kc, vc, scale=np.float32(0.125))
    assert torch.equal(out, decode_attention(q, cache, block_table, seq_lens, kc, vc, scale=0.125))
    with pytest.raises(TypeError, match="scale must be a positive finite float, got str"):
        decode_attention(q, cache, block_table, seq_lens, kc, vc, scale="0.1")
    with pytest.raises(TypeError, match="position_offset must be an int"):
        decode_attention(q, cache, block_table, seq_lens, kc, vc, position_offset=None)


def test_bad_centered_inputs(device):
    q, cache, block_table, seq_lens, kc, vc, offset = centered_setup(CENTERED_CASES[1], device)
    with pytest.raises(ValueError, match="position_offset must be >= 0"):
        decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, position_offset=-1)
    with pytest.raises(TypeError, match="position_offset must be an int"):
        decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, position_offset=1.5)
    from kvlab.centered import CenteredMSECodec

    three = CenteredMSECodec(kc.dim, kc.bits, torch.zeros(3, kc.dim), torch.ones(3, kc.dim), rope=kc.rope)
    with pytest.raises(ValueError, match=r"key_codec.num_heads \(3\) must equal the cache's num_kv_heads \(2\)"):
        decode_attention(q.half(), cache, block_table, seq_lens, three, vc)
    with pytest.raises(TypeError, match="value_codec must be a kvlab.MSECodec"):
        decode_attention(q.half(), cache, block_table, seq_lens, kc, kc)


@pytest.mark.parametrize("entry", sorted(kvlab.attention.api.LAUNCH_DEFAULTS), ids=lambda e: f"{e[0]}{e[1]}")
def test_launch_defaults(entry, device):
    """A call of the split loop that sets no launch argument runs its cache's LAUNCH_DEFAULTS entry (the same
    output, bit for bit, as passing that entry), and it matches the reference. (``mma=False``: with no
    argument at all, MSE caches on a GPU take the loop of kvlab.attention.gluon instead.)"""
    kind, bits = entry
    lens, offset = [150, 7], 0
    if kind == "affine":
        q, cache, block_table, seq_lens, kc, vc = affine_setup((lens, 8, 2, 128, bits, bits, 16, 32), device)
    elif kind == "centered":
        q, cache, block_table, seq_lens, kc, vc, offset = centered_setup((lens, 8, 2, 128, bits, bits, 16, "haar", True, 5), device)
    else:
        q, cache, block_table, seq_lens, kc, vc = mse_setup((lens, 8, 2, 128, bits, bits, 16, "hadamard"), device)
    launch = kvlab.attention.api.launch_defaults(kind, bits)
    assert launch == kvlab.attention.api.LAUNCH_DEFAULTS[entry]
    if not COMPILED:
        launch["fast"] = False  # inline PTX: the interpreter's default
    out = decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, position_offset=offset, launch=DecodeLaunch(num_splits=2, mma=False))
    assert torch.equal(out, decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, position_offset=offset, launch=DecodeLaunch(num_splits=2, **launch)))
    expected = decode_attention_reference(q.half().float(), cache, block_table, seq_lens, kc, vc, position_offset=offset)
    assert rel_err(out, expected) <= TOL
    if kind == "centered":  # centred 2- and 3-bit keys have no entry of their own: the MSE one
        assert kvlab.attention.api.launch_defaults("centered", 2) == kvlab.attention.api.LAUNCH_DEFAULTS["mse", 2]
    with pytest.raises(ValueError, match=f"no launch defaults for a '{kind}' cache of 5 bits"):
        kvlab.attention.api.launch_defaults(kind, 5)


def test_bad_loop_options(device):
    q, cache, block_table, seq_lens, kc, vc = mse_setup(MSE_CASES[0], device)
    with pytest.raises(TypeError, match="prefetch must be a bool"):
        decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(prefetch=1))
    with pytest.raises(TypeError, match="keys_as_rows must be a bool"):
        decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(keys_as_rows="yes"))
    q, cache, block_table, seq_lens, kc, vc = affine_setup(AFFINE_CASES[1], device)
    with pytest.raises(ValueError, match="prefetch=True applies to MSE caches"):
        decode_attention(q.half(), cache, block_table, seq_lens, kc, vc, launch=DecodeLaunch(prefetch=True))


def test_ptx_emulator():
    """The emulator behind the fast path's CPU tests: byte permutes as PTX defines them (with sign
    replication), fp16-pair arithmetic, and a clear error for an instruction it does not know."""
    import numpy as np
    import ptx

    a, b = np.array([0x03020100], dtype=np.uint32), np.array([0x07060504], dtype=np.uint32)
    (d,) = ptx.run("prmt.b32 $0, $1, $2, 0x5140;", "=r,r,r", [a, b])
    assert d[0] == 0x05010400
    (d,) = ptx.run("prmt.b32 $0, $1, $2, 0x0008;", "=r,r,r", [np.array([0x80], dtype=np.uint32), b])
    assert d[0] == 0x808080FF  # byte 0: the sign of byte 0 (0x80) replicated; bytes 1-3: byte 0 itself
    one_two = np.array([0x40003C00], dtype=np.uint32)  # fp16 pair (1.0, 2.0)
    (d,) = ptx.run("fma.rn.f16x2 $0, $1, $1, $1;", "=r,r", [one_two])
    assert d[0] == 0x46004000  # (1 * 1 + 1, 2 * 2 + 2) = (2.0, 6.0)
    (d,) = ptx.run("{ .reg .b32 m; mov.b32 m, 0x64006400; sub.rn.f16x2 $0, $1, m; }", "=r,r",
                   [np.array([0x640F6403], dtype=np.uint32)])
    assert d[0] == 0x4B804200  # (1027 - 1024, 1039 - 1024) = (3.0, 15.0)
    with pytest.raises(NotImplementedError, match="add.u32"):
        ptx.run("add.u32 $0, $1, $1;", "=r,r", [a])


def test_ncu_summary_reproduces_the_committed_counters(tmp_path):
    """results/decode_attention_ncu.json is what benchmarks/ncu_decode.py makes of the committed ncu output
    (page 10 reads the JSON): one kernel per configuration, the longest of each call."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from benchmarks import ncu_decode

    committed = root / "results" / "decode_attention_ncu.json"
    out = tmp_path / "ncu.json"
    ncu_decode.summarise(str(root / "results" / "decode_attention_ncu.csv.gz"), str(out), str(committed))
    assert json.loads(out.read_text()) == json.loads(committed.read_text())
    kernels = json.loads(out.read_text())["kernels"]
    assert list(kernels) == [c[0] for c in ncu_decode.CONFIGS]
    loops = {name: "decode_mma_kernel" if "defaults" in name and name.startswith("mse") else "_decode_split_kernel"
             for name in kernels if name != "sdpa_fp16"}  # MSE caches take the mma loop by default
    assert all(kernels[name]["kernel"] == loop for name, loop in loops.items())
