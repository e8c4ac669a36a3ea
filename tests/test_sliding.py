"""KVCache on a model with sliding-window layers (Gemma 3's layout, random weights): it keeps every token and the
model's masks limit what a sliding layer reads, so its outputs equal the model's own sliding cache."""

import pytest
import torch

import kvlab
from kvlab.hf.cache import KVCache, KVFormat

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_gemma():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=64, sliding_window=8, max_position_embeddings=128,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    model = Gemma3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(1))
    return model, ids


def test_sliding_layers_match_the_models_own_cache(tiny_gemma):
    model, ids = tiny_gemma
    r = kvlab.perplexity(model, ids, window=32, stride=12, chunk=4, cache={
        "model's cache": None,  # transformers' DynamicCache: sliding layers keep their last 8 tokens
        "kvlab fp32": lambda: KVCache(KVFormat("fp16"), config=model.config, dtype=None),
        "kvlab mse": lambda: KVCache(KVFormat("mse", 4, 4, rotation="hadamard"), config=model.config),
    })
    assert abs(r["kvlab fp32"].nll - r["model's cache"].nll) < 1e-5
    # the window matters: the same model attending to all tokens in every layer scores otherwise
    full = type(model)(type(model.config)(**{**model.config.to_dict(), "sliding_window": 64})).eval()
    full.load_state_dict(model.state_dict())
    assert abs(kvlab.perplexity(full, ids, window=32, stride=12, chunk=4).nll - r["model's cache"].nll) > 1e-3
    assert r["kvlab mse"].bits_per_element == pytest.approx(4 + 16 / 64)
    assert abs(r["kvlab mse"].nll - r["model's cache"].nll) < 0.1


def _mistral(sliding_window):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=97, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                            sliding_window=sliding_window, max_position_embeddings=128)).eval()


def test_the_fused_decode_refuses_sliding_layers_and_generate_materialises(tiny_gemma):
    """Sliding-window layers (Gemma 3's layer_types; Mistral's sliding_window, without layer_types): PagedKVCache
    refuses them; kvlab.generate takes the materialising path, which generates what the model's own cache does."""
    model, ids = tiny_gemma
    mistral = _mistral(8)
    for m in (model, mistral):
        with pytest.raises(ValueError, match="PagedKVCache supports models with full_attention layers only, got layer "
                                             "type 'sliding_attention' \\(the config's sliding_window\\)"):
            kvlab.PagedKVCache(KVFormat("mse", 4, 4, rotation="hadamard"), config=m.config, batch_size=1, max_length=64)
        prompt = ids[None, :20] if m is model else ids[None, 30:50]  # longer than the window of 8
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
        own = m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False)
        out = kvlab.generate(m, prompt, KVFormat("affine", 8, 8), 10)
        assert out.path == "materialising" and "sliding-window layers" in out.why
        fp16 = kvlab.generate(m, prompt, KVFormat("fp16"), 10)
        assert torch.equal(fp16.sequences, own)
    # without a window Mistral's layers are all full attention: the fused decode
    assert kvlab.generate(_mistral(None), ids[None, :8], KVFormat("mse", 4, 4), 2).path == "fused"


def test_bos_replaces_every_windows_first_token(tiny_gemma):
    model, ids = tiny_gemma
    bos = 2
    r = kvlab.perplexity(model, ids, window=32, stride=12, bos=bos)
    nll = 0.0
    for w in range(r.windows):  # each window by hand: its first token replaced
        window = ids[w * 12 : w * 12 + 32].clone()
        window[0] = bos
        nll += kvlab.perplexity(model, window, window=32, stride=12).nll
    assert r.nll == pytest.approx(nll / r.windows, rel=1e-6)
    assert abs(r.nll - kvlab.perplexity(model, ids, window=32, stride=12).nll) > 1e-4


@pytest.mark.parametrize("bos, error, match", [(97, ValueError, r"bos must be a token id in \[0, 97\)"),
                                               (-1, ValueError, "bos"), ("2", TypeError, "bos")])
def test_bad_bos(tiny_gemma, bos, error, match):
    model, ids = tiny_gemma
    with pytest.raises(error, match=match):
        kvlab.perplexity(model, ids, window=32, stride=12, bos=bos)


def test_several_rotary_embeddings_are_named(tiny_gemma):
    from kvlab.calibration import calibrate_keys
    from kvlab.transform.calibration import calibrate

    model, ids = tiny_gemma
    many = r"one rotary embedding per layer type \(full_attention, sliding_attention\).*mean='constant'"
    with pytest.raises(ValueError, match=many):
        calibrate_keys(model, ids, window=32)  # mean="rope" by default
    with pytest.raises(ValueError, match=many + r".*keys='post_rope'"):
        calibrate(model, ids, window=32, keys="pre_rope")


def test_transform_codec_after_rope_on_a_sliding_model(tiny_gemma):
    from kvlab.calibration import calibrate_keys
    from kvlab.transform.calibration import calibrate

    model, ids = tiny_gemma
    kv = calibrate(model, ids, bits=3.5, window=32, keys="post_rope", context=32, residual=4)
    assert kv.rope is None
    stats = calibrate_keys(model, ids, window=32, mean="constant")
    r = kvlab.perplexity(model, ids, window=32, stride=12, chunk=4, cache={
        "fp16": lambda: KVCache(KVFormat("fp16"), config=model.config),
        "transform": lambda: KVCache(KVFormat("transform"), config=model.config, transform=kv, sink=1, residual=4),
        "centred": lambda: KVCache(KVFormat("centered", 4, 4), config=model.config, key_stats=stats, sink=1),
    })
    for name in ("transform", "centred"):
        assert abs(r[name].nll - r["fp16"].nll) < 0.1, name


def test_model_generate_through_kvcache(tiny_gemma):
    model, ids = tiny_gemma
    prompt = ids[None, :20]  # longer than the sliding window of 8
    own = model.generate(prompt, max_new_tokens=12, do_sample=False)
    cache = KVCache(KVFormat("fp16"), config=model.config, dtype=None)
    ours = model.generate(prompt, cache=cache, max_new_tokens=12, do_sample=False)
    assert torch.equal(ours, own) and cache.get_seq_length() == 31
