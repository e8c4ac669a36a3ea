"""Generation through the fused decode (kvlab.hf.generation) against the materialising path (kvlab.KVCache)."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvlab
from kvlab import KVCache, KVFormat
from kvlab.hf.generation import PagedKVCache, compiled_layers, fused_support, generate

VOCAB = 256


def tiny_model(q_heads=4, kv_heads=2, head_dim=64, layers=2, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32 * q_heads, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval().to(dtype)
    model.generation_config.pad_token_id = 0
    return model


def materialised(model, ids, fmt, new, mask=None, dtype=torch.float16):
    """The same generation through KVCache (every step decodes the stored tokens, SDPA)."""
    model.set_attn_implementation("sdpa")
    cache = KVCache(fmt, config=model.config, backend="reference", dtype=dtype)
    return model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new, do_sample=False)


CASES = [  # format, (query heads per KV head, KV heads, head dim)
    (KVFormat("mse", 4, 3), (1, 2, 64)),
    (KVFormat("mse", 2, 2, rotation="hadamard"), (3, 3, 64)),
    (KVFormat("mse", 3, 4, rotation="hadamard"), (8, 1, 128)),
    (KVFormat("affine", 4, 4), (4, 2, 128)),
    (KVFormat("affine", 8, 4), (1, 2, 64)),
]


@pytest.mark.parametrize("fmt,shape", CASES, ids=lambda x: x.label if isinstance(x, KVFormat) else "x".join(map(str, x)))
def test_fused_equals_materialising(fmt, shape):
    group, kv_heads, head_dim = shape
    model = tiny_model(group * kv_heads, kv_heads, head_dim)
    ids = torch.randint(3, VOCAB, (2, 21))  # not a multiple of the block size; 21 + 24 crosses two block boundaries
    out = generate(model, ids, fmt, 24, backend="reference")
    assert out.path == "fused" and isinstance(out.cache, PagedKVCache)
    assert torch.equal(out.sequences, materialised(model, ids, fmt, 24))
    assert out.cache.get_seq_length() == 21 + 23  # the last token is generated, not stored
    assert out.cache.layers[0].seq_lens.tolist() == [44, 44]


@pytest.mark.parametrize("fmt", [KVFormat("mse", 4, 4), KVFormat("mse", 2, 3, rotation="hadamard"), KVFormat("affine", 4, 8)],
                         ids=lambda f: f.label)
def test_triton_backend_equals_reference(fmt):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU: Triton's interpreter
    model = tiny_model(4, 2, 64, layers=1, dtype=torch.float16 if device == "cuda" else torch.float32).to(device)
    ids = torch.randint(3, VOCAB, (2, 19), device=device)
    ref = generate(model, ids, fmt, 6, backend="reference", cuda_graph=False)
    tri = generate(model, ids, fmt, 6, backend="triton")
    stored = lambda out: out.cache.layers[0].cache.view(2, -1, *out.cache.layers[0].cache.shape[2:])[:, :19]
    assert torch.equal(stored(tri), stored(ref)), "the kernels store the reference's bytes"
    assert torch.equal(tri.sequences, ref.sequences)
    for a, b in zip(tri.cache.layers, ref.cache.layers):
        assert torch.equal(a.seq_lens, b.seq_lens)


def test_unequal_prompt_lengths():
    """A left-padded batch generates what each sequence generates alone (one-token prompt included)."""
    model = tiny_model(6, 2, 64)
    fmt = KVFormat("mse", 3, 3)
    prompts = [torch.randint(3, VOCAB, (n,)) for n in (5, 17, 1)]
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel():], mask[i, width - p.numel():] = p, 1
    batch = generate(model, ids, fmt, 20, attention_mask=mask, backend="reference")
    assert batch.cache.layers[0].seq_lens.tolist() == [5 + 19, 17 + 19, 1 + 19]  # padding is not stored
    for i, p in enumerate(prompts):
        alone = generate(model, p[None], fmt, 20, backend="reference")
        assert torch.equal(batch.sequences[i, width:], alone.sequences[0, p.numel():]), i
    assert torch.equal(batch.sequences, materialised(model, ids, fmt, 20, mask))


def test_model_generate_with_paged_cache():
    """transformers' own generate, with the cache and the attention implementation set by hand."""
    model = tiny_model(4, 2, 64)
    fmt = KVFormat("mse", 4, 4)
    ids = torch.randint(3, VOCAB, (2, 9))
    ours = generate(model, ids, fmt, 12, backend="reference").sequences
    model.set_attn_implementation("kvlab")
    cache = PagedKVCache(fmt, config=model.config, batch_size=2, max_length=32, backend="reference")
    theirs = model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False)
    model.set_attn_implementation("sdpa")
    assert torch.equal(theirs, ours)


