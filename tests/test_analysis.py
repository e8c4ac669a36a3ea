"""Real attention inputs, channel statistics, per-head codec errors, outlier split and bit allocation (kvlab.study.analysis)."""

import itertools
import math

import pytest
import torch

import kvlab
from kvlab.study import analysis as A
from kvlab.study import metrics as M

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_llama():
    """A randomly initialised Llama with grouped-query attention (4 query heads over 2 KV heads), odd sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def test_capture_attention_records_what_attention_consumes(tiny_llama):
    from transformers import DynamicCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = tiny_llama
    ids = torch.randint(0, 101, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids[None]).logits
        cache = DynamicCache(config=model.config)
        model(ids[None], cache=cache, use_cache=True)
    inputs_of_o_proj = []
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: inputs_of_o_proj.append(a[0][0]))
             for layer in model.model.layers]
    cap = A.capture_attention(model, ids)
    for h in hooks:
        h.remove()
    assert cap.queries.shape == (3, 4, 37, 16) and cap.keys.shape == cap.values.shape == (3, 2, 37, 16)
    assert cap.residual.shape == (3, 37, 64)
    torch.testing.assert_close(cap.residual[0], model.model.embed_tokens(ids).detach())
    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping  # the recording is undone
    with torch.no_grad():
        assert torch.equal(model(ids[None]).logits, logits)
    for i, layer in enumerate(cache.layers):
        torch.testing.assert_close(cap.keys[i], layer.keys[0])
        torch.testing.assert_close(cap.values[i], layer.values[0])
        # causal attention over the recorded inputs reproduces the layer's attention output
        k = cap.keys[i].repeat_interleave(2, 0)
        v = cap.values[i].repeat_interleave(2, 0)
        s = cap.queries[i] @ k.transpose(-1, -2) / 4.0
        s = s.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), -math.inf)
        out = (torch.softmax(s, -1) @ v).transpose(0, 1).reshape(37, 64)
        torch.testing.assert_close(out, inputs_of_o_proj[i], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="ids"):
        A.capture_attention(model, ids[None])
    with pytest.raises(TypeError, match="ids"):
        A.capture_attention(model, ids.float())


def test_channel_statistics():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4000, 24)
    x[..., 5] *= 10.0
    share = A.top_channel_share(x, 1)
    assert share.shape == (2, 3)
    assert share.mean().item() == pytest.approx(100 / 123, rel=0.03)
    assert A.top_channel_share(x, 24).sub(1).abs().max().item() < 1e-6
    assert bool((A.top_channels(x, 1) == 5).all())
    assert A.top_channels(x, 3).shape == (2, 3, 3) and bool((A.top_channels(x, 3).diff(dim=-1) > 0).all())
    kurt = A.channel_kurtosis(x)
    assert kurt.shape == (2, 3, 24) and (kurt - 3).abs().max().item() < 0.5  # Gaussian channels, scaled or not
    t = M.synthetic_vectors("student_t", 4000, 8, df=5)
    assert A.channel_kurtosis(t).mean().item() > 5
    # a constant offset per channel: its energy share is offset^2 / (offset^2 + 1)
    offset = torch.randn(4000, 24) + 3.0
    assert A.channel_mean_share(offset, 40).item() == pytest.approx(0.9, abs=0.01)
    assert A.channel_mean_share(torch.randn(4000, 24), 40).item() < 0.05
    with pytest.raises(ValueError, match="multiple"):
        A.channel_mean_share(offset, 3000)
    with pytest.raises(ValueError, match="top"):
        A.top_channel_share(x, 25)
    with pytest.raises(ValueError, match="n"):
        A.top_channels(x, 0)
    with pytest.raises(ValueError, match="2 tokens"):
        A.channel_kurtosis(x[..., :1, :])
    with pytest.raises(TypeError, match="x"):
        A.top_channel_share(x.int(), 1)


def _case(layers=2, kv_heads=3, group=2, tokens=45, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, kv_heads, tokens, dim, generator=gen)
    v = torch.randn(layers, kv_heads, tokens, dim, generator=gen)
    q = 2 * torch.randn(layers, kv_heads * group, 7, dim, generator=gen)
    k_hat = k + 0.1 * torch.randn(k.shape, generator=gen)
    v_hat = 0.95 * v + 0.1 * torch.randn(v.shape, generator=gen)
    return q, k, v, k_hat, v_hat


def test_head_errors_match_the_metrics_at_the_last_position():
    # every query at the last position sees all keys: each head is kvlab.study.metrics on its own
    q, k, v, k_hat, v_hat = _case()
    pos = torch.full((7,), 44)
    e = A.head_errors(q, k, v, k_hat, v_hat, pos)
    assert e.key_mse.shape == (2, 3)
    for layer in range(2):
        for h in range(3):
            qh = q[layer, 2 * h : 2 * h + 2].reshape(14, 16)
            ip = M.inner_product_error(qh, k[layer, h], k_hat[layer, h])
            att = M.attention_error(qh, k[layer, h], v[layer, h], k_hat[layer, h], v_hat[layer, h])
            assert e.key_mse[layer, h].item() == pytest.approx(M.relative_mse(k[layer, h], k_hat[layer, h]), rel=1e-5)
            assert e.value_mse[layer, h].item() == pytest.approx(M.relative_mse(v[layer, h], v_hat[layer, h]), rel=1e-5)
            assert e.ip_bias[layer, h].item() == pytest.approx(ip.bias, rel=1e-4, abs=1e-7)
            assert e.ip_variance[layer, h].item() == pytest.approx(ip.variance, rel=1e-4)
            assert e.attention_score[layer, h].item() == pytest.approx(att.score, rel=1e-5)
            assert e.attention_output[layer, h].item() == pytest.approx(att.output, rel=1e-5)
    # the error written into the residual stream through the output projection
    w = torch.randn(2, 20, 6 * 16, generator=torch.Generator().manual_seed(5))
    e_w = A.head_errors(q, k, v, k_hat, v_hat, pos, output_weight=w)
    assert e.projected_output is None and e_w.projected_output.shape == (2, 3)
    for layer in range(2):
        for h in range(3):
            err = torch.zeros(7, 20, dtype=torch.float64)
            for g in range(2):
                j = 2 * h + g
                _, o = M.attention(q[layer, j], k[layer, h], v[layer, h])
                _, o_hat = M.attention(q[layer, j], k_hat[layer, h], v_hat[layer, h])
                err += (o_hat - o) @ w[layer, :, 16 * j : 16 * j + 16].double().T
            assert e_w.projected_output[layer, h].item() == pytest.approx(err.square().sum().item(), rel=1e-5)
    pooled_w = A.head_errors(q, k, v, k_hat, v_hat, pos, output_weight=w, pool_heads=True)
    torch.testing.assert_close(pooled_w.projected_output, e_w.projected_output.sum(-1))
    with pytest.raises(ValueError, match="output_weight"):
        A.head_errors(q, k, v, k_hat, v_hat, pos, output_weight=w[..., :-1])
    pooled = A.head_errors(q, k, v, k_hat, v_hat, pos, pool_heads=True)
    assert pooled.attention_score.shape == (2,)
    torch.testing.assert_close(pooled.attention_score, e.attention_score.mean(-1))
    num = (k_hat - k).double().square().sum((-2, -1)).sum(-1)
    torch.testing.assert_close(pooled.key_mse, (num / k.double().square().sum((-2, -1)).sum(-1)).float())


def test_head_errors_are_causal():
    q, k, v, k_hat, v_hat = _case(seed=1)
    pos = torch.tensor([3, 10, 20, 20, 30, 31, 40])
    e = A.head_errors(q, k, v, k_hat, v_hat, pos)
    # keys and values after the last query position change nothing but the key and value errors
    k2, kh2 = k.clone(), k_hat.clone()
    k2[..., 41:, :] += 5.0
    kh2[..., 41:, :] -= 5.0
    e2 = A.head_errors(q, k2, v, kh2, v_hat, pos)
    for name in ("ip_bias", "ip_variance", "attention_score", "attention_output"):
        torch.testing.assert_close(getattr(e2, name), getattr(e, name))
    assert not torch.allclose(e2.key_mse, e.key_mse)
    # exact copies: no error anywhere
    z = A.head_errors(q, k, v, k, v, pos)
    assert float(z.attention_output.abs().max()) == 0.0 and float(z.ip_variance.abs().max()) < 1e-12


def test_head_errors_checks():
    q, k, v, k_hat, v_hat = _case()
    pos = torch.arange(7)
    with pytest.raises(ValueError, match="positions"):
        A.head_errors(q, k, v, k_hat, v_hat, torch.arange(6))
    with pytest.raises(ValueError, match="positions"):
        A.head_errors(q, k, v, k_hat, v_hat, pos + 40)
    with pytest.raises(TypeError, match="positions"):
        A.head_errors(q, k, v, k_hat, v_hat, pos.float())
    with pytest.raises(ValueError, match="values_hat"):
        A.head_errors(q, k, v, k_hat, v_hat[..., :8], pos)
    with pytest.raises(ValueError, match="queries"):
        A.head_errors(q[:, :5], k, v, k_hat, v_hat, pos)
    with pytest.raises(TypeError, match="pool_heads"):
        A.head_errors(q, k, v, k_hat, v_hat, pos, pool_heads=1)


def test_outlier_split_encodes_each_part_with_its_codec():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 50, 40)
    channels = torch.stack([torch.randperm(40)[:11] for _ in range(6)]).reshape(2, 3, 11)
    split = A.OutlierSplit(40, 11, 3, 2)
    assert split.bits_per_element == 8 * (split.high.nbytes + split.low.nbytes) / 40
    y = split.roundtrip(x, channels)
    assert y.shape == x.shape and bool(torch.isfinite(y).all())
    for i, j in itertools.product(range(2), range(3)):
        hi = channels[i, j].sort().values
        lo = torch.tensor([c for c in range(40) if c not in hi.tolist()])
        torch.testing.assert_close(y[i, j][:, hi], split.high.decode(split.high.encode(x[i, j][:, hi])))
        torch.testing.assert_close(y[i, j][:, lo], split.low.decode(split.low.encode(x[i, j][:, lo])))
    # channels with most of the energy: the split beats the low-bit codec alone
    x[..., :4] *= 8.0
    top = A.top_channels(x, 11)
    plain = kvlab.MSECodec(40, 2)
    assert M.relative_mse(x, split.roundtrip(x, top)) < M.relative_mse(x, plain.decode(plain.encode(x)))
    with pytest.raises(ValueError, match="channels"):
        split.roundtrip(x, channels[:1])
    with pytest.raises(ValueError, match="repeat"):
        split.roundtrip(x, torch.zeros(2, 3, 11, dtype=torch.long) + torch.arange(11).clamp_max(9))
    with pytest.raises(ValueError, match="channels"):
        split.roundtrip(x, channels + 40)
    with pytest.raises(ValueError, match="num_high"):
        A.OutlierSplit(40, 38, 3, 2)


def test_allocate_bits_matches_brute_force_on_convex_curves():
    gen = torch.Generator().manual_seed(0)
    costs = [2.0, 3.0, 4.0, 5.0]
    for trial in range(20):
        units = 5
        # convex, decreasing curves: error = a * 4^-bits-ish with random scales
        scale = torch.rand(units, generator=gen, dtype=torch.float64) * 10 + 0.1
        decay = torch.rand(units, generator=gen, dtype=torch.float64) * 0.5 + 0.2
        errors = scale[:, None] * decay[:, None] ** torch.arange(4, dtype=torch.float64)[None, :]
        budget = 2.0 + trial % 4 * 0.6
        choice = A.allocate_bits(errors, costs, budget)
        assert A.allocation_cost(choice, costs) <= budget + 1e-12
        total = errors[torch.arange(units), choice].sum().item()
        best = min(sum(errors[u, c].item() for u, c in enumerate(combo))
                   for combo in itertools.product(range(4), repeat=units) if sum(costs[c] for c in combo) / units <= budget + 1e-12)
        assert total == pytest.approx(best, rel=1e-12), (trial, choice.tolist())


def test_allocate_bits_edges_and_checks():
    errors = torch.tensor([[1.0, 0.5, 0.4], [2.0, 0.1, 0.0]])
    costs = [2.0, 3.0, 4.0]
    assert A.allocate_bits(errors, costs, 2.0).tolist() == [0, 0]
    assert A.allocate_bits(errors, costs, 2.5).tolist() == [0, 1]  # the larger gain first
    assert A.allocate_bits(errors, costs, 4.0).tolist() == [2, 2]
    assert A.allocate_bits(torch.tensor([[1.0, 1.0]]), [2.0, 3.0], 3.0).tolist() == [0]  # no gain, no upgrade
    with pytest.raises(ValueError, match="budget"):
        A.allocate_bits(errors, costs, 1.5)
    with pytest.raises(ValueError, match="costs"):
        A.allocate_bits(errors, [2.0, 2.0, 4.0], 3.0)
    with pytest.raises(ValueError, match="costs"):
        A.allocate_bits(errors, [2.0, 3.0], 3.0)
    with pytest.raises(ValueError, match="errors"):
        A.allocate_bits(errors[0], costs, 3.0)
    with pytest.raises(ValueError, match="finite"):
        A.allocate_bits(errors * math.nan, costs, 3.0)
    with pytest.raises(TypeError, match="budget"):
        A.allocate_bits(errors, costs, "3")


def test_allocate_bits_is_exact_on_non_convex_curves():
    # option 1 is a poor intermediate step: going straight from 2 to 8 bits is what pays
    costs = [3.0, 4.0, 9.0]
    errors = torch.tensor([[10.0, 9.5, 0.0], [1.0, 0.5, 0.4]])
    assert A.allocate_bits(errors, costs, 6.0).tolist() == [2, 0]
    # brute force over random decreasing curves with fractional costs (2.25 = 2 bits + a 16-bit norm over 64)
    gen = torch.Generator().manual_seed(1)
    costs = [2.25, 3.0, 4.5, 9.0]
    for _ in range(15):
        errors = torch.rand(5, 4, generator=gen, dtype=torch.float64).sort(-1, descending=True).values
        for budget in (2.5, 3.3, 4.0, 6.0):
            choice = A.allocate_bits(errors, costs, budget)
            total = errors[torch.arange(5), choice].sum().item()
            assert A.allocation_cost(choice, costs) <= budget + 1e-12
            best = min(sum(errors[u, c].item() for u, c in enumerate(combo))
                       for combo in itertools.product(range(4), repeat=5) if sum(costs[c] for c in combo) / 5 <= budget + 1e-12)
            assert total == pytest.approx(best, rel=1e-12)
    with pytest.raises(ValueError, match="grid"):
        A.allocate_bits(errors, [2.0, 2.001, 3.0, 4.0], 3.0)
