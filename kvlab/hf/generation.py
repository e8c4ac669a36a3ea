"""Generating with a quantized cache: ``kvlab.generate(model, input_ids, fmt, max_new_tokens)``.

``kvlab.generate`` generates with the keys and values of every layer stored by a kvlab codec in a
``PagedKVCache`` (``kvlab.hf.paged``: the prompt attends at full precision and is stored, every decode step's
attention reads the codes with ``decode_attention``), or through ``KVCache`` (the materialising path) for
formats the fused decode does not read. On a CUDA GPU it runs each decode step of the whole model as one
CUDA graph replay, and with ``compile=True`` the decoder layers compiled around kvlab's attention
(``compiled_layers``). ``replay_logits`` reads the same codes through both attention paths.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.masking_utils import AttentionMaskInterface

from .. import _checks as C
from .cache import KVCache, KVFormat, layer_types, model_shape
from .paged import ATTENTION, PagedKVCache, fused_support, in_fused_layout

__all__ = ["ATTENTION", "GenerateOutput", "PagedKVCache", "compiled_layers", "fused_support", "generate", "replay_logits"]


# ----------------------------------------------------------------------------- generate


@dataclass
class GenerateOutput:
    """``sequences``: ``[B, prompt + new]`` token ids (prompt as given); ``cache``: the cache generated into;
    ``path``: ``"fused"`` (``decode_attention``) or ``"materialising"`` (``KVCache``), and ``why`` the latter."""

    sequences: torch.Tensor
    cache: Cache
    path: str
    why: str | None = None
    graph: bool = False


def _next_token(logits: torch.Tensor, do_sample: bool, temperature: float, generator) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(-1)
    logits = torch.where(torch.isfinite(logits).all(-1, keepdim=True), logits.float(), 0.0)  # flagged, not sampled
    probs = torch.softmax(logits / temperature, -1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, fmt: KVFormat, max_new_tokens: int, *, attention_mask=None,
             do_sample: bool = False, temperature: float = 1.0, generator: torch.Generator | None = None,
             eos_token_id: int | None = None, pad_token_id: int | None = None, cuda_graph: bool | None = None,
             backend: str = "auto", block_size: int = 16, max_length: int | None = None,
             transform=None, key_stats=None, compile: bool = False) -> GenerateOutput:
    """Generate ``max_new_tokens`` tokens per sequence with the KV cache stored as ``fmt``.

    ``input_ids`` ``[B, T]`` (left-padded where ``attention_mask`` ``[B, T]`` has zeros). Formats the
    fused decode reads (``fused_support``) generate through ``PagedKVCache`` and ``decode_attention``;
    the others through ``KVCache`` (the stored tokens decoded for every step, SDPA). ``cuda_graph``
    (default: on a CUDA device with the fused path and kvlab's kernels, not ``backend="reference"``)
    replays each decode step of the whole model from one CUDA graph. Greedy by default; ``do_sample``
    samples from ``softmax(logits / temperature)``.
    After ``eos_token_id`` a sequence's tokens are ``pad_token_id`` (default: the EOS id).
    ``KVFormat("transform")`` needs ``transform``, the calibrated codecs (``kvlab.transform.TransformKV``). Codecs in
    the fused layout (``calibrate(..., layout="fused")``) generate through the fused decode, their 16-bit sink and
    recent tokens merged with it, each step replayed from a CUDA graph; other codecs calibrated to keep tokens in
    16 bit (``calibrate``'s default ``sink=1, residual=16``) generate through ``KVCache``, which keeps them; other
    codecs without such tokens through the fused decode, whose steps replay from a CUDA graph only when
    ``cuda_graph=True`` is asked for. ``KVFormat("centered", ...)``
    needs ``key_stats`` (``kvlab.calibration.calibrate_keys``). Models with sliding-window layers generate through
    ``KVCache``. ``compile=True`` (with the
    CUDA graph) runs the decoder layers compiled by ``torch.compile`` around kvlab's attention (``compiled_layers``):
    fewer, fused kernels per step, after a compile of tens of seconds on first use.
    """
    C.check_tensor("input_ids", input_ids, (torch.int64, torch.int32))
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, prompt_tokens] with at least one token, got {tuple(input_ids.shape)}")
    C.check_int("max_new_tokens", max_new_tokens, minimum=1)
    if not isinstance(fmt, KVFormat):
        raise TypeError(f"fmt must be a kvlab.KVFormat, got {type(fmt).__name__}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 1e-3 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 1e-3 (greedy: do_sample=False), got {temperature!r}")
    batch, prompt = input_ids.shape
    device = input_ids.device
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if generator.device.type != device.type:
            raise ValueError(f"generator is on {generator.device.type}, input_ids on {device.type}: sampling draws "
                             f"on input_ids' device, so pass torch.Generator({device.type!r})")
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers causal LM (a torch.nn.Module with a config), "
                        f"got {type(model).__name__}")
    C.check_model_dtype(model)
    C.check_bool("do_sample", do_sample)
    C.check_bool("cuda_graph", cuda_graph, optional=True)
    if max_length is not None:
        C.check_int("max_length", max_length, minimum=1)
    vocab = C.vocabulary(model)
    C.check_token_ids("input_ids", input_ids, vocab)
    for name, token in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if token is not None:
            C.check_token_id(name, token, vocab)
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}")
        if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
            raise TypeError(f"attention_mask must hold integers or bools (1: token, 0: padding), got {attention_mask.dtype}")
        if attention_mask.device != device:
            raise ValueError(f"attention_mask must be on input_ids' device ({device}), got {attention_mask.device}")
        mask = attention_mask.long()
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
        padded_after = (mask[:, 1:] < mask[:, :-1]).any(1)  # a 0 after a 1: right padding
        if bool(padded_after.any()):
            row = int(padded_after.nonzero()[0])
            raise ValueError(f"attention_mask must be left-padded (zeros before the tokens): sequence {row} has padding "
                             f"after a token (a tokenizer pads on the left with tokenizer.padding_side = 'left')")
        if bool((mask.sum(1) == 0).any()):
            raise ValueError("attention_mask has a sequence with no tokens")
        if bool(mask.all()):
            attention_mask = None
    config = model.config
    _, kv_heads, head_dim = model_shape(config, "kvlab.generate", sliding=True)
    if fmt.codec == "transform" and transform is None:
        raise ValueError("KVFormat('transform') needs the calibrated codecs: kvlab.generate(..., transform="
                         "kvlab.transform.calibration.calibrate(model, calibration_ids))")
    if key_stats is not None and fmt.codec != "centered":
        raise ValueError(f"key_stats is for KVFormat('centered', ...), not {fmt!r}")
    if transform is not None and fmt.codec != "transform":
        raise ValueError(f"transform is for KVFormat('transform'), not {fmt!r}")
    if fmt.codec == "centered" and key_stats is None:
        raise ValueError("KVFormat('centered', ...) needs the keys' channel statistics: kvlab.generate(..., "
                         "key_stats=kvlab.calibration.calibrate_keys(model, calibration_ids))")
    why = fused_support(fmt, head_dim)
    held = (getattr(transform, "sink", 0), getattr(transform, "residual", 0)) if fmt.codec == "transform" else (0, 0)
    fused_codes = fmt.codec == "transform" and in_fused_layout(transform, kv_heads)
    if why is None and any(held) and not fused_codes:
        why = (f"the transform codecs keep the first {held[0]} and the last {held[1]} tokens in 16 bit, as calibrated; "
               f"the fused decode reads them with codes in the fused layout only (calibrate(..., layout='fused'))")
    if why is None and "sliding_attention" in layer_types(config):
        why = "the model has sliding-window layers; the fused decode attends to every stored token"
    total = prompt + max_new_tokens
    if max_length is None:
        max_length = total
    elif max_length < total:
        raise ValueError(f"max_length ({max_length}) must hold the prompt and the new tokens ({total})")
    fused_here = why is None
    if cuda_graph is None:
        cuda_graph = fused_here and device.type == "cuda" and (fmt.codec != "transform" or fused_codes) \
            and backend != "reference"
    if cuda_graph and not (fused_here and device.type == "cuda"):
        raise ValueError("cuda_graph=True needs the fused path on a CUDA device")
    if cuda_graph and backend == "reference":
        raise ValueError("cuda_graph=True needs backend='auto' or 'triton': the reference codecs check their input "
                         "on the host, which a CUDA graph cannot capture")
    C.check_bool("compile", compile)
    if compile and not cuda_graph:
        raise ValueError("compile=True needs cuda_graph (the fused path on a CUDA device)")
    previous = config._attn_implementation
    if why is None:
        cache = PagedKVCache(fmt, config=config, batch_size=batch, max_length=max_length, device=device,
                             block_size=block_size, backend=backend, transform=transform, check_steps=False)
        model.set_attn_implementation(ATTENTION)
        path = "fused"
    else:
        cache = KVCache(fmt, config=config, backend=backend, transform=transform, key_stats=key_stats)
        model.set_attn_implementation("sdpa")
        path = "materialising"
    try:
        tokens = _generate(model, cache, input_ids, attention_mask, max_new_tokens, do_sample, temperature, generator,
                           cuda_graph, compile)
    finally:
        model.set_attn_implementation(previous)
    if eos_token_id is not None:
        pad = eos_token_id if pad_token_id is None else pad_token_id
        done = (tokens == eos_token_id).int().cumsum(1) - (tokens == eos_token_id).int() > 0
        tokens = tokens.masked_fill(done, pad)
    return GenerateOutput(torch.cat([input_ids, tokens], 1), cache, path, why, bool(cuda_graph))


@contextlib.contextmanager
def compiled_layers(model, **options):
    """Within the block, each decoder layer of ``model`` runs compiled by ``torch.compile`` (Inductor, or what
    ``options`` ask of ``torch.compile``): its norms, projections, RoPE, residual adds and MLP as fused kernels;
    kvlab's cache update and attention run between the compiled pieces, eagerly (they are
    ``torch.compiler.disable``-d). Compiled once per layer and input shape; the layers are as they were after
    the block. A decode step is then captured in a CUDA graph as usual."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError("compile=True needs a transformers model whose decoder holds its layers in .layers")
    limits = {k: max(8 * len(layers), 64) for k in ("recompile_limit", "accumulated_recompile_limit")
              if hasattr(torch._dynamo.config, k)}
    own = [layer.__dict__.get("forward") for layer in layers]  # a layer's own forward (e.g. a hook's), else None
    try:
        for layer in layers:
            layer.forward = torch.compile(layer.forward, **{"dynamic": False, **options})
        with torch._dynamo.config.patch(**limits):
            yield model
    finally:
        for layer, forward in zip(layers, own):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


def _positions(attention_mask, batch: int, prompt: int, device) -> torch.Tensor:
    if attention_mask is None:
        return torch.arange(prompt, device=device).expand(batch, prompt)
    return (attention_mask.long().cumsum(1) - 1).clamp_min(0)


def _generate(model, cache, input_ids, attention_mask, max_new_tokens, do_sample, temperature, generator, cuda_graph,
              compile=False):
    batch, prompt = input_ids.shape
    device = input_ids.device
    pos = _positions(attention_mask, batch, prompt, device)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, cache=cache, use_cache=True,
                logits_to_keep=1)
    tokens = torch.empty(batch, max_new_tokens, dtype=torch.long, device=device)
    # Decode steps store and read without a host sync: a non-finite logit of any step (NaN or Inf keys, values or
    # activations, a norm beyond fp16's range) is flagged on the device and raised once, after the last step.
    bad = ~torch.isfinite(out.logits[:, -1]).all(-1)  # [B]
    tokens[:, 0] = _next_token(out.logits[:, -1], do_sample, temperature, generator)
    next_pos = pos[:, -1:] + 1  # [B, 1]
    mask = attention_mask

    def step(ids, position, mask):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position, cache=cache, use_cache=True,
                       logits_to_keep=1).logits[:, -1]
        bad.logical_or_(~torch.isfinite(logits).all(-1))
        return logits

    if not cuda_graph:
        for i in range(1, max_new_tokens):
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(batch, 1)], 1)
            logits = step(tokens[:, i - 1 : i], next_pos, mask)
            tokens[:, i] = _next_token(logits, do_sample, temperature, generator)
            next_pos = next_pos + 1
        return _finite(tokens, bad)
    if max_new_tokens == 1:
        return _finite(tokens, bad)
    with compiled_layers(model) if compile else contextlib.nullcontext():
        return _replay(model, cache, tokens, next_pos, step, do_sample, temperature, generator, bad, max_new_tokens)