@pytest.mark.parametrize("fmt", [KVFormat("mse", 4, 3), KVFormat("affine", 4, 4)], ids=lambda f: f.label)
def test_continuation_prefill(fmt):
    """Several tokens on a cache that holds a context: causal attention over the stored context."""
    model = tiny_model(4, 2, 64)
    first, second = torch.randint(3, VOCAB, (2, 20)), torch.randint(3, VOCAB, (2, 7))
    model.set_attn_implementation("kvlab")
    paged = PagedKVCache(fmt, config=model.config, batch_size=2, max_length=40, backend="reference")
    model(first, cache=paged)
    a = model(second, cache=paged).logits
    model.set_attn_implementation("sdpa")
    dense = KVCache(fmt, config=model.config, backend="reference")
    model(first, cache=dense)
    b = model(second, cache=dense).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert paged.get_seq_length() == 27


def test_perplexity_through_the_decode_path():
    model = tiny_model(4, 2, 64)
    ids = torch.randint(3, VOCAB, (80,))
    fmt = KVFormat("mse", 3, 3)
    make = lambda: PagedKVCache(fmt, config=model.config, batch_size=1, max_length=48, backend="reference")
    step = kvlab.perplexity(model, ids, window=48, stride=16, chunk=1, cache=make)
    chunked = kvlab.perplexity(model, ids, window=48, stride=16, cache=make)
    dense = kvlab.perplexity(model, ids, window=48, stride=16, chunk=1,
                             cache=lambda: KVCache(fmt, config=model.config, backend="reference"))
    assert abs(step.nll / dense.nll - 1) < 1e-3
    assert abs(chunked.nll / step.nll - 1) < 1e-3
    assert model.config._attn_implementation != "kvlab"  # put back
    assert step.bits_per_element == pytest.approx(fmt.bits_per_element(64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_models(dtype):
    model = tiny_model(4, 2, 64, dtype=dtype)
    ids = torch.randint(3, VOCAB, (2, 13))
    fmt = KVFormat("mse", 4, 4)
    out = generate(model, ids, fmt, 10, backend="reference")
    assert torch.equal(out.sequences, materialised(model, ids, fmt, 10, dtype=None))


def test_other_formats_take_the_materialising_path():
    model = tiny_model(4, 2, 64)
    ids = torch.randint(3, VOCAB, (2, 11))
    for fmt in (KVFormat("fp16"), KVFormat("affine", 2, key_axis="channel"), KVFormat("affine", 3)):
        assert fused_support(fmt, 64) is not None
        out = generate(model, ids, fmt, 8, backend="reference")
        assert out.path == "materialising" and out.why
        assert torch.equal(out.sequences, materialised(model, ids, fmt, 8))
    assert fused_support(KVFormat("mse", 4), 96) is not None  # head dims 64, 128, 256 only


def test_eos_pads_the_rest():
    model = tiny_model(4, 2, 64)
    ids = torch.randint(3, VOCAB, (2, 9))
    out = generate(model, ids, KVFormat("mse", 4), 10, backend="reference").sequences
    eos = int(out[0, 12])
    cut = generate(model, ids, KVFormat("mse", 4), 10, backend="reference", eos_token_id=eos, pad_token_id=0).sequences
    first = int((out[0, 9:] == eos).nonzero()[0])
    assert cut[0, 9 + first] == eos and (cut[0, 10 + first:] == 0).all()


def test_bad_inputs_leave_the_cache_as_it_was():
    model = tiny_model(4, 2, 64)
    ids = torch.randint(3, VOCAB, (1, 10))
    model.set_attn_implementation("kvlab")
    cache = PagedKVCache(KVFormat("mse", 4), config=model.config, batch_size=1, max_length=12, backend="reference")
    model(ids, cache=cache)
    before = [(layer.cache.clone(), layer.seq_lens.clone(), layer.length) for layer in cache.layers]
    with pytest.raises(ValueError, match="max_length=12"):
        model(torch.randint(3, VOCAB, (1, 3)), cache=cache)
    for layer, (c, s, n) in zip(cache.layers, before):
        assert torch.equal(layer.cache, c) and torch.equal(layer.seq_lens, s) and layer.length == n
    with pytest.raises(ValueError, match="attn_implementation='kvlab' needs a kvlab.PagedKVCache"):
        model(ids, cache=DynamicCache(config=model.config))
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="read by kvlab's attention only"):
        model(ids, cache=PagedKVCache(KVFormat("mse", 4), config=model.config, batch_size=1, max_length=12))
    kvlab.hf.paged._HANDOFF.layer = None


def test_bad_arguments():
    model = tiny_model(4, 2, 64)
    cfg = model.config
    ids = torch.randint(3, VOCAB, (2, 5))
    with pytest.raises(ValueError, match="cannot hold"):
        PagedKVCache(KVFormat("fp16"), config=cfg, batch_size=1, max_length=8)
    with pytest.raises(ValueError, match="batch_size"):
        PagedKVCache(KVFormat("mse", 4), config=cfg, batch_size=0, max_length=8)
    with pytest.raises(TypeError, match="fmt"):
        PagedKVCache("mse", config=cfg, batch_size=1, max_length=8)
    with pytest.raises(ValueError, match="backend"):
        PagedKVCache(KVFormat("mse", 4), config=cfg, batch_size=1, max_length=8, backend="cuda")
    with pytest.raises(TypeError, match="input_ids"):
        generate(model, ids.float(), KVFormat("mse", 4), 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, ids, KVFormat("mse", 4), 0)
    with pytest.raises(ValueError, match="attention_mask"):
        generate(model, ids, KVFormat("mse", 4), 4, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="no tokens"):
        generate(model, ids, KVFormat("mse", 4), 4, attention_mask=torch.zeros_like(ids))
    with pytest.raises(ValueError, match="max_length"):
        generate(model, ids, KVFormat("mse", 4), 4, max_length=6)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, ids, KVFormat("mse", 4), 4, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="cuda_graph"):
        generate(model, ids, KVFormat("mse", 4), 4, cuda_graph=True)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        generate(model, ids, KVFormat("mse", 4), 4, do_sample=True, generator=0)
    with pytest.raises(ValueError, match="input_ids is on the meta device, which holds shapes but no data"):
        generate(model, ids.to("meta"), KVFormat("mse", 4), 4, do_sample=True, generator=torch.Generator())
    with pytest.raises(TypeError, match="compile"):
        generate(model, ids, KVFormat("mse", 4), 4, compile="yes")
    with pytest.raises(ValueError, match="compile=True needs cuda_graph"):
        generate(model, ids, KVFormat("mse", 4), 4, compile=True)
    with pytest.raises(ValueError, match="layers"):
        with compiled_layers(torch.nn.Linear(2, 2)):
            pass
    assert model.config._attn_implementation == "sdpa"  # a failed call puts the attention back


