"""Generation over the transform codec's paged caches (PagedKVCache + kvlab.transform.attention.decode_attention)
against the materialising path (KVCache(KVFormat("transform"))), with codecs of random orthogonal transforms."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvlab import KVCache, KVFormat, RoPE
from kvlab.hf.generation import PagedKVCache, fused_support, generate
from kvlab.transform import TransformCodec, TransformKV

VOCAB = 128


def tiny_model(q_heads=4, kv_heads=2, head_dim=64, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.pad_token_id = 0
    return model


def random_codec(width, groups, seed, bits=5):
    g = torch.Generator().manual_seed(seed)
    dim = width // groups
    q, _ = torch.linalg.qr(torch.randn(groups, dim, dim, generator=g, dtype=torch.float64))
    q = q.float()
    books = torch.sort(torch.randn(groups, dim, 1 << bits, generator=g), -1).values
    return TransformCodec(torch.zeros(groups, dim), q.contiguous(), q.transpose(1, 2).contiguous(),
                          torch.full((groups, dim), bits), books, True)


def random_kv(model, groups, pre_rope):
    c = model.config
    width = c.num_key_value_heads * c.head_dim
    layers = c.num_hidden_layers
    rope = RoPE.from_model(model) if pre_rope else None
    return TransformKV([random_codec(width, groups, 2 * i) for i in range(layers)],
                       [random_codec(width, groups, 2 * i + 1) for i in range(layers)], rope)


@pytest.mark.parametrize("pre_rope", [False, True], ids=["post_rope", "pre_rope"])
def test_fused_steps_match_the_materialising_cache(pre_rope, device):
    """A prompt, two decode steps and a continuation of three tokens: the logits of the paged cache (Triton store and
    decode, on a CPU in the interpreter) are those of KVCache over the same codes, up to the kernel's fp16 products;
    the two back ends of the paged cache store the same bytes for the same inputs."""
    model = tiny_model().to(device)
    kv = random_kv(model, 1 if pre_rope else 2, pre_rope)
    ids = torch.randint(3, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1)).to(device)
    calls = [ids[:, :17], ids[:, 17:18], ids[:, 18:19], ids[:, 19:21]]
    logits = {}
    caches = {}
    for name in ("triton", "reference", "materialising"):
        if name == "materialising":
            model.set_attn_implementation("sdpa")
            cache = KVCache(KVFormat("transform"), config=model.config, transform=kv, dtype=torch.float32,
                            backend="reference")
        else:
            model.set_attn_implementation("kvlab")
            cache = PagedKVCache(KVFormat("transform"), config=model.config, batch_size=2, max_length=32,
                                 transform=kv, backend=name, device=device)
        with torch.no_grad():
            logits[name] = [model(x, cache=cache, use_cache=True).logits[:, -1] for x in calls]
        caches[name] = cache
    model.set_attn_implementation("sdpa")
    prompt = lambda c: c.view(2, -1, c.shape[-1])[:, :17]  # sequence b owns blocks [2 b, 2 b + 2)
    for i, (a, b) in enumerate(zip(caches["triton"].layers, caches["reference"].layers)):
        for x, y in ((a.k_cache, b.k_cache), (a.v_cache, b.v_cache)):
            # the first layer sees the same inputs at every step; later ones after the kernels' fp16 products
            assert torch.equal(x, y) if i == 0 else torch.equal(prompt(x), prompt(y))
    for step in range(4):
        for name in ("triton", "reference"):
            torch.testing.assert_close(logits[name][step], logits["materialising"][step], rtol=2e-3, atol=2e-3)
    paged = caches["triton"]
    rows = sum(c.row_bytes for c in (*kv.keys, *kv.values))
    assert paged.nbytes() == 2 * 21 * rows and paged.layers[0].seq_lens.tolist() == [21, 21]
    assert paged.bits_per_element == kv.bits_per_element()


def test_generate_takes_the_fused_path():
    model = tiny_model(layers=1)
    kv = random_kv(model, 2, True)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded prompt: its padding is not stored
    out = generate(model, ids, KVFormat("transform"), 4, attention_mask=mask, transform=kv, backend="reference")
    assert out.path == "fused" and isinstance(out.cache, PagedKVCache) and out.sequences.shape == (2, 13)
    assert out.cache.layers[0].seq_lens.tolist() == [12, 9]
    assert fused_support(KVFormat("transform"), 64) is None


def test_codecs_calibrated_with_16_bit_tokens_generate_through_kvcache():
    """Codecs whose bits assume the first and last tokens in 16 bit: PagedKVCache refuses them, KVCache keeps those
    tokens by default, and kvlab.generate takes that path."""
    model = tiny_model(layers=1)
    base = random_kv(model, 2, False)
    kv = TransformKV(base.keys, base.values, base.rope, sink=1, residual=3)
    with pytest.raises(ValueError, match="calibrated to keep the first 1 and the last 3 tokens in 16 bit"):
        PagedKVCache(KVFormat("transform"), config=model.config, batch_size=1, max_length=16, transform=kv)
    cache = KVCache(KVFormat("transform"), config=model.config, transform=kv)
    assert (cache.sink, cache.residual) == (1, 3)
    assert (KVCache(KVFormat("transform"), config=model.config, transform=kv, sink=0).sink) == 0
    with pytest.raises(ValueError, match="transform is for KVFormat\\('transform'\\) layers"):
        KVCache(KVFormat("mse", 4), config=model.config, transform=kv)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    out = generate(model, ids, KVFormat("transform"), 5, transform=kv)
    assert out.path == "materialising" and "keep the first 1 and the last 3 tokens" in out.why
    model.set_attn_implementation("sdpa")
    own = model.generate(ids, cache=KVCache(KVFormat("transform"), config=model.config, transform=kv),
                         max_new_tokens=5, do_sample=False)
    assert torch.equal(out.sequences, own)


def test_bad_configurations():
    model = tiny_model(layers=1)
    kv = random_kv(model, 1, False)
    make = lambda fmt, **kw: PagedKVCache(fmt, config=model.config, batch_size=1, max_length=8, **kw)
    with pytest.raises(ValueError, match="needs the calibrated codecs"):
        make(KVFormat("transform"))
    with pytest.raises(ValueError, match="transform is for KVFormat"):
        make(KVFormat("mse", 4), transform=kv)
    with pytest.raises(TypeError, match="transform must be a kvlab.transform.TransformKV"):
        make(KVFormat("transform"), transform=kv.keys)
    two = TransformKV(kv.keys * 2, kv.values * 2)
    with pytest.raises(ValueError, match="codecs for 2 layers, the model has 1"):
        make(KVFormat("transform"), transform=two)


def test_a_prompt_that_cannot_be_stored_leaves_every_layer_as_it_was(device):
    model = tiny_model().to(device)
    kv = random_kv(model, 2, False)
    model.set_attn_implementation("kvlab")
    cache = PagedKVCache(KVFormat("transform"), config=model.config, batch_size=1, max_length=16, transform=kv,
                         backend="triton", device=device)
    try:
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7]], device=device), cache=cache, use_cache=True)
            model.model.layers[1].self_attn.v_proj.weight.data *= 1e7  # the second layer's values: gains beyond fp16
            with pytest.raises(ValueError, match="value_states has a group whose gain"):
                model(torch.tensor([[8, 9]], device=device), cache=cache, use_cache=True)
    finally:
        model.set_attn_implementation("sdpa")
    assert [layer.length for layer in cache.layers] == [3, 3]
    assert [layer.seq_lens.tolist() for layer in cache.layers] == [[3], [3]]


def test_perplexity_through_the_fused_decode_equals_the_materialising_cache():
    """kvlab.perplexity with every scored token one decode step over the transform codes (keys before RoPE)."""
    import kvlab

    model = tiny_model(layers=1)
    kv = random_kv(model, 1, True)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    paged = lambda: PagedKVCache(KVFormat("transform"), config=model.config, batch_size=1, max_length=64, transform=kv)
    materialising = lambda: KVCache(KVFormat("transform"), config=model.config, transform=kv, dtype=torch.float32)
    a = kvlab.perplexity(model, ids, window=32, stride=16, chunk=1, cache=paged)
    b = kvlab.perplexity(model, ids, window=32, stride=16, chunk=1, cache=materialising)
    assert a.tokens == b.tokens == 16 and a.nll == pytest.approx(b.nll, rel=1e-4)
    assert a.bits_per_element == b.bits_per_element == kv.bits_per_element()


@pytest.mark.parametrize("sink,residual", [(2, 3)])
def test_fused_layout_with_fp16_tokens_matches_the_materialising_cache(sink, residual, device):
    """Codecs in the fused layout calibrated to keep the first ``sink`` and the last ``residual`` tokens in fp16: the
    paged cache merges the fused decode over the coded tokens with attention over its fp16 copies. Its logits over a
    left-padded batch's prompt and decode steps (past the window) are those of KVCache over each sequence alone."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from transform_codecs import fused_codec

    model = tiny_model().to(device)
    layers = model.config.num_hidden_layers
    kv = TransformKV([fused_codec(2, 64, (16, 16, 16), 2 * i) for i in range(layers)],
                     [fused_codec(2, 64, (0, 32, 32), 2 * i + 1) for i in range(layers)], None, sink, residual)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 17), generator=g).to(device)
    pads = (0, 3)  # the second sequence left-padded
    mask = (torch.arange(17)[None, :] >= torch.tensor(pads)[:, None]).long().to(device)
    steps = torch.randint(3, VOCAB, (2, 6), generator=g).to(device)

    def run(cache, ids, mask, steps):  # positions count real tokens, as generate's do
        out = []
        with torch.no_grad():
            pos = (mask.cumsum(1) - 1).clamp_min(0)
            out.append(model(ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits[:, -1])
            for i in range(steps.shape[1]):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                pos = mask.sum(1, keepdim=True) - 1
                out.append(model(steps[:, i : i + 1], attention_mask=mask, position_ids=pos, cache=cache,
                                 use_cache=True).logits[:, -1])
        return torch.stack(out, 1)  # [B, steps + 1, vocab]

    model.set_attn_implementation("sdpa")
    alone = torch.cat([run(KVCache(KVFormat("transform"), config=model.config, transform=kv, dtype=torch.float32,
                                   backend="reference"), ids[b : b + 1, p:], mask[b : b + 1, p:], steps[b : b + 1])
                       for b, p in enumerate(pads)])
    model.set_attn_implementation("kvlab")
    for backend in ("triton", "reference"):
        cache = PagedKVCache(KVFormat("transform"), config=model.config, batch_size=2, max_length=32, transform=kv,
                             backend=backend, device=device)
        # (a sequence's prompt computed beside another may round a key across a code boundary: a few logits move more)
        torch.testing.assert_close(run(cache, ids, mask, steps), alone, rtol=1e-2, atol=5e-3)
        rows = sum(c.row_bytes for c in (*kv.keys, *kv.values))
        fp16 = layers * 2 * 2 * 64 * 2  # a token's keys and values, every layer, in fp16
        assert cache.nbytes() == (23 + 20) * rows + 2 * min(sink + residual, 20) * fp16
    model.set_attn_implementation("sdpa")


def test_generate_takes_the_fused_path_for_codecs_in_the_fused_layout(device):
    """kvlab.generate with codecs in the fused layout and fp16 sink and window tokens: the fused path, and the tokens
    of the materialising path over the same codecs (greedy, a left-padded batch, head dim 64)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from transform_codecs import fused_codec

    model = tiny_model().to(device)
    layers = model.config.num_hidden_layers
    kv = TransformKV([fused_codec(2, 64, (0, 48, 16), 2 * i) for i in range(layers)],
                     [fused_codec(2, 64, (16, 16, 32), 2 * i + 1) for i in range(layers)], None, 0, 4)  # no sink
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    out = generate(model, ids, KVFormat("transform"), 8, attention_mask=mask, transform=kv, eos_token_id=None)
    assert out.path == "fused", out.why
    alone = generate(model, ids[1:], KVFormat("transform"), 8, transform=kv, eos_token_id=None)
    assert torch.equal(out.sequences[1], alone.sequences[0]), "padding does not change a sequence's tokens"
    model.set_attn_implementation("sdpa")
    cache = KVCache(KVFormat("transform"), config=model.config, transform=kv, dtype=torch.float32, backend="reference")
    dense = model.generate(ids[1:], cache=cache, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(alone.sequences, dense), "the materialising path's tokens"
