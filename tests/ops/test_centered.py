"""The centred MSE key codec: reference (kvlab.centered.reference), Triton path (kvlab.centered.api), calibration,
and the KVCache option.

``store_centered_mse`` must write exactly the reference's cache bytes (the whole cache is compared, so
skipped slots are checked too); ``load_centered_mse`` must match ``CenteredMSECodec.decode`` to 1e-6
relative (the MSE load kernel applies the norm correction as one scale per row).
"""

import inspect

import pytest
import torch

import kvlab
from kvlab import CodecLaunch, KVCache, KVFormat
from kvlab._kernels.tables import interpreted
from kvlab.calibration import ChannelStats, RoPE, calibrate_keys, key_moments
from kvlab.centered import load_centered_mse, store_centered_mse
from kvlab.centered import CenteredMSECodec

SENTINEL = 0xAB
STORE_ROWS = 512 if interpreted() else None  # the interpreter: large tiles; compiled: the default tiling
LOAD_ROWS = 256 if interpreted() else 64

# tokens, heads, dim, key_bits, value_bits, rotation, input dtype, block_size, mean turns with RoPE
CASES = [
    (1, 1, 64, 3, 3, "hadamard", torch.float16, 16, False),
    (37, 3, 64, 3, 2, "haar", torch.float32, 16, True),
    (301, 3, 64, 2, 2, "hadamard", torch.bfloat16, 16, True),
    (61, 2, 128, 4, 3, "hadamard", torch.float32, 8, False),
    (37, 3, 96, 3, 4, "haar", torch.float16, 5, False),
    (23, 2, 76, 2, 3, "haar", torch.float32, 7, True),  # dim not a multiple of 8: the last byte is partly padding
    (45, 2, 75, 3, 3, "haar", torch.float32, 16, False),  # odd dim
]
IDS = [f"t{c[0]}-h{c[1]}-d{c[2]}-k{c[3]}v{c[4]}-{c[5]}-{str(c[6])[6:]}{'-rope' if c[8] else ''}" for c in CASES]