def test_a_dropped_cache_frees_its_codes():
    import gc
    import weakref

    model = tiny_model(4, 2, 64, layers=1)
    out = generate(model, torch.randint(3, VOCAB, (1, 5)), KVFormat("mse", 4), 3, backend="reference")
    codes = weakref.ref(out.cache.layers[0].cache)
    gc.disable()
    try:
        del out
        assert codes() is None, "no reference cycle holds the codes"
    finally:
        gc.enable()


def test_replay_reads_the_same_codes_both_ways():
    from kvlab.hf.generation import replay_logits

    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU: Triton's interpreter
    model = tiny_model(4, 2, 64, layers=1, dtype=torch.float16 if device == "cuda" else torch.float32).to(device)
    ids = torch.randint(3, VOCAB, (1, 9), device=device)
    out = generate(model, ids, KVFormat("mse", 3, 4), 6, backend="reference", cuda_graph=False)
    seq = out.sequences[:, :-1]
    a = replay_logits(model, out.cache, seq, "fused", "triton")
    b = replay_logits(model, out.cache, seq, "materialising", "reference")
    torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=0)
    assert torch.equal(a[0, 8:].argmax(-1), out.sequences[0, 9:])  # the replay reproduces what was generated
    with pytest.raises(ValueError, match="path"):
        replay_logits(model, out.cache, seq, "dense")
    with pytest.raises(ValueError, match="sequences"):
        replay_logits(model, out.cache, out.sequences.repeat(1, 2))


