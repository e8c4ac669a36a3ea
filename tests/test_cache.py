"""kvlab.KVCache on synthetic keys and values: real compressed storage, byte accounting, back ends, options."""

import pytest
import torch

from kvlab.hf.cache import KVCache, KVFormat
from kvlab.layout import MSESlot
from kvlab.affine.reference import AffineCodec
from kvlab.mse.reference import MSECodec, load_slots

B, H, D = 2, 3, 64

FORMATS = [
    KVFormat("fp16"),
    KVFormat("affine", 8),
    KVFormat("affine", 4, 3),
    KVFormat("affine", 2, key_axis="channel"),
    KVFormat("affine", 3, 2, key_axis="channel", group_size=16),
    KVFormat("affine", [8, 4, 2], [4, 3, 4]),
    KVFormat("mse", 4),
    KVFormat("mse", 3, 2, rotation="hadamard"),
]
IDS = [f.label for f in FORMATS]


def _cache(fmt, layers=1, **kwargs):
    return KVCache(fmt, num_layers=layers, num_kv_heads=H, head_dim=D, **kwargs)


def _kv(n, seed, batch=B):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, H, n, D, generator=g)
    k[..., 5] *= 8  # an outlier channel, as real keys have
    return k, torch.randn(batch, H, n, D, generator=g)


def _feed(cache, sizes, layer=0, seed=0):
    """Update one layer with calls of ``sizes`` tokens; return the inputs and the last call's output."""
    ks, vs, out = [], [], None
    for i, n in enumerate(sizes):
        k, v = _kv(n, seed + i)
        ks.append(k)
        vs.append(v)
        out = cache.update(k, v, layer)
    return torch.cat(ks, 2), torch.cat(vs, 2), out


def _expected_nbytes(cache):
    """The documented accounting: codes at the format's bits per element, the rest at the dtype's size."""
    total = 0
    for layer in cache.layers:
        elements = layer.batch * H * D
        qk, qv = layer.quantized_tokens()
        size = torch.finfo(layer.dtype).bits
        total += qk * elements * layer.fmt.key_bits_per_element(D) / 8
        total += qv * elements * layer.fmt.value_bits_per_element(D) / 8
        total += (2 * layer.length - qk - qv) * elements * size / 8
    return total


# ----------------------------------------------------------------------------- storage


def test_bits_per_element_table():
    assert KVFormat("fp16").bits_per_element(D) == 16
    assert KVFormat("affine", 4).bits_per_element(D) == 5.0  # 4 + 32 / 32
    assert KVFormat("affine", 8, group_size=64).bits_per_element(D) == 8.5
    assert KVFormat("affine", 2, key_axis="channel").key_bits_per_element(D) == 3.0  # 2 + 32 / 32 tokens
    assert KVFormat("mse", 4).bits_per_element(D) == 4.25  # (32 + 2 bytes) * 8 / 64
    assert KVFormat("mse", 3).bits_per_element(D) == 3.25
    assert KVFormat("mse", 4, 3).bits_per_element(D) == 3.75
    assert KVFormat("affine", [8, 4, 3], 4).key_bits_per_element(D) == pytest.approx((9 + 5 + 4) / 3)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_stores_codes_and_returns_their_decoding(fmt):
    """The layer holds uint8 codes; what it returns is those codes decoded by the reference codecs."""
    cache = _cache(fmt, prefill="stored", dtype=torch.float32)
    k, v, (k_out, v_out) = _feed(cache, [37, 1, 1, 25])
    layer = cache.layers[0]
    assert k_out.shape == v_out.shape == (B, H, 64, D) and layer.get_seq_length() == 64
    if fmt.codec == "fp16":
        assert torch.equal(k_out, k) and torch.equal(v_out, v)
        return
    if fmt.codec == "mse":
        assert layer.mse.cache.dtype == torch.uint8
        slots = layer.mse._slots(0, 64)
        kc, vc = load_slots(layer.mse.cache, slots, MSESlot(D, fmt.key_bits, fmt.value_bits))
        k_ref = MSECodec(D, fmt.key_bits, rotation=fmt.rotation).decode(kc).reshape(B, 64, H, D).transpose(1, 2)
        assert torch.equal(k_out, k_ref)
        assert torch.equal(kc, MSECodec(D, fmt.key_bits, rotation=fmt.rotation).encode(k.transpose(1, 2).reshape(-1, H, D)))
        return
    assert layer.k_codes.codes.dtype == torch.uint8 and layer.v_codes.codes.dtype == torch.uint8
    if fmt.key_axis == "channel":  # two full groups of 32 (or four of 16) quantized, nothing left open
        assert layer.quantized_tokens() == (64, 64) and layer.k_tail.shape[2] == 0
        codec = AffineCodec(fmt.key_bits, fmt.group_size, "channel")
        assert torch.equal(layer.k_codes.codes, codec.encode(k))
        assert torch.equal(k_out, codec.decode(layer.k_codes.codes, D))
    elif not fmt.mixed:
        codec = AffineCodec(fmt.key_bits, fmt.group_size)
        assert torch.equal(layer.k_codes.codes, codec.encode(k))
        assert torch.equal(k_out, codec.decode(layer.k_codes.codes, D))
    else:
        heads = [AffineCodec(b, fmt.group_size).encode(k[:, h]) for h, b in enumerate(fmt.key_bits)]
        assert torch.equal(layer.k_codes.codes, torch.cat(heads, -1))
    # quantization really happened: close, not equal
    assert not torch.equal(k_out, k)
    assert (k_out - k).square().mean() < 0.2 * k.square().mean()


