"""KVCache(KVFormat("transform")) with codecs of random orthogonal transforms: the codes it stores, what it returns,
its bytes, both back ends, keys coded before and after RoPE, bad input."""

import inspect

import pytest
import torch

from kvlab import RoPE
from kvlab.hf.cache import KVCache, KVFormat
from kvlab.transform import TransformKV
from kvlab.transform import reference as R
from transform_codecs import random_codec  # tests/ops/transform_codecs.py

B, H, D = 2, 3, 16
ROPE = RoPE(1e4 ** -(torch.arange(0, D, 2, dtype=torch.float64) / D))


def random_kv(layers, heads, dim, groups, rope, seed=0):
    """Keys coded jointly (groups 1) or per head (groups = heads), values the other way, gains on and off."""
    width = heads * dim
    keys = [random_codec(width, groups, seed + 2 * i) for i in range(layers)]
    values = [random_codec(width, heads // groups if groups > 1 else heads, seed + 2 * i + 1, gain=i % 2 == 0)
              for i in range(layers)]
    return TransformKV(keys, values, rope)


def _kv(n, seed, batch=B):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, H, n, D, generator=g), torch.randn(batch, H, n, D, generator=g)


def _expected(kv, k, v, sink, stored):
    """What the cache returns for tokens [sink, sink + stored) of ``k``, ``v`` [B, H, T, D], from the reference."""
    batch = k.shape[0]
    rows_k = k[:, :, sink : sink + stored].transpose(1, 2).reshape(batch * stored, H, D)
    positions = (torch.arange(stored) + sink).repeat(batch)[:, None]
    if kv.rope is not None:
        rows_k = kv.rope.undo(rows_k, positions).float()
    k_hat = R.decode(kv.keys[0], R.encode(kv.keys[0], rows_k.reshape(-1, H * D))).view(-1, H, D)
    if kv.rope is not None:
        k_hat = kv.rope.apply(k_hat, positions).float()
    rows_v = v[:, :, sink : sink + stored].transpose(1, 2).reshape(batch * stored, H * D)
    v_hat = R.decode(kv.values[0], R.encode(kv.values[0], rows_v))
    shape = (batch, stored, H, D)
    return k_hat.reshape(shape).transpose(1, 2), v_hat.reshape(shape).transpose(1, 2)


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("rope", [None, ROPE], ids=["post_rope", "pre_rope"])
def test_stores_codes_and_returns_their_decoding(groups, rope, device):
    kv = random_kv(1, H, D, groups, rope)
    sink, residual = 2, 3
    caches = {b: KVCache(KVFormat("transform"), num_layers=1, num_kv_heads=H, head_dim=D, transform=kv, sink=sink,
                         residual=residual, dtype=torch.float32, backend=b) for b in ("reference", "triton")}
    ks, vs = [], []
    for i, n in enumerate([19, 1, 12]):
        k, v = _kv(n, i)
        ks.append(k)
        vs.append(v)
        outs = {b: [x.cpu() for x in c.update(k.to(device), v.to(device), 0)] for b, c in caches.items()}
    k, v = torch.cat(ks, 2), torch.cat(vs, 2)
    ref, tri = (caches[b].layers[0] for b in ("reference", "triton"))
    assert tri.backend == "triton" and ref.backend == "reference"
    assert torch.equal(ref.mse.k_cache, tri.mse.k_cache) and torch.equal(ref.mse.v_cache, tri.mse.v_cache)
    for a, b in zip(outs["reference"], outs["triton"]):
        assert torch.equal(a, b)
    stored = 32 - sink - residual
    assert tri.quantized_tokens() == (stored, stored)
    k_hat, v_hat = _expected(kv, k, v, sink, stored)
    k_out, v_out = outs["triton"]
    assert torch.equal(k_out[:, :, :sink], k[:, :, :sink]) and torch.equal(k_out[:, :, -residual:], k[:, :, -residual:])
    torch.testing.assert_close(k_out[:, :, sink:-residual], k_hat, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_out[:, :, sink:-residual], v_hat, rtol=1e-5, atol=1e-5)
    assert torch.equal(v_out[:, :, :sink], v[:, :, :sink]) and torch.equal(v_out[:, :, -residual:], v[:, :, -residual:])
    rows = kv.keys[0].row_bytes + kv.values[0].row_bytes
    assert tri.nbytes() == ref.nbytes() == B * stored * rows + 2 * B * H * (sink + residual) * D * 4
    assert caches["triton"].bits_per_element == pytest.approx(kv.bits_per_element(), rel=1e-12)