@pytest.mark.parametrize("fmt", [KVFormat("mse", 4, 4, rotation="hadamard"), KVFormat("mse", 3, 2),
                                 KVFormat("affine", 4, 4), KVFormat("affine", 8, 8)], ids=lambda f: f.label)
def test_decode_step_equals_the_functions(fmt):
    """A layer's decode step (stores and attention prepared once, then replayed) writes the bytes of
    store_mse / store_affine and returns decode_attention's output, step after step."""
    from kvlab.affine import store_affine
    from kvlab.attention import decode_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU: Triton's interpreter
    batch, kv_heads, group, dim = 3, 2, 3, 64
    cfg = LlamaConfig(hidden_size=kv_heads * group * dim, num_attention_heads=kv_heads * group,
                      num_key_value_heads=kv_heads, head_dim=dim, num_hidden_layers=1)
    cache = PagedKVCache(fmt, config=cfg, batch_size=batch, max_length=40, device=device, backend="triton",
                         check_steps=False)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=torch.float16)
    layer.store(rand(batch, kv_heads, 21, dim), rand(batch, kv_heads, 21, dim), None)
    for _ in range(3):
        k, v, q = rand(batch, kv_heads, 1, dim), rand(batch, kv_heads, 1, dim), rand(batch, kv_heads * group, dim)
        expected = layer.cache.clone()
        slots = cache.first_slot + layer.seq_lens
        rows = lambda x: x.transpose(1, 2).reshape(batch, kv_heads, dim)
        store = kvlab.store_mse if cache.kind == "mse" else store_affine
        store(rows(k), rows(v), slots, expected, cache.key_codec, cache.value_codec, check=False)
        layer.store(k, v, None)
        assert torch.equal(layer.cache, expected)
        want = decode_attention(q, layer.cache, cache.block_table, layer.seq_lens, cache.key_codec, cache.value_codec,
                                scale=dim**-0.5, check=False)
        assert torch.equal(layer.decode(q, dim**-0.5), want)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("bad", ["huge", "nan", "tiny", "norm"])