def _replay(model, cache, tokens, next_pos, step, do_sample, temperature, generator, bad, max_new_tokens):
    """Decode steps 1.. of ``_generate``: one eager step (builds every device table, compiles), then the step
    captured once in a CUDA graph and replayed."""
    static_ids = tokens[:, :1].clone()
    static_pos = next_pos.clone()
    logits = step(static_ids, static_pos, None)
    tokens[:, 1] = _next_token(logits, do_sample, temperature, generator)
    if max_new_tokens == 2:
        return _finite(tokens, bad)
    static_ids.copy_(tokens[:, 1:2])
    static_pos += 1
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            static_logits = step(static_ids, static_pos, None)
    torch.cuda.current_stream().wait_stream(stream)
    # capturing recorded the step without running it: the host counts are one ahead of the device's
    cache.advance(-1)
    for i in range(2, max_new_tokens):
        graph.replay()
        cache.advance(1)
        tokens[:, i] = _next_token(static_logits, do_sample, temperature, generator)
        static_ids.copy_(tokens[:, i : i + 1])
        static_pos += 1
    return _finite(tokens, bad)


def _finite(tokens: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``tokens``, once the device-side flags of every step say that all logits were finite (one host sync)."""
    if bool(bad.any()):
        which = bad.nonzero().flatten().tolist()
        raise ValueError(f"generation produced NaN or Inf logits for sequence(s) {which}: a key, value or activation "
                         "was NaN or Inf, or a key or value beyond the range the cache stores (fp16 norms and 16-bit "
                         "parts); the tokens generated are not returned")
    return tokens


# ----------------------------------------------------------------------------- the same codes, read two ways


@torch.no_grad()
def replay_logits(model, cache: PagedKVCache, sequences: torch.Tensor, path: str = "fused",
                  backend: str | None = None) -> torch.Tensor:
    """Logits ``[B, T, vocab]`` of ``sequences`` ``[B, T]`` with every layer attending over the codes ``cache`` holds.

    Position ``t`` of sequence ``b`` attends causally over the stored tokens ``0 .. t`` of that sequence; nothing is
    stored (the codes stay as they are), so both paths read exactly the same cache contents. ``path="fused"``:
    ``decode_attention`` for every position at once (one query per position, as a batch); ``"materialising"``:
    ``prefill_attention`` (model-space K/V from one inverse rotation, then SDPA). The cache must hold at least ``T``
    tokens of every sequence, unpadded (as ``kvlab.generate`` leaves it without an attention mask). ``backend``:
    ``"triton"`` or ``"reference"`` (default: the cache's).
    """
    C.check_choice("path", path, ("fused", "materialising"))
    if backend is not None:
        C.check_choice("backend", backend, ("triton", "reference"))
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a kvlab.PagedKVCache, got {type(cache).__name__}")
    C.check_tensor("sequences", sequences, (torch.int64, torch.int32))
    batch, T = sequences.shape
    if batch != cache.batch or bool((cache.layers[0].seq_lens < T).any()):
        raise ValueError(f"sequences must be [{cache.batch}, T] with T at most the tokens the cache holds, "
                         f"got {tuple(sequences.shape)}")

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = cache.layers[module.layer_idx]
        b, hq, n, dim = query.shape
        scale = dim**-0.5 if scaling is None else float(scaling)
        lens = torch.arange(1, n + 1, dtype=torch.int32, device=query.device).repeat(b)  # position t sees t + 1 tokens
        table = cache.block_table.repeat_interleave(n, 0)
        q = query.transpose(1, 2).reshape(b * n, hq, dim)
        if path == "fused":
            out = layer.decode(q, scale, table, lens, backend)
        else:  # one query per row: the last token of a sequence of lens[i] tokens
            out = layer.prefill(q[:, None], scale, table, lens, backend)[:, 0]
        return out.view(b, n, hq, dim), None

    name = f"kvlab-replay-{path}"
    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, lambda *a, **k: None)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        return model(input_ids=sequences, use_cache=False).logits
    finally:
        model.set_attn_implementation(previous)