@pytest.mark.parametrize("residual", [0, 5, 40])
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_nbytes_matches_bits_per_element(fmt, residual):
    cache = _cache(fmt, layers=2, residual=residual, keep_last=1)
    for layer in range(2):
        _feed(cache, [37, 1, 1, 8, 1], layer=layer)
    assert cache.nbytes() == _expected_nbytes(cache)
    assert cache.formats[1] == KVFormat("fp16")
    assert cache.nbytes() <= cache.allocated_nbytes()
    # with everything quantized, bytes are tokens x heads x dim x bits / 8, K and V together
    if residual == 0 and fmt.key_axis == "token":
        quantized = 2 * B * 48 * H * D * fmt.bits_per_element(D) / 8
        assert cache.layers[0].nbytes() == quantized
        assert cache.bits_per_element == pytest.approx((fmt.bits_per_element(D) + 16) / 2)
        assert cache.held_bits_per_element() == pytest.approx(cache.bits_per_element)


def test_residual_window_and_open_key_group():
    """The most recent `residual` tokens stay unquantized; channel-axis keys wait for a full group."""
    cache = _cache(KVFormat("affine", 2, key_axis="channel", group_size=16), residual=10, prefill="stored", dtype=torch.float32)
    k, v, (k_out, v_out) = _feed(cache, [30, 1, 1, 3])  # 35 tokens
    layer = cache.layers[0]
    # values: 35 - 10 quantized; keys: floor((35 - 10) / 16) * 16 = 16 quantized, 19 open
    assert layer.quantized_tokens() == (16, 25)
    assert torch.equal(k_out[:, :, 16:], k[:, :, 16:]) and not torch.equal(k_out[:, :, :16], k[:, :, :16])
    assert torch.equal(v_out[:, :, 25:], v[:, :, 25:]) and not torch.equal(v_out[:, :, :25], v[:, :, :25])


def test_fp16_parts_and_lossless_dtype():
    k, v = _kv(20, 0)
    half = _cache(KVFormat("fp16"), prefill="stored")
    k_out, _ = half.update(k, v, 0)
    assert k_out.dtype == torch.float32 and torch.equal(k_out, k.half().float())
    assert half.nbytes() == 2 * B * H * 20 * D * 2
    exact = _cache(KVFormat("fp16"), prefill="stored", dtype=None)
    k_out, _ = exact.update(k, v, 0)
    assert torch.equal(k_out, k) and exact.nbytes() == 2 * B * H * 20 * D * 4


@pytest.mark.parametrize("fmt", [KVFormat("affine", 4), KVFormat("affine", [8, 2, 4], 3), KVFormat("mse", 3)],
                         ids=lambda f: f.label)
def test_per_token_formats_do_not_depend_on_the_split(fmt):
    """One call of 40 tokens or a prompt and single steps: the same codes, the same values returned."""
    whole = _cache(fmt, prefill="stored")
    k, v = _kv(40, 0)
    k_one, v_one = whole.update(k, v, 0)
    steps = _cache(fmt, prefill="stored")
    steps.update(k[:, :, :30], v[:, :, :30], 0)
    for t in range(30, 40):
        k_steps, v_steps = steps.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
    assert torch.equal(k_one, k_steps) and torch.equal(v_one, v_steps)