def test_a_prompt_that_cannot_be_stored_leaves_the_cache_as_it_was(backend, bad, device):
    """Prompts and continuations are checked before they are stored (decode steps are not: no host sync); a
    failing forward pass leaves every layer's lengths as they were, and the cache keeps working."""
    model = tiny_model(4, 2, 64).to(device)
    model.set_attn_implementation("kvlab")
    cache = PagedKVCache(KVFormat("mse", 4), config=model.config, batch_size=1, max_length=40, device=device,
                         backend=backend)
    model(torch.randint(3, VOCAB, (1, 9), device=device), cache=cache)
    before = [(layer.seq_lens.clone(), layer.length) for layer in cache.layers]
    k = torch.randn(1, 2, 5, 64, device=device)
    if bad == "huge":
        k[0, 1, 3, 7] = 1e5
    elif bad == "nan":
        k[0, 0, 2, 0] = float("nan")
    elif bad == "tiny":
        k[0, 1, 1] = 1e-9
    else:
        k[0, 0, 4] = 9e3  # every value within fp16, the norm 102000 is not
    layer = cache.layers[1]
    rand = lambda: torch.randn(1, 2, 5, 64, device=device)
    cache.layers[0].store(rand(), rand(), None)  # the pass got this far
    with pytest.raises(ValueError, match="key_states"):
        layer.store(k, rand(), None)
    for layer, (s, n) in zip(cache.layers, before):
        assert torch.equal(layer.seq_lens, s) and layer.length == n
    out = model(torch.randint(3, VOCAB, (1, 4), device=device), cache=cache)
    assert torch.isfinite(out.logits).all() and cache.get_seq_length() == 13


def test_update_names_bad_states():
    cfg = tiny_model(4, 2, 64).config
    cache = PagedKVCache(KVFormat("mse", 4), config=cfg, batch_size=1, max_length=8, backend="reference")
    with pytest.raises(ValueError, match="key_states must be"):
        cache.update(torch.randn(2, 1, 64), torch.randn(2, 1, 64), 0)
    with pytest.raises(ValueError, match="layer_idx must be an int"):
        cache.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64), True)
    with pytest.raises(TypeError, match="key_states"):
        cache.update(torch.zeros(1, 2, 1, 64, dtype=torch.int64), torch.zeros(1, 2, 1, 64), 0)


def test_checked_attention_names_a_nonfinite_query():
    from kvlab.attention import decode_attention, prefill_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = tiny_model(4, 2, 64).config
    cache = PagedKVCache(KVFormat("mse", 4), config=cfg, batch_size=1, max_length=32, device=device, backend="triton")
    layer = cache.layers[0]
    layer.store(torch.randn(1, 2, 7, 64, device=device), torch.randn(1, 2, 7, 64, device=device), None)
    q = torch.randn(1, 4, 64, device=device).half()
    q[0, 1, 5] = float("nan")
    args = (cache.block_table, layer.seq_lens, cache.key_codec, cache.value_codec)
    with pytest.raises(ValueError, match="q holds NaN or Inf"):
        decode_attention(q, layer.cache, *args)
    with pytest.raises(ValueError, match="q holds NaN or Inf"):
        prefill_attention(q[:, None], layer.cache, *args)


def poison_third_step(model, layer: int):
    """A hook that makes sequence 1's keys of ``layer`` NaN in the third decode step (the fourth forward call);
    returns it and the list of each call's token count."""
    calls = []

    def poison(module, args, out):
        calls.append(out.shape[1])
        if len(calls) == 4:  # the prompt, then decode steps
            out = out.clone()
            out[1] = float("nan")
        return out

    return model.model.layers[layer].self_attn.k_proj.register_forward_hook(poison), calls


@pytest.mark.parametrize("fmt,do_sample", [(KVFormat("mse", 4), False), (KVFormat("affine", 4, 4), True)],
                         ids=["mse-greedy", "affine-sampled"])