def rope_of(dim):
    return RoPE(1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def rel_err(a, b):
    err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
    if err > 1e-6:
        print(f"rel_err {err:.3e}, max abs diff {(a.double() - b.double()).abs().max().item():.3e}")
    return err


def keys_with_offsets(tokens, heads, dim, seed=0):
    """Keys like a real model's: a large per-channel mean, a few channels with a large spread."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(heads, dim, generator=g) * 3
    spread = torch.exp(torch.randn(heads, dim, generator=g))
    keys = mean + spread * torch.randn(tokens, heads, dim, generator=g)
    return keys, mean, spread


def make_codecs(heads, dim, kb, vb, rotation, rope=False, seed=0):
    _, mean, spread = keys_with_offsets(8, heads, dim, seed)
    key_codec = CenteredMSECodec(dim, kb, mean * 0.9, spread * 1.1, rotation=rotation, seed=1,  # calibration is never exact
                                 rope=rope_of(dim) if rope else None)
    return key_codec, kvlab.MSECodec(dim, vb, rotation=rotation, seed=2)


def make_batch(case, device, seed=0):
    """Inputs, a sentinel-filled cache, slots (some -1), positions, the reference cache, the codecs."""
    tokens, heads, dim, kb, vb, rotation, dtype, block_size, rope = case
    key_codec, value_codec = make_codecs(heads, dim, kb, vb, rotation, rope)
    key = keys_with_offsets(tokens, heads, dim, seed)[0].to(dtype)
    value = torch.randn(tokens, heads, dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    positions = torch.randperm(4 * tokens, generator=torch.Generator().manual_seed(seed))[:tokens] if rope else None
    if rope:
        key = (key.double() + rope_of(dim).apply(key_codec.mean.double(), positions[:, None]) - key_codec.mean).to(dtype)
    mean = key_codec.mean_rows(positions, (tokens,))
    key[tokens // 2] = (mean[tokens // 2] if rope else mean).to(dtype)  # centred key close to zero
    layout = kvlab.MSESlot(dim, kb, vb)
    num_blocks = (tokens + 2 * block_size) // block_size + 1
    cache = torch.full((num_blocks, block_size, heads, layout.slot_bytes), SENTINEL, dtype=torch.uint8)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(seed))[:tokens]
    slots[::5] = -1  # padding tokens: not written
    ref = cache.clone()
    kvlab.mse.reference.store_slots(ref, slots, key_codec.encode(key, positions), value_codec.encode(value), layout)
    return key.to(device), value.to(device), slots.to(device), positions, cache.to(device), ref, key_codec, value_codec


# ----------------------------------------------------------------------------- reference


def test_reference_is_the_mse_codec_of_the_normalised_keys():
    key, mean, spread = keys_with_offsets(50, 3, 64)
    codec = CenteredMSECodec(64, 3, mean, spread)
    z = (key - mean) * (1.0 / spread)
    assert torch.equal(codec.encode(key), codec.mse.encode(z))
    centered = codec.mse.decode(codec.mse.encode(z)) * spread
    assert torch.equal(codec.decode(codec.encode(key)), centered + mean)
    assert torch.equal(codec.decode(codec.encode(key), "centered"), centered)
    assert torch.equal(codec.decode(codec.encode(key), "rotated"), codec.mse.decode(codec.mse.encode(z), "rotated"))


def test_centering_removes_most_of_the_error_on_keys_with_a_mean():
    """Keys whose mean holds a third of their energy: centring alone (scale 1) removes about that share of the error."""
    key, mean, spread = keys_with_offsets(400, 3, 64)
    mean_share = (key.mean(0).square().sum() / key.square().mean(0).sum()).item()
    assert 0.25 < mean_share < 0.7
    plain = kvlab.MSECodec(64, 3)
    centered = CenteredMSECodec(64, 3, key.mean(0), torch.ones(3, 64))
    err_plain = (plain.decode(plain.encode(key)) - key).square().sum()
    err_centered = (centered.decode(centered.encode(key)) - key).square().sum()
    assert err_centered < (1 - mean_share + 0.1) * err_plain


def test_attention_scores_change_by_a_constant_without_the_mean():
    """q . k_hat and q . (k_hat - mean) differ by q . mean for every token: the softmax is the same."""
    torch.manual_seed(0)
    key, mean, spread = keys_with_offsets(40, 2, 64)
    codec = CenteredMSECodec(64, 2, mean, spread)
    codes = codec.encode(key)
    q = torch.randn(2, 64)
    full = torch.einsum("thd,hd->ht", codec.decode(codes), q)
    centered = torch.einsum("thd,hd->ht", codec.decode(codes, "centered"), q)
    # fp32 sums of 64 products: rounding relative to the largest score
    atol = 1e-5 * full.abs().max().item()
    torch.testing.assert_close(full - centered, (q * codec.mean).sum(-1, keepdim=True).expand_as(full), rtol=1e-4, atol=atol)
    # two scores of a row, each off by at most atol, change their probabilities' ratio by exp(2 atol) at most
    torch.testing.assert_close(full.softmax(-1), centered.softmax(-1), rtol=2 * atol, atol=1e-7)


# ----------------------------------------------------------------------------- Triton path


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_store_matches_reference_bytes(case, device):
    key, value, slots, positions, cache, ref, key_codec, value_codec = make_batch(case, device)
    store_centered_mse(key, value, slots, cache, key_codec, value_codec, positions=positions, launch=CodecLaunch(block_rows=STORE_ROWS))
    assert torch.equal(cache.cpu(), ref)


@pytest.mark.parametrize("block_rows, num_warps", [(None, 4), (1, 1), (32, 2)])
def test_store_tiles_and_unchecked_launch(block_rows, num_warps, device):
    """Other tiles, and check=False (no host sync), write the same bytes. One row a program runs 7 odd tokens
    (the interpreter runs programs one by one)."""
    case = CASES[3] if block_rows != 1 else (7, *CASES[3][1:])
    key, value, slots, positions, cache, ref, key_codec, value_codec = make_batch(case, device, seed=5)
    store_centered_mse(key, value, slots, cache, key_codec, value_codec, positions=positions,
                       launch=CodecLaunch(block_rows=block_rows, num_warps=num_warps), check=block_rows != 32)
    assert torch.equal(cache.cpu(), ref)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's fp16 cast
@pytest.mark.parametrize("part", ["key", "value"])
@pytest.mark.parametrize("bad", ["nan", "overflow"])
def test_store_flags_bad_values(part, bad, device):
    key, value, slots, positions, cache, ref, key_codec, value_codec = make_batch(CASES[1], device)  # fp32 inputs, Haar
    x = (key if part == "key" else value).clone()
    x[0, 0, 3] = float("nan") if bad == "nan" else 1e7
    args = (x, value) if part == "key" else (key, x)
    with pytest.raises(ValueError, match=f"{part} " + ("holds NaN" if bad == "nan" else "has")):
        store_centered_mse(*args, slots.clone().fill_(0), cache, key_codec, value_codec, positions=positions)


@pytest.mark.parametrize("space", ["model", "centered", "rotated"])
@pytest.mark.parametrize("case", CASES[1:4], ids=IDS[1:4])
def test_load_matches_reference(case, space, device):
    key, value, slots, positions, cache, ref, key_codec, value_codec = make_batch(case, device, seed=3)
    layout = kvlab.MSESlot(case[2], case[3], case[4])
    out = load_centered_mse(ref.to(device), slots, key_codec, space=space, out_dtype=torch.float32, launch=CodecLaunch(block_rows=LOAD_ROWS),
                            positions=positions)
    codes, _ = kvlab.mse.reference.load_slots(ref, slots.cpu(), layout)
    expect = key_codec.decode(codes, space, positions)
    keep = slots.cpu() >= 0
    assert out.shape == expect.shape and out.dtype == torch.float32
    assert rel_err(out.cpu()[keep], expect[keep]) < 1e-6
    assert bool(torch.isfinite(out).all())


def test_load_casts_to_out_dtype(device):
    key, value, slots, positions, cache, ref, key_codec, value_codec = make_batch(CASES[1], device)
    out = load_centered_mse(ref.to(device), slots, key_codec, out_dtype=torch.float16, launch=CodecLaunch(block_rows=LOAD_ROWS), positions=positions)
    full = load_centered_mse(ref.to(device), slots, key_codec, out_dtype=torch.float32, launch=CodecLaunch(block_rows=LOAD_ROWS), positions=positions)
    assert out.dtype == torch.float16 and torch.equal(out, full.half())


# ----------------------------------------------------------------------------- calibration


class _TinyLlama:
    """A 2-layer random Llama (transformers) for calibration tests."""

    @staticmethod
    def make():
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
        return LlamaForCausalLM(cfg).eval()


def _keys_and_queries(model, ids, window):
    """Keys the cache receives and post-RoPE queries, window by window: [L, H, T, D] and [L, H, group * T, D]."""
    from transformers import DynamicCache

    queries = {i: [] for i in range(model.config.num_hidden_layers)}

    def hook(i, attn):
        def pre(module, args, kwargs):
            h = kwargs["hidden_states"]
            cos, sin = kwargs["position_embeddings"]
            q = attn.q_proj(h).view(*h.shape[:-1], -1, attn.head_dim).transpose(1, 2)
            rot = torch.cat((-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]), -1)
            queries[i].append((q * cos[:, None] + rot * sin[:, None])[0])
        return pre

    hooks = [layer.self_attn.register_forward_pre_hook(hook(i, layer.self_attn), with_kwargs=True)
             for i, layer in enumerate(model.model.layers)]
    keys = []
    # the cache's keyword: ``cache`` since transformers 5.2x, ``past_key_values`` before
    cache_kw = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    try:
        for w in range(ids.numel() // window):
            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                model(ids[None, window * w : window * w + window], use_cache=True, **{cache_kw: cache})
            keys.append(torch.stack([layer.keys[0] for layer in cache.layers]))
    finally:
        for h in hooks:
            h.remove()
    heads = keys[0].shape[1]
    q = torch.stack([torch.cat(queries[i], 1) for i in sorted(queries)])  # [L, Hq, T, D]
    q = q.reshape(q.shape[0], heads, -1, q.shape[-1])  # query heads of a KV head's group together
    return torch.cat(keys, 2).double(), q.double()


def test_calibrate_keys_measures_the_keys_and_queries_attention_sees():
    model = _TinyLlama.make()
    ids = torch.randint(0, 64, (3 * 20 + 7,), generator=torch.Generator().manual_seed(0))
    keys, queries = _keys_and_queries(model, ids, 20)  # three whole windows: [L, H, 60, D]
    q_square = queries.square().mean(2)
    # a constant mean (after RoPE)
    std = calibrate_keys(model, ids, window=20, mean="constant", scale="std", floor=1e-6)
    assert std.shape == (2, 2, 16) and std.tokens == 60 and std.rope is None
    torch.testing.assert_close(std.mean, keys.mean(2).float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(std.scale, keys.std(2, unbiased=False).float(), rtol=1e-4, atol=1e-6)
    query = calibrate_keys(model, ids, window=20, mean="constant", floor=1e-6)  # scale="query"
    expect = (keys.var(2, unbiased=False) / q_square) ** 0.25
    torch.testing.assert_close(query.scale, expect.float(), rtol=1e-4, atol=1e-6)
    plain = calibrate_keys(model, ids, window=20, mean="constant", scale="none")
    assert torch.equal(plain.scale, torch.ones_like(plain.scale)) and torch.equal(plain.mean, std.mean)
    # the mean before RoPE, turned to each position (the default)
    rope = RoPE.from_model(model)
    positions = torch.arange(20).repeat(3)
    before = rope.undo(keys, positions)
    stats = calibrate_keys(model, ids, window=20, floor=1e-6)
    assert stats.rope is not None and torch.equal(stats.rope.inv_freq, rope.inv_freq)
    torch.testing.assert_close(stats.mean, before.mean(2).float(), rtol=1e-5, atol=1e-6)
    centred = keys - rope.apply(before.mean(2)[:, :, None, :], positions)
    torch.testing.assert_close(stats.scale, (centred.square().mean(2) / q_square).sqrt().sqrt().float(), rtol=1e-4, atol=1e-6)
    assert model.config._attn_implementation != "kvlab_calibration"  # restored
    moments = key_moments(model, ids, window=20, mean="constant")
    assert torch.equal(moments.stats("std", 1e-6).scale, std.scale) and torch.equal(moments.stats(floor=1e-6).scale, query.scale)
    pre = key_moments(model, ids, window=20, before_rope=True)  # keys and queries before RoPE
    torch.testing.assert_close(pre.mean.float(), stats.mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pre.query_square, rope.undo(queries, torch.arange(20).repeat(queries.shape[2] // 20)).square().mean(2),
                               rtol=1e-5, atol=1e-8)


def test_rope_matches_the_model_and_inverts():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = _TinyLlama.make()
    rope = RoPE.from_model(model)
    torch.manual_seed(0)
    x = torch.randn(1, 2, 9, 16)
    cos, sin = model.model.rotary_emb(x, torch.arange(9)[None])
    expect, _ = apply_rotary_pos_emb(x, x, cos, sin)
    torch.testing.assert_close(rope.apply(x, torch.arange(9)).float(), expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rope.undo(rope.apply(x, torch.arange(9)), torch.arange(9)).float(), x, rtol=1e-6, atol=1e-6)


def test_calibrate_keys_floors_the_scale():
    model = _TinyLlama.make()
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(1))
    stats = calibrate_keys(model, ids, window=20, floor=0.5)
    assert bool((stats.scale >= 0.5 * stats.scale.mean(-1, keepdim=True) * (1 - 1e-6)).all())


# ----------------------------------------------------------------------------- KVCache option


H, D = 3, 64


def _stats(layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ChannelStats(torch.randn(layers, H, D, generator=g) * 3, torch.exp(torch.randn(layers, H, D, generator=g)), 100)


def _kv(n, seed, stats, layer=0, batch=2):
    g = torch.Generator().manual_seed(seed)
    k = stats.mean[layer][:, None] + stats.scale[layer][:, None] * torch.randn(batch, H, n, D, generator=g)
    return k, torch.randn(batch, H, n, D, generator=g)


def test_cache_stores_centered_codes():
    stats = _stats()
    fmt = KVFormat("centered", 3, 2)
    assert fmt.label == "centered k3v2 haar" and fmt.bits_per_element(D) == (3.25 + 2.25) / 2
    cache = KVCache(fmt, num_layers=2, num_kv_heads=H, head_dim=D, key_stats=stats, prefill="stored", dtype=None)
    k, v = _kv(37, 0, stats, layer=1)
    k_out, v_out = cache.update(k, v, 1)
    layer = cache.layers[1]
    codec = CenteredMSECodec(D, 3, stats.mean[1], stats.scale[1])
    codes, v_codes = kvlab.mse.reference.load_slots(layer.mse.cache, layer.mse._slots(0, 37), kvlab.MSESlot(D, 3, 2))
    k_rows = k.transpose(1, 2).reshape(-1, H, D)
    assert torch.equal(codes, codec.encode(k_rows))
    assert torch.equal(k_out, codec.decode(codes).reshape(2, 37, H, D).transpose(1, 2))
    assert torch.equal(v_codes, kvlab.MSECodec(D, 2).encode(v.transpose(1, 2).reshape(-1, H, D)))
    assert cache.nbytes() == 2 * 37 * H * D * (3.25 + 2.25) / 8
    # centring pays: the plain MSE codec at the same bits loses more on these keys
    plain = KVCache(KVFormat("mse", 3, 2), num_layers=2, num_kv_heads=H, head_dim=D, prefill="stored", dtype=None)
    k_plain, _ = plain.update(k, v, 1)
    assert (k_out - k).square().sum() < 0.5 * (k_plain - k).square().sum()


def test_cache_back_ends_agree(device):
    stats = _stats()
    caches = {b: KVCache(KVFormat("centered", 3, 3, rotation="hadamard"), num_layers=2, num_kv_heads=H, head_dim=D,
                         key_stats=stats, residual=3, backend=b, dtype=None) for b in ("reference", "triton")}
    for i, n in enumerate([19, 1, 12]):
        k, v = _kv(n, i, stats, batch=1)
        outs = {b: c.update(k.to(device), v.to(device), 0) for b, c in caches.items()}
    ref, tri = (caches[b].layers[0] for b in ("reference", "triton"))
    assert ref.backend == "reference" and tri.backend == "triton"
    assert torch.equal(ref.mse.cache.cpu(), tri.mse.cache.cpu())
    for a, b in zip(outs["reference"], outs["triton"]):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-6, atol=1e-5)


# ----------------------------------------------------------------------------- bad input


# the kernels' device: a bad argument must be named for what is wrong with it, not for its device
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on_device(change):
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in change.items()}


def _bad_store(**change):
    key, value, slots, positions, cache, ref, key_codec, value_codec = make_batch(CASES[1], DEVICE)
    args = dict(key=key, value=value, slot_mapping=slots, cache=cache, key_codec=key_codec, value_codec=value_codec,
                positions=positions)
    args.update(_on_device(change))
    store_centered_mse(**args)


def _bad_load(**change):
    key, value, slots, positions, cache, ref, key_codec, value_codec = make_batch(CASES[1], DEVICE)
    args = dict(cache=ref.to(DEVICE), slot_mapping=slots, codec=key_codec, positions=positions)
    args.update(_on_device(change))
    load_centered_mse(**args)


BAD = [
    ("mean shape", lambda: CenteredMSECodec(64, 3, torch.zeros(64), torch.ones(64)), ValueError, "mean"),
    ("scale shape", lambda: CenteredMSECodec(64, 3, torch.zeros(2, 64), torch.ones(3, 64)), ValueError, "scale"),
    ("scale zero", lambda: CenteredMSECodec(64, 3, torch.zeros(2, 64), torch.zeros(2, 64)), ValueError, "scale"),
    ("mean nan", lambda: CenteredMSECodec(64, 3, torch.full((2, 64), float("nan")), torch.ones(2, 64)), ValueError, "mean"),
    ("mean type", lambda: CenteredMSECodec(64, 3, [0.0] * 64, torch.ones(1, 64)), TypeError, "mean"),
    ("bits", lambda: CenteredMSECodec(64, 5, torch.zeros(2, 64), torch.ones(2, 64)), ValueError, "bits"),
    ("encode heads", lambda: CenteredMSECodec(64, 3, torch.zeros(2, 64), torch.ones(2, 64)).encode(torch.zeros(5, 3, 64)), ValueError, "x must have shape"),
    ("encode inf", lambda: CenteredMSECodec(64, 3, torch.zeros(2, 64), torch.ones(2, 64)).encode(torch.full((5, 2, 64), float("inf"))), ValueError, "NaN or Inf"),
    ("decode bytes", lambda: CenteredMSECodec(64, 3, torch.zeros(2, 64), torch.ones(2, 64)).decode(torch.zeros(5, 2, 10, dtype=torch.uint8)), ValueError, "codes must have shape"),
    ("decode space", lambda: CenteredMSECodec(64, 3, torch.zeros(2, 64), torch.ones(2, 64)).decode(torch.zeros(5, 2, 26, dtype=torch.uint8), "query"), ValueError, "space"),
    ("stats shape", lambda: ChannelStats(torch.zeros(2, 64), torch.ones(2, 64), 1), ValueError, "layers, heads, dim"),
    ("stats dtype", lambda: ChannelStats(torch.zeros(1, 2, 64, dtype=torch.float64), torch.ones(1, 2, 64), 1), TypeError, "mean"),
    ("stats scale", lambda: ChannelStats(torch.zeros(1, 2, 64), -torch.ones(1, 2, 64), 1), ValueError, "scale"),
    ("store codec type", lambda: _bad_store(key_codec=kvlab.MSECodec(64, 3)), TypeError, "key_codec"),
    ("store key heads", lambda: _bad_store(key=torch.zeros(37, 2, 64)), ValueError, "key must have shape"),
    ("store key dtype", lambda: _bad_store(key=torch.zeros(37, 3, 64, dtype=torch.int32)), TypeError, "key"),
    ("store slots", lambda: _bad_store(slot_mapping=torch.zeros(5, dtype=torch.int64)), ValueError, "slot_mapping"),
    ("store cache dtype", lambda: _bad_store(cache=torch.zeros(4, 16, 3, 44)), TypeError, "cache"),
    ("load space", lambda: _bad_load(space="query"), ValueError, "space"),
    ("load dtype", lambda: _bad_load(out_dtype=torch.int8), TypeError, "out_dtype"),
    ("load heads", lambda: _bad_load(cache=torch.zeros(4, 16, 2, 44, dtype=torch.uint8)), ValueError, "heads"),
    ("store positions missing", lambda: _bad_store(positions=None), TypeError, "positions"),
    ("store positions shape", lambda: _bad_store(positions=torch.zeros(3, dtype=torch.int64)), ValueError, "positions"),
    ("load positions missing", lambda: _bad_load(positions=None), TypeError, "positions"),
    ("encode positions missing", lambda: make_codecs(2, 64, 3, 3, "haar", rope=True)[0].encode(torch.zeros(5, 2, 64)), TypeError, "positions"),
    ("encode positions shape", lambda: make_codecs(2, 64, 3, 3, "haar", rope=True)[0].encode(torch.zeros(5, 2, 64), torch.zeros(4, dtype=torch.int64)), ValueError, "positions"),
    ("codec tiny scale", lambda: CenteredMSECodec(64, 3, torch.zeros(2, 64), torch.full((2, 64), 1e-39)), ValueError, "1 / scale to be finite"),
    ("codec rope dim", lambda: CenteredMSECodec(64, 3, torch.zeros(2, 64), torch.ones(2, 64), rope=rope_of(32)), ValueError, "rope"),
    ("stats rope dim", lambda: ChannelStats(torch.zeros(1, 2, 64), torch.ones(1, 2, 64), 1, rope_of(32)), ValueError, "rope"),
    ("rope dtype", lambda: RoPE(torch.ones(32)), TypeError, "inv_freq"),
    ("calibrate ids", lambda: calibrate_keys(_TinyLlama.make(), torch.zeros(2, 30, dtype=torch.int64), window=10), ValueError, "1-d"),
    ("calibrate short", lambda: calibrate_keys(_TinyLlama.make(), torch.zeros(5, dtype=torch.int64), window=10), ValueError, "fewer than one window"),
    ("calibrate scale", lambda: calibrate_keys(_TinyLlama.make(), torch.zeros(30, dtype=torch.int64), window=10, scale="rms"), ValueError, "scale"),
    ("calibrate mean", lambda: calibrate_keys(_TinyLlama.make(), torch.zeros(30, dtype=torch.int64), window=10, mean="local"), ValueError, "mean"),
    ("calibrate floor", lambda: calibrate_keys(_TinyLlama.make(), torch.zeros(30, dtype=torch.int64), window=10, floor=0), ValueError, "floor"),
    ("cache without stats", lambda: KVCache(KVFormat("centered", 3), num_layers=2, num_kv_heads=H, head_dim=D), ValueError, "key_stats"),
    ("cache stats type", lambda: KVCache(KVFormat("centered", 3), num_layers=2, num_kv_heads=H, head_dim=D, key_stats=torch.zeros(2, H, D)), TypeError, "key_stats"),
    ("cache stats shape", lambda: KVCache(KVFormat("centered", 3), num_layers=3, num_kv_heads=H, head_dim=D, key_stats=_stats()), ValueError, "key_stats has shape"),
    ("centered bits", lambda: KVFormat("centered", 8), ValueError, "key_bits"),
    ("centered channel axis", lambda: KVFormat("centered", 3, key_axis="channel"), ValueError, "key_axis"),
]


@pytest.mark.parametrize("name, call, error, match", BAD, ids=[c[0] for c in BAD])
def test_bad_input(name, call, error, match):
    with pytest.raises(error, match=match):
        call()


# ----------------------------------------------------------------------------- sink tokens


@pytest.mark.parametrize("fmt", [KVFormat("centered", 3, 2), KVFormat("mse", 4), KVFormat("affine", 4),
                                 KVFormat("affine", 2, key_axis="channel", group_size=8)], ids=lambda f: f.label)
def test_sink_tokens_stay_unquantized(fmt):
    stats = _stats()
    cache = KVCache(fmt, num_layers=2, num_kv_heads=H, head_dim=D, key_stats=stats, sink=2, prefill="stored")
    k, v = _kv(1, 0, stats)
    k_out, v_out = cache.update(k, v, 0)  # a first call of one token: all of it goes to the sink
    k2, v2 = _kv(20, 1, stats)
    k_out, v_out = cache.update(k2, v2, 0)
    layer = cache.layers[0]
    assert k_out.shape[2] == 21 and layer.k_sink.shape[2] == 2
    assert torch.equal(k_out[:, :, 0], k[:, :, 0].half().float()) and torch.equal(k_out[:, :, 1], k2[:, :, 0].half().float())
    assert torch.equal(v_out[:, :, :2], torch.cat([v, v2[:, :, :1]], 2).half().float())
    assert not torch.equal(k_out[:, :, 2:], k2[:, :, 1:].half().float())
    q_k, q_v = layer.quantized_tokens()
    assert q_v == 19 and cache.get_seq_length() == 21
    sink_bytes = 2 * 2 * 2 * H * D * 2  # 2 tokens, K and V, batch 2, fp16
    assert layer.nbytes() == sink_bytes + layer.k_codes.nbytes() + layer.v_codes.nbytes() + 2 * (layer.k_tail.numel() + layer.v_tail.numel()) \
        if layer.mse is None else layer.nbytes() == sink_bytes + layer.mse.nbytes()
    cache.reset()
    assert cache.get_seq_length() == 0


def test_sink_does_not_change_fp16_layers_and_is_checked():
    stats = _stats()
    cache = KVCache(KVFormat("fp16"), num_layers=2, num_kv_heads=H, head_dim=D, sink=4, prefill="stored", dtype=None)
    k, v = _kv(6, 0, stats)
    k_out, _ = cache.update(k, v, 0)
    assert torch.equal(k_out, k) and cache.layers[0].k_sink.shape[2] == 0
    with pytest.raises(ValueError, match="sink"):
        KVCache(KVFormat("mse", 3), num_layers=2, num_kv_heads=H, head_dim=D, sink=-1)
    with pytest.raises(TypeError, match="sink"):
        KVCache(KVFormat("mse", 3), num_layers=2, num_kv_heads=H, head_dim=D, sink=1.0)


# ----------------------------------------------------------------------------- simulated codecs


def test_simulated_cache_returns_what_kvcache_returns():
    """Simulated plain MSE and centred parts: the same decoded keys and values as kvlab.KVCache."""
    from kvlab.study.simulated import SimulatedCache, centered_part, mse_part

    stats = _stats()
    sim = SimulatedCache([(centered_part(stats, i, 3), mse_part(D, 2)) for i in range(2)], sink=1)
    real = KVCache(KVFormat("centered", 3, 2), num_layers=2, num_kv_heads=H, head_dim=D, key_stats=stats, sink=1, dtype=None)
    for i, n in enumerate([17, 5]):
        k, v = _kv(n, i, stats, layer=1)
        outs = [c.update(k, v, 1) for c in (sim, real)]
    for a, b in zip(*outs):
        torch.testing.assert_close(a[:, :, :1], b[:, :, :1], rtol=1e-3, atol=0)  # the sink: fp16 in the simulation
        torch.testing.assert_close(a[:, :, 1:], b[:, :, 1:], rtol=0, atol=0)
    assert sim.held_bits_per_element() == pytest.approx((21 * (3.25 + 2.25) + 2 * 16) / 44)


def test_simulated_residual_and_split_part():
    from kvlab.study.simulated import SimulatedCache, fp16_part, split_part

    stats = _stats()
    part = split_part(stats, 0, 2, 3, 16)
    assert part.bits_per_element == (16 * 3 + 48 * 2 + 32) / 64
    k, v = _kv(30, 0, stats)
    k_hat = part.fn(k, torch.arange(30))
    err = (k_hat - k).square().sum() / (k - stats.mean[0][:, None]).square().sum()
    assert 0 < err < 0.3
    cache = SimulatedCache([(part, fp16_part())] * 2, residual=4)
    cache.update(k[:, :, :20], v[:, :, :20], 0)
    k_out, _ = cache.update(k[:, :, 20:], v[:, :, 20:], 0)
    assert torch.equal(k_out[:, :, -4:], k[:, :, -4:].half().float()) and not torch.equal(k_out[:, :, :26], k[:, :, :26])


def test_pre_rope_undoes_and_reapplies_the_rotation():
    from kvlab.study.simulated import Part, pre_rope

    inv = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)

    def tables(pos):
        angle = pos[:, None].float() * inv[None]
        angle = torch.cat([angle, angle], -1)
        return angle.cos(), angle.sin()

    seen = []
    identity = Part(lambda x, pos: seen.append(x) or x, 16.0, "id")
    torch.manual_seed(0)
    raw = torch.randn(1, H, 9, D)
    cos, sin = tables(torch.arange(9))
    rotated = raw * cos + torch.cat([-raw[..., D // 2 :], raw[..., : D // 2]], -1) * sin
    out = pre_rope(identity, tables).fn(rotated, torch.arange(9))
    torch.testing.assert_close(seen[0], raw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, rotated, rtol=1e-5, atol=1e-5)


def test_simulated_bad_input():
    from kvlab.study.simulated import SimulatedCache, split_part

    with pytest.raises(TypeError, match="parts"):
        SimulatedCache([("a", "b")])
    with pytest.raises(ValueError, match="residual"):
        SimulatedCache([], residual=-1)
    with pytest.raises(ValueError, match="n must leave"):
        split_part(_stats(), 0, 2, 3, 62)


def test_cache_with_a_mean_that_turns_with_the_position(device):
    """RoPE'd means: stored codes are those of each token at its sequence position (after the sink);
    reference and Triton back ends agree."""
    g = torch.Generator().manual_seed(3)
    stats = ChannelStats(torch.randn(2, H, D, generator=g) * 3, torch.exp(torch.randn(2, H, D, generator=g)), 100, rope_of(D))
    caches = {b: KVCache(KVFormat("centered", 3, 2), num_layers=2, num_kv_heads=H, head_dim=D, key_stats=stats, sink=1,
                         backend=b, dtype=None, prefill="stored") for b in ("reference", "triton")}
    ks = []
    for i, n in enumerate([19, 1, 12]):
        k, v = _kv(n, i, stats, batch=2)
        ks.append(k)
        outs = {b: c.update(k.to(device), v.to(device), 0) for b, c in caches.items()}
    ref, tri = (caches[b].layers[0] for b in ("reference", "triton"))
    assert torch.equal(ref.mse.cache.cpu(), tri.mse.cache.cpu())
    for a, b in zip(outs["reference"], outs["triton"]):
        assert rel_err(b.cpu(), a.cpu()) < 1e-6
    k = torch.cat(ks, 2).cpu()  # [2, H, 32, D]; token 0 is the sink, tokens 1..31 are coded at positions 1..31
    codec = CenteredMSECodec(D, 3, stats.mean[0], stats.scale[0], rope=stats.rope)
    rows = k[:, :, 1:].transpose(1, 2).reshape(-1, H, D)
    positions = torch.arange(1, 32).repeat(2)
    codes, _ = kvlab.mse.reference.load_slots(ref.mse.cache.cpu(), ref.mse._slots(0, 31).cpu(), kvlab.MSESlot(D, 3, 2))
    assert torch.equal(codes, codec.encode(rows, positions))
    decoded = codec.decode(codes, "model", positions).reshape(2, 31, H, D).transpose(1, 2)
    first = outs["reference"][0].cpu()
    assert torch.equal(first[:, :, 0], k[:, :, 0])  # the sink is stored as it is
    # the reference back end decodes on the cache's device: exact on the CPU, float rounding elsewhere
    assert rel_err(first[:, :, 1:], decoded) <= (0.0 if device == "cpu" else 1e-6)
    # keys whose mean turns with the position: the codec that turns its mean codes them better than one
    # with the average mean
    pos = torch.arange(200)
    turning = (stats.rope.apply(stats.mean[0], pos[:, None]) + stats.scale[0] * torch.randn(200, H, D, generator=g)).float()
    constant = CenteredMSECodec(D, 3, turning.mean(0), stats.scale[0])
    err_turning = (codec.decode(codec.encode(turning, pos), "model", pos) - turning).square().sum()
    err_constant = (constant.decode(constant.encode(turning)) - turning).square().sum()
    assert err_turning < 0.7 * err_constant
