"""kvlab.perplexity's decode view: chunked evaluation equal to token-by-token decoding (tiny random Llama, CPU)."""

import pytest
import torch

import kvlab.hf.model as M
from kvlab.hf.cache import KVCache, KVFormat
from kvlab.hf.decode_view import NEVER, quantized_from
from kvlab.study.simulated import Part, SimulatedCache, mse_part

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW, STRIDE = 40, 24  # a prompt of 15 tokens, 24 scored tokens per window


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                      initializer_range=0.1)  # sharper attention than the default 0.02: windows matter
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (WINDOW + STRIDE,), generator=torch.Generator().manual_seed(1))
    return model, ids


def smooth_part() -> Part:
    """A stand-in codec without rounding decisions: a float difference cannot flip a code."""
    return Part(lambda x, pos: 0.7 * x.float() + 0.05 * torch.sin(3 * x.float()), 4.0, "smooth")


def nll(model, ids, make, *, chunk, decode_view):
    r = M.perplexity(model, ids, window=WINDOW, stride=STRIDE, chunk=chunk, cache=make, decode_view=decode_view)
    return r.nll


def test_quantized_from():
    # per token: from which cache length a decoder reads it through the codec
    assert quantized_from(6, sink=0, residual=0).tolist() == [1, 2, 3, 4, 5, 6]
    assert quantized_from(6, sink=1, residual=2).tolist() == [NEVER, 4, 5, 6, 7, 8]
    assert quantized_from(7, sink=1, residual=0, unit=3).tolist() == [NEVER, 4, 4, 4, 7, 7, 7]
    assert quantized_from(3, sink=0, residual=0, quantized=False).tolist() == [NEVER] * 3


@pytest.mark.parametrize("residual, sink, chunk", [(5, 0, 7), (5, 1, 24), (1, 1, 5), (8, 0, 8), (60, 1, 7)],
                         ids=lambda v: str(v))
def test_chunked_decode_view_equals_token_by_token_smooth_codec(tiny, residual, sink, chunk):
    """A codec without rounding flips: the decode view, chunk by chunk, equals one token at a time to float
    rounding; the view of each call as it stands after its write does not (unless the window covers it all)."""
    model, ids = tiny
    make = lambda: SimulatedCache([(smooth_part(), smooth_part())] * 3, residual=residual, sink=sink)
    step = nll(model, ids, make, chunk=1, decode_view=False)
    assert nll(model, ids, make, chunk=1, decode_view=True) == step  # one token per call: nothing to pick
    view = nll(model, ids, make, chunk=chunk, decode_view=True)
    assert abs(view - step) < 2e-6 * step, (view, step)
    stale = nll(model, ids, make, chunk=chunk, decode_view=False)
    if residual < WINDOW:
        assert abs(stale - step) > 100 * 2e-6 * step, (stale, step)


FORMATS = {
    "mse3": KVFormat("mse", 3),
    "affine4": KVFormat("affine", 4, group_size=32),
    "kivi2-group8": KVFormat("affine", 2, key_axis="channel", group_size=8),
}


@pytest.mark.parametrize("residual, sink", [(0, 0), (0, 1), (5, 0), (6, 1), (60, 1)], ids=lambda v: str(v))
@pytest.mark.parametrize("name", list(FORMATS))
def test_chunked_decode_view_equals_token_by_token_kvcache(tiny, name, residual, sink):
    """kvlab's stored codecs, windows that do not divide the chunk, longer than the context, sink 0 and 1, KIVI's
    open key group: chunked decode view against one token at a time. Float rounding differs (another chunking),
    and a code that it flips would move the result by a quantization step, so the tolerance is 100 times the
    rounding seen here; the window's effect (the view of each call after its write) is larger still."""
    model, ids = tiny
    tol = 2e-5
    make = lambda: KVCache(FORMATS[name], config=model.config, residual=residual, sink=sink)
    step = nll(model, ids, make, chunk=1, decode_view=False)
    view = nll(model, ids, make, chunk=7, decode_view=True)
    assert abs(view - step) < tol * step, (view, step)
    window = residual or FORMATS[name].key_axis == "channel"  # KIVI's open key group is a window too
    if window and residual < WINDOW:
        stale = nll(model, ids, make, chunk=7, decode_view=False)
        assert abs(stale - step) > 5 * tol * step, (stale, step)


@pytest.mark.parametrize("make", [
    lambda cfg: KVCache(KVFormat("mse", 3), config=cfg),
    lambda cfg: KVCache(KVFormat("affine", 3), config=cfg, sink=2),
    lambda cfg: SimulatedCache([(mse_part(32, 2), mse_part(32, 3))] * 3, sink=1),
], ids=["mse3", "affine3-sink2", "simulated-sink1"])
def test_without_a_window_the_decode_view_changes_nothing(tiny, make):
    model, ids = tiny
    for chunk in (24, 7):
        assert (nll(model, ids, lambda: make(model.config), chunk=chunk, decode_view=True)
                == nll(model, ids, lambda: make(model.config), chunk=chunk, decode_view=False))


def test_decode_view_is_the_default_and_dict_runs_agree(tiny):
    model, ids = tiny
    caches = {"mse": lambda: KVCache(KVFormat("mse", 3), config=model.config, residual=5, sink=1),
              "sim": lambda: SimulatedCache([(smooth_part(), smooth_part())] * 3, residual=5)}
    together = M.perplexity(model, ids, window=WINDOW, stride=STRIDE, cache=caches)
    for name, make in caches.items():
        assert together[name].nll == nll(model, ids, make, chunk=STRIDE, decode_view=True)


def test_decode_view_is_set_before_the_first_update(tiny):
    model, ids = tiny
    cache = KVCache(KVFormat("mse", 3), config=model.config, residual=4)
    with torch.no_grad():
        model(ids[None, :8], cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="before the cache holds tokens"):
        cache.decode_view = True
    with pytest.raises(TypeError, match="decode_view must be a bool"):
        M.perplexity(model, ids, window=WINDOW, stride=STRIDE, decode_view=1)