def test_a_nonfinite_decode_step_is_an_error(fmt, do_sample, device):
    """Decode steps are stored without a host sync; a NaN key in step 3 is flagged on the device and raised at the end
    (steps called from Python, so that the hook poisons the third one on a GPU too)."""
    model = tiny_model(4, 2, 64, layers=2).to(device)
    ids = torch.randint(3, VOCAB, (2, 9), device=device)
    hook, calls = poison_third_step(model, 0)
    try:
        with pytest.raises(ValueError, match=r"NaN or Inf logits for sequence\(s\) \[1\]"):
            generate(model, ids, fmt, 8, backend="triton", do_sample=do_sample, cuda_graph=False,
                     generator=torch.Generator(device).manual_seed(0))
    finally:
        hook.remove()
    assert calls[0] == 9 and calls[3] == 1
    assert generate(model, ids, fmt, 8, backend="reference").sequences.shape == (2, 17)  # the model is unharmed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_reference_backend_generates_without_a_cuda_graph():
    """The reference codecs check their input on the host, which a CUDA graph cannot capture: by default they
    generate step by step from Python; asking for the graph is an error that names the backends that allow it."""
    model = tiny_model(4, 2, 64, layers=2).cuda()
    ids = torch.randint(3, VOCAB, (2, 9), device="cuda")
    out = generate(model, ids, KVFormat("mse", 4), 4, backend="reference")
    assert out.path == "fused" and not out.graph and out.sequences.shape == (2, 13)
    with pytest.raises(ValueError, match="cuda_graph=True needs backend='auto' or 'triton'"):
        generate(model, ids, KVFormat("mse", 4), 4, backend="reference", cuda_graph=True)
    assert generate(model, ids, KVFormat("mse", 4), 4).graph


def test_compiled_layers_generate_the_same_tokens():
    """Decoder layers under torch.compile (graph breaks at kvlab's cache update and attention) generate what the
    uncompiled model generates, and are restored after the block (the GPU runs Inductor, benchmarks/bench_generate)."""
    model = tiny_model(4, 2, 64)
    ids = torch.randint(3, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    fmt = KVFormat("mse", 4, 4, rotation="hadamard")
    plain = generate(model, ids, fmt, 6, attention_mask=mask)
    torch._dynamo.reset()
    with compiled_layers(model, backend="eager"):
        assert all("forward" in layer.__dict__ for layer in model.model.layers)
        compiled = generate(model, ids, fmt, 6, attention_mask=mask)
    assert torch.equal(plain.sequences, compiled.sequences)
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)
    hooked = model.model.layers[0].forward  # a layer with a forward of its own (as accelerate's hooks set) gets it back
    model.model.layers[0].forward = hooked
    with compiled_layers(model, backend="eager"):
        assert model.model.layers[0].forward is not hooked
    assert model.model.layers[0].__dict__["forward"] is hooked


@pytest.mark.parametrize("fmt", [KVFormat("mse", 4), KVFormat("affine", 4, 4)], ids=lambda f: f.label)
def test_model_generate_stops_at_a_nonfinite_step(fmt, device):
    """transformers' generate over a PagedKVCache (decode steps checked by default): a NaN key in the third step
    is a ValueError naming key_states, and the cache holds what it held before that step, in every layer."""
    model = tiny_model(4, 2, 64, layers=2).to(device)
    ids = torch.randint(3, VOCAB, (2, 9), device=device)
    model.set_attn_implementation("kvlab")
    cache = PagedKVCache(fmt, config=model.config, batch_size=2, max_length=32, device=device, backend="triton")
    hook, _ = poison_third_step(model, 1)
    try:
        with pytest.raises(ValueError, match="key_states"):
            model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False)
    finally:
        hook.remove()
        model.set_attn_implementation("sdpa")
    assert [layer.length for layer in cache.layers] == [9 + 2, 9 + 2]  # the prompt and two steps, not the third
    assert all(layer.seq_lens.tolist() == [11, 11] for layer in cache.layers)
    with pytest.raises(TypeError, match="check_steps"):
        PagedKVCache(fmt, config=model.config, batch_size=1, max_length=8, check_steps=1)