def test_prefill_exact_returns_the_prompt_then_the_stored_tokens():
    cache = _cache(KVFormat("mse", 2))
    k, v = _kv(12, 0)
    k_out, v_out = cache.update(k, v, 0)
    assert k_out is k and v_out is v  # the prompt at full precision
    k2, v2 = _kv(1, 1)
    k_out, _ = cache.update(k2, v2, 0)
    assert k_out.shape[2] == 13 and not torch.equal(k_out[:, :, :12], k) and not torch.equal(k_out[:, :, 12:], k2)
    assert cache.get_seq_length() == 13 and cache.get_mask_sizes(1, 0) == (14, 0)


def test_reset_and_per_layer_formats():
    formats = [KVFormat("mse", 4), KVFormat("affine", 8), KVFormat("affine", 2, key_axis="channel")]
    cache = _cache(formats, layers=3, keep_first=1)
    assert [f.label for f in cache.formats] == ["fp16", "affine k8v8", "affine k2v2 channel-keys"]
    for layer in range(3):
        _feed(cache, [33], layer=layer)
    assert cache.get_seq_length() == 33
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0
    _feed(cache, [5], layer=0)
    assert cache.get_seq_length() == 5


def test_unsupported_operations_say_so():
    cache = _cache(KVFormat("affine", 4))
    _feed(cache, [4])
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.reorder_cache(torch.tensor([1, 0]))
    with pytest.raises(NotImplementedError, match="crop"):
        cache.crop(-1)


# ----------------------------------------------------------------------------- back ends