def test_a_gain_beyond_fp16_leaves_the_cache_as_it_was(device):
    kv = random_kv(1, H, D, 1, ROPE)
    cache = KVCache(KVFormat("transform"), num_layers=1, num_kv_heads=H, head_dim=D, transform=kv,
                    dtype=torch.float32, backend="triton", block_size=4)
    k, v = (x.to(device) for x in _kv(6, 0))
    cache.update(k, v, 0)
    layer = cache.layers[0]
    before = (layer.mse.k_cache.clone(), layer.mse.v_cache.clone(), [list(t) for t in layer.mse.block_table],
              layer.nbytes(), layer.length)
    k_more, v_more = (x.to(device) for x in _kv(5, 1))
    v_more[1, 2, 3] = 1e9  # fits in fp32 (the cache's dtype), not as a gain
    with pytest.raises(ValueError, match="value_states has a group whose gain"):
        cache.update(k_more, v_more, 0)
    after = (layer.mse.k_cache, layer.mse.v_cache, layer.mse.block_table, layer.nbytes(), layer.length)
    assert all(torch.equal(a, b) for a, b in zip(before[:2], after[:2])) and before[2:] == after[2:]
    out = cache.update(k_more[:, :, :1], v_more[:, :, :1], 0)  # the cache still works
    assert out[0].shape == (B, H, 7, D)


def test_tiny_llama_same_logits_on_both_back_ends(device):
    """A random 2-layer Llama over a prompt and three decode steps: both back ends store the same bytes and give
    the same logits, with keys coded before RoPE (at the model's RoPE) and after."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=3, head_dim=16, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval().to(device)
    # the cache's keyword: ``cache`` since transformers 5.2x, ``past_key_values`` before
    kw = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    ids = torch.randint(0, 64, (1, 23), generator=torch.Generator().manual_seed(1)).to(device)
    for rope in (None, RoPE.from_model(model)):
        kv = random_kv(2, 3, 16, 3 if rope is None else 1, rope, seed=5)
        logits, caches = {}, {}
        for backend in ("reference", "triton"):
            cache = KVCache(KVFormat("transform"), config=model.config, transform=kv, sink=1, residual=2,
                            dtype=torch.float32, backend=backend)
            with torch.no_grad():
                steps = [model(ids[:, :20], **{kw: cache}).logits[:, -1]]
                steps += [model(ids[:, t : t + 1], **{kw: cache}).logits[:, -1] for t in range(20, 23)]
            logits[backend], caches[backend] = torch.cat(steps), cache
        assert torch.equal(logits["reference"], logits["triton"])
        for a, b in zip(caches["reference"].layers, caches["triton"].layers):
            assert torch.equal(a.mse.k_cache, b.mse.k_cache) and torch.equal(a.mse.v_cache, b.mse.v_cache)
        assert torch.isfinite(logits["triton"]).all()


def test_bad_configurations():
    kv = random_kv(1, H, D, 1, None)
    with pytest.raises(ValueError, match="needs the calibrated codecs"):
        KVCache(KVFormat("transform"), num_layers=1, num_kv_heads=H, head_dim=D)
    with pytest.raises(TypeError, match="transform must be a kvlab.transform.TransformKV"):
        KVCache(KVFormat("transform"), num_layers=1, num_kv_heads=H, head_dim=D, transform=kv.keys)
    with pytest.raises(ValueError, match="codecs for 1 layers, the model has 2"):
        KVCache(KVFormat("transform"), num_layers=2, num_kv_heads=H, head_dim=D, transform=kv)
    with pytest.raises(ValueError, match=r"transform.keys\[0\] codes 1 x 48 numbers per token"):
        KVCache(KVFormat("transform"), num_layers=1, num_kv_heads=2, head_dim=D, transform=kv)
    wrong = TransformKV(kv.keys, kv.values, RoPE(torch.ones(4, dtype=torch.float64)))
    with pytest.raises(ValueError, match="transform.rope rotates 8 channels"):
        KVCache(KVFormat("transform"), num_layers=1, num_kv_heads=H, head_dim=D, transform=wrong)
    with pytest.raises(ValueError, match="key_bits must be None for codec='transform'"):
        KVFormat("transform", 3)