def test_more_bad_arguments():
    """Arguments that would fail deep inside torch, or generate silently wrong tokens, are named."""
    model = tiny_model(4, 2, 64)
    ids = torch.randint(3, VOCAB, (2, 5))
    fmt = KVFormat("mse", 4)
    right = torch.ones_like(ids)
    right[1, 3:] = 0  # a tokenizer's default: padding after the tokens
    for kwargs, error, match in [
        (dict(input_ids=torch.tensor([[1, VOCAB]])), ValueError, r"input_ids must be token ids in \[0, 256\)"),
        (dict(input_ids=torch.tensor([[1, -1]])), ValueError, "input_ids must be token ids"),
        (dict(attention_mask=right), ValueError, "left-padded .* sequence 1 has padding after a token"),
        (dict(attention_mask=2 * torch.ones_like(ids)), ValueError, "only 0 .* and 1"),
        (dict(attention_mask=torch.ones(2, 5)), TypeError, "attention_mask must hold integers or bools"),
        (dict(eos_token_id="2"), TypeError, "eos_token_id must be an int"),
        (dict(eos_token_id=VOCAB), ValueError, r"eos_token_id must be a token id in \[0, 256\)"),
        (dict(eos_token_id=2, pad_token_id=[0]), TypeError, "pad_token_id must be an int"),
        (dict(max_length="10"), TypeError, "max_length must be an int"),
        (dict(do_sample="no"), TypeError, "do_sample must be a bool"),
        (dict(cuda_graph=1), TypeError, "cuda_graph must be a bool or None"),
        (dict(model=None), TypeError, "model must be a transformers causal LM"),
        (dict(model=tiny_model(4, 2, 64, dtype=torch.float64)), TypeError, r"model must run in float16, bfloat16 or float32"),
        (dict(temperature=1e-40, do_sample=True), ValueError, "temperature must be a finite number >= 1e-3"),
        (dict(key_stats=object()), ValueError, r"key_stats is for KVFormat\('centered'"),
        (dict(transform=object()), ValueError, r"transform is for KVFormat\('transform'\)"),
        (dict(fmt=KVFormat("transform")), ValueError, r"kvlab.generate\(\.\.\., transform="),
        (dict(fmt=KVFormat("centered", 4, 4)), ValueError, r"kvlab.generate\(\.\.\., key_stats="),
    ]:
        call = dict(model=model, input_ids=ids, fmt=fmt, max_new_tokens=3) | kwargs
        with pytest.raises(error, match=match):
            generate(call.pop("model"), call.pop("input_ids"), call.pop("fmt"), call.pop("max_new_tokens"), **call)
    for bad, error in [("tpu", ValueError), ("cuda:99", ValueError)]:
        if bad.startswith("cuda") and torch.cuda.device_count() > 99:
            continue
        with pytest.raises(error, match="device must be a torch device this machine has"):
            PagedKVCache(fmt, config=model.config, batch_size=1, max_length=8, device=bad)
    with pytest.raises(TypeError, match=r"config must be a transformers model config \(model.config\)"):
        PagedKVCache(fmt, config=model, batch_size=1, max_length=8)
    with pytest.raises(ValueError, match=r"seed must be in \[-2\*\*63, 2\*\*64\)"):
        KVFormat("mse", 4, 4, seed=2**70)
    assert model.config._attn_implementation == "sdpa"
    for make in (lambda: KVCache(fmt, config=model.config),
                 lambda: PagedKVCache(fmt, config=model.config, batch_size=2, max_length=8)):
        cache = make()
        with pytest.raises(TypeError, match=r"key_states must have dtype in .* got float64: .* model.to\(torch.float32\)"):
            cache.update(torch.zeros(2, 2, 3, 64, dtype=torch.float64), torch.zeros(2, 2, 3, 64, dtype=torch.float64), 0)
        assert cache.get_seq_length() == 0


def test_the_centred_codec_generates_with_key_stats():
    from kvlab.calibration import calibrate_keys

    model = tiny_model(4, 2, 64)
    stats = calibrate_keys(model, torch.randint(3, VOCAB, (64,)), window=32)
    ids = torch.randint(3, VOCAB, (1, 6))
    out = generate(model, ids, KVFormat("centered", 4, 4), 5, key_stats=stats)
    assert out.path == "materialising"
    cache = KVCache(KVFormat("centered", 4, 4), config=model.config, key_stats=stats)
    assert torch.equal(out.sequences, model.generate(ids, cache=cache, max_new_tokens=5, do_sample=False))


class _Stop(RuntimeError):
    pass