@pytest.mark.parametrize(
    "fmt",
    [KVFormat("affine", 4, 3), KVFormat("affine", 2, key_axis="channel", group_size=8), KVFormat("affine", [8, 4, 2], 3),
     KVFormat("mse", 4, 3), KVFormat("mse", 2, rotation="hadamard")],
    ids=lambda f: f.label,
)
def test_triton_and_reference_back_ends_agree(fmt, device):
    """Same bytes; affine values bit-equal. MSE values agree to 1e-6: the load kernel applies the norm
    correction as one scale per row (norm / |c|), the reference divides, then multiplies."""
    caches = {b: KVCache(fmt, num_layers=1, num_kv_heads=H, head_dim=D, residual=3, backend=b, dtype=None)
              for b in ("reference", "triton")}
    outs = {}
    for i, n in enumerate([19, 1, 12]):
        k, v = _kv(n, i, batch=1)
        outs = {b: c.update(k.to(device), v.to(device), 0) for b, c in caches.items()}
    ref, tri = (caches[b].layers[0] for b in ("reference", "triton"))
    assert ref.backend == "reference" and tri.backend == "triton"
    if fmt.codec == "mse":
        assert torch.equal(ref.mse.cache, tri.mse.cache)
        for a, b in zip(outs["reference"], outs["triton"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(ref.k_codes.codes, tri.k_codes.codes) and torch.equal(ref.v_codes.codes, tri.v_codes.codes)
        for a, b in zip(outs["reference"], outs["triton"]):
            assert torch.equal(a, b)
    assert ref.nbytes() == tri.nbytes()


def test_auto_back_end_follows_the_device():
    cache = _cache(KVFormat("affine", 4))
    _feed(cache, [3])
    assert cache.backend == ["reference"]


# ----------------------------------------------------------------------------- bad input


def _update(cache, shape):
    x = torch.zeros(shape)
    return cache.update(x, x, 0)


BAD = [
    ("unknown codec", lambda: KVFormat("int4", 4), ValueError, "codec"),
    ("affine bits", lambda: KVFormat("affine", 5), ValueError, "key_bits"),
    ("mse bits", lambda: KVFormat("mse", 4, 8), ValueError, "value_bits"),
    ("bits missing", lambda: KVFormat("mse"), TypeError, "key_bits"),
    ("bits not int", lambda: KVFormat("affine", 4.0), TypeError, "key_bits"),
    ("fp16 with bits", lambda: KVFormat("fp16", 4), ValueError, "key_bits"),
    ("key axis", lambda: KVFormat("affine", 4, key_axis="head"), ValueError, "key_axis"),
    ("channel keys with mse", lambda: KVFormat("mse", 4, key_axis="channel"), ValueError, "key_axis"),
    ("per-head bits on channel keys", lambda: KVFormat("affine", [4, 4, 4], key_axis="channel"), ValueError, "key_bits"),
    ("per-head bits with mse", lambda: KVFormat("mse", [4, 4, 4]), ValueError, "key_bits"),
    ("per-head bit value", lambda: KVFormat("affine", [4, 5, 4]), ValueError, r"key_bits\[1\]"),
    ("group size", lambda: KVFormat("affine", 4, group_size=12), ValueError, "group_size"),
    ("rotation", lambda: KVFormat("mse", 4, rotation="dct"), ValueError, "rotation"),
    ("bit_alloc length", lambda: _cache(KVFormat("affine", [4, 8], 4)), ValueError, "key_bits has 2 entries"),
    ("group does not divide head_dim", lambda: KVCache(KVFormat("affine", 4, group_size=48), num_layers=1, num_kv_heads=1, head_dim=64), ValueError, "group_size"),
    ("hadamard head_dim", lambda: KVCache(KVFormat("mse", 4, rotation="hadamard"), num_layers=1, num_kv_heads=1, head_dim=96), ValueError, "hadamard"),
    ("too many boundary layers", lambda: _cache(KVFormat("mse", 4), layers=4, keep_first=2, keep_last=3), ValueError, "keep_first"),
    ("negative boundary", lambda: _cache(KVFormat("mse", 4), keep_last=-1), ValueError, "keep_last"),
    ("negative residual", lambda: _cache(KVFormat("mse", 4), residual=-1), ValueError, "residual"),
    ("residual not int", lambda: _cache(KVFormat("mse", 4), residual=1.5), TypeError, "residual"),
    ("formats per layer", lambda: _cache([KVFormat("mse", 4)] * 2, layers=3), ValueError, "fmt has 2 formats"),
    ("format type", lambda: _cache("mse4"), TypeError, "fmt"),
    ("backend", lambda: _cache(KVFormat("mse", 4), backend="cuda"), ValueError, "backend"),
    ("prefill", lambda: _cache(KVFormat("mse", 4), prefill="quantized"), ValueError, "prefill"),
    ("dtype", lambda: _cache(KVFormat("mse", 4), dtype=torch.int8), TypeError, "dtype"),
    ("no dimensions", lambda: KVCache(KVFormat("mse", 4)), TypeError, "num_layers"),
    ("update head count", lambda: _update(_cache(KVFormat("mse", 4)), (1, 4, 3, D)), ValueError, "key_states"),
]


@pytest.mark.parametrize("name, call, error, match", BAD, ids=[c[0] for c in BAD])
def test_bad_input(name, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_an_older_transformers_is_refused_by_name():
    """With a transformers whose models take the cache as ``past_key_values=``, every forward would run without
    kvlab's cache: the integration refuses to load, naming the version it needs."""
    import subprocess, sys
    code = ("import transformers; transformers.__version__ = '5.17.0'\n"
            "import kvlab\n"
            "try:\n    kvlab.KVCache\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "needs transformers >= 5.24" in out and "found 5.17.0" in out


def _pass(cache, n, seed, bad_layer=None):
    """One forward pass: every layer updated in turn with ``n`` tokens (layer ``bad_layer`` given a NaN key)."""
    outs = []
    for layer in range(len(cache.layers)):
        k, v = _kv(n, seed + layer)
        if layer == bad_layer:
            k[0, 1, n - 1, 3] = float("nan")
        outs.append(cache.update(k, v, layer))
    return outs


@pytest.mark.parametrize("decode_view", [False, True])
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_a_pass_that_fails_in_a_later_layer_leaves_every_layer_as_it_was(fmt, decode_view):
    kwargs = dict(residual=3, sink=1) if fmt.codec != "fp16" else {}
    failed, clean = (_cache(fmt, layers=3, **kwargs) for _ in range(2))
    for cache in (failed, clean):
        cache.decode_view = decode_view
        _pass(cache, 7, seed=0)
    with pytest.raises(ValueError, match="key_states"):
        _pass(failed, 5, seed=10, bad_layer=2)
    assert [layer.length for layer in failed.layers] == [7, 7, 7]
    assert failed.nbytes() == clean.nbytes()
    for a, b in zip(_pass(failed, 5, seed=20), _pass(clean, 5, seed=20)):  # the next pass reads the same cache
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_layer_index_the_cache_does_not_have_is_named():
    cache = _cache(KVFormat("mse", 4), layers=2)
    _pass(cache, 7, seed=0)
    with pytest.raises(ValueError, match=r"layer_idx must be in \[0, 2\) .* got 2: build the cache from the config"):
        cache.update(*_kv(1, 5), 2)  # a model with more layers than the cache
    assert [layer.length for layer in cache.layers] == [7, 7]


def test_config_must_be_a_config():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1, head_dim=64))
    with pytest.raises(TypeError, match=r"config must be a transformers model config \(model.config\), got LlamaForCausalLM"):
        KVCache(KVFormat("mse", 4), config=model)