@pytest.mark.parametrize("step", [False, True], ids=["prompt", "decode step"])
def test_a_pass_that_fails_in_any_layer_leaves_the_paged_cache_as_it_was(step, device):
    """A model with one layer more than the cache: the pass stores in layers 0 and 1, then fails at layer 2 (the
    cache's layer index check); every layer's lengths are as they were, and the right model goes on."""
    model = tiny_model(4, 2, 64).to(device)
    bigger = tiny_model(4, 2, 64, layers=3).to(device)
    for small_layer, big_layer in zip(model.model.layers, bigger.model.layers):
        big_layer.load_state_dict(small_layer.state_dict())
    cache = PagedKVCache(KVFormat("mse", 4), config=model.config, batch_size=1, max_length=40, device=device)
    for m in (model, bigger):
        m.set_attn_implementation("kvlab")
    if step:
        model(torch.randint(3, VOCAB, (1, 9), device=device), cache=cache)
    before = [(layer.seq_lens.clone(), layer.length) for layer in cache.layers]
    with pytest.raises(ValueError, match=r"layer_idx must be an int in \[0, 2\), got 2"):
        bigger(torch.randint(3, VOCAB, (1, 1 if step else 9), device=device), cache=cache)
    for layer, (s, n) in zip(cache.layers, before):
        assert torch.equal(layer.seq_lens, s) and layer.length == n
    model(torch.randint(3, VOCAB, (1, 1), device=device), cache=cache)
    assert [layer.length for layer in cache.layers] == [before[0][1] + 1] * 2
    # a pass that fails between layers outside kvlab: the next pass is an error, not a silent mix of lengths
    hook = model.model.layers[1].register_forward_pre_hook(lambda *args: (_ for _ in ()).throw(_Stop()))
    with pytest.raises(_Stop):
        model(torch.randint(3, VOCAB, (1, 1), device=device), cache=cache)
    hook.remove()
    with pytest.raises(ValueError, match="layer 1 holds .* tokens but layer 0 held .* start again with a new cache"):
        model(torch.randint(3, VOCAB, (1, 1), device=device), cache=cache)
    model.set_attn_implementation("sdpa")


def test_perplexity_refuses_a_cache_that_is_not_fresh():
    model = tiny_model(4, 2, 64, layers=1)
    ids = torch.randint(3, VOCAB, (40,))
    fmt = KVFormat("mse", 4)
    used = KVCache(fmt, config=model.config)
    with pytest.raises(ValueError, match="cache must return a fresh \\(empty\\) Cache for each window, got one holding"):
        kvlab.perplexity(model, ids, window=16, stride=8, cache=lambda: used)  # the second window gets it back
    shared = KVCache(fmt, config=model.config)
    with pytest.raises(ValueError, match="two names returned the same Cache object"):
        kvlab.perplexity(model, ids, window=16, stride=8, cache={"a": lambda: shared, "b": lambda: shared})


def test_the_triton_back_end_on_a_cpu_needs_the_interpreter(monkeypatch):
    import kvlab._checks

    monkeypatch.setattr(kvlab._checks, "interpreted", lambda: False)  # as in a user's process without TRITON_INTERPRET
    model = tiny_model(4, 2, 64, layers=1)
    ids = torch.randint(3, VOCAB, (1, 5))
    match = "backend='triton' runs kvlab's Triton kernels, which need a CUDA device .* backend='auto'"
    with pytest.raises(ValueError, match=match):
        PagedKVCache(KVFormat("mse", 4), config=model.config, batch_size=1, max_length=8, backend="triton")
    with pytest.raises(ValueError, match=match):
        generate(model, ids, KVFormat("mse", 4), 2, backend="triton")
    cache = KVCache(KVFormat("affine", 4, 4, key_axis="channel"), config=model.config, backend="triton")
    with pytest.raises(ValueError, match=match):
        model(ids, cache=cache)
    assert cache.get_seq_length() == 0
    assert model.config._attn_implementation == "sdpa"
