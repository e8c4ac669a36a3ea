"""Decode steps of a whole model: kvlab's paged cache and fused decode against transformers' fp16 caches.

A Llama at the Llama-3-8B shape (32 layers, hidden 4096, 32 query heads, 8 KV heads, head_dim 128,
vocab 32000 here) with random fp16 weights made on the GPU: no download. A decode step's time does not
depend on the cached values, so each cache is filled straight with ``context`` random tokens (kvlab
caches: random keys and values through the store kernel; transformers' caches: random tensors through
``update``), then ``steps`` greedy decode steps run (16 for a step called from Python), each timed with CUDA
events; the median is reported.

Rows, at every (batch, context) point of the grid, in one run:
- ``fp16 roofline``: the fastest fp16 step built here (``RooflineStep``): the same weights (Q/K/V and gate/up
  each one matrix), keys and values preallocated as ``StaticCache`` holds them, attention = torch SDPA over the
  filled length only (no mask; at each point the fastest of SDPA's forms and backends, named in ``config``), the
  whole step replayed from a CUDA graph; ``fp16 roofline compiled`` (with ``--compiled``): the same with the work
  before and after the attention compiled by ``torch.compile`` (one function each, shared by the 32 layers). The
  script's checks compare its logits with transformers' ``StaticCache`` step;
- ``fp16 DynamicCache``: transformers' default cache, SDPA, eager (what ``model.generate`` does);
- ``fp16 StaticCache``: transformers' static cache, SDPA, eager and replayed from a CUDA graph (the
  whole step captured once: the fastest fp16 decode transformers offers without a compiler);
- kvlab formats (``PagedKVCache``, attention ``"kvlab"``: ``decode_attention`` on the codes), eager
  and CUDA graph;
- with ``--compiled``: ``<kvlab format> compiled`` (the decoder layers compiled around kvlab's attention,
  ``kvlab.generate(..., compile=True)``, then the CUDA graph); ``fp16 StaticCache compiled`` (``torch.compile``
  of the whole forward, Inductor, then the step captured in a CUDA graph) only when ``--names`` asks for it.
The run measures the device's copy bandwidth (``copy_gbps``: a 4 GiB device-to-device copy, bytes read and
written, the best of five medians) and gives every row its byte floor, ``floor_ms``: the bytes a step must read
(the weights, the embedding's rows of the batch only, and the keys and values of the filled length in the row's
format) at that bandwidth, and ``share_of_floor`` = ``floor_ms`` / ``ms_per_step``. ``speedup_vs_fp16`` is
against the fastest fp16 row of the point (``fp16_baseline`` names it), and ``byte_ceiling`` is the most a
format could gain on bytes alone, (weights + fp16 KV) / (weights + its KV).
Where a cache does not fit on the device, the row says so (``status=oom``). ``--capacity`` adds, for
context 32k, the largest batch that fits in ``--budget-gib`` GiB for each cache (KV bytes per sequence
and the weights; each kvlab figure checked by one decode step at that batch). Also measured: one
prefill (batch 1, 4096 tokens), and checks on a small random model (the fused path's tokens equal the
materialising path's; graph replay equals eager; compiled layers against the graph; the roofline step's logits
against transformers' ``StaticCache`` step's).

    python -m benchmarks.bench_generate --out results --compiled   # -> results/generate.csv, generate.json
    python -m benchmarks.bench_generate --compiled --points 8:32768 --parts grid   # one point, no extras
    python -m benchmarks.bench_generate --smoke                # tiny shapes, a quick check of the script
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import kvlab
from kvlab import KVCache, KVFormat
from kvlab.hf.generation import PagedKVCache, compiled_layers

FORMATS = {
    "kvlab mse k4v4": KVFormat("mse", 4, 4, rotation="hadamard"),
    "kvlab mse k3v3": KVFormat("mse", 3, 3, rotation="hadamard"),
    "kvlab mse k2v2": KVFormat("mse", 2, 2, rotation="hadamard"),
    "kvlab affine k4v4": KVFormat("affine", 4, 4),
}
# calibrated transform codes in the fused layout (kvlab.transform.fused): random per-head transforms and uniform levels
# of a calibrated codec's bytes, the first token and the last 16 kept in fp16; (8-bit, 4-bit, 2-bit) components
FUSED = {"kvlab fused 3.5": (0, 96, 32), "kvlab fused 2.5": (0, 32, 96)}
FUSED_SINK, FUSED_RESIDUAL = 1, 16
COMPILED = "fp16 StaticCache compiled"
ROOFLINE = "fp16 roofline"
SUFFIX = " compiled"  # a kvlab row with this suffix: decoder layers compiled (kvlab.hf.generation.compiled_layers)
GRID = [(1, 4096), (8, 4096), (32, 4096), (1, 32768), (8, 32768), (32, 32768), (1, 131072), (8, 131072)]
KEYS = ["cache", "mode", "batch", "context", "status", "ms_per_step", "tokens_per_s", "kv_gib", "peak_gib",
        "floor_ms", "share_of_floor", "speedup_vs_fp16", "fp16_baseline", "byte_ceiling", "config"]
PARTS = ("grid", "capacity", "prefill", "checks")


def llama(smoke: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    if smoke:
        cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=1 << 18)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=1 << 18,
                          rope_theta=500000.0)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(default)
    for p in model.parameters():  # small weights keep activations finite through 32 random layers
        p.data.normal_(0, 0.02)
    return model


def kv_token_bytes(name: str, cfg) -> float:
    """Bytes of K and V per token per sequence, every layer."""
    d, h, n = cfg.head_dim, cfg.num_key_value_heads, cfg.num_hidden_layers
    if name.startswith("fp16"):
        return 2 * 2 * d * h * n
    if name.removesuffix(SUFFIX) in FUSED:  # the codes of the fused layout (the fp16 tokens are a constant)
        counts = FUSED[name.removesuffix(SUFFIX)]
        return 2 * sum(c * w for c, w in zip(counts, (8, 4, 2))) / 8 * h * n
    return 2 * FORMATS[name.removesuffix(SUFFIX)].bits_per_element(d) / 8 * d * h * n


def weight_read_bytes(model, batch: int) -> int:
    """Bytes of weights a decode step reads: every parameter, of the embedding table only the batch's rows."""
    emb = model.get_input_embeddings().weight
    return (sum(p.numel() * p.element_size() for p in model.parameters())
            - emb.numel() * emb.element_size() + batch * emb.shape[1] * emb.element_size())


def floor_ms(name: str, cfg, weight_bytes: int, batch: int, context: int, copy_gbps: float) -> float:
    """The byte floor of a step (ms): the weights it reads and the keys and values of ``context`` tokens in the
    row's format, at the measured copy bandwidth."""
    return (weight_bytes + kv_token_bytes(name, cfg) * batch * context) / (copy_gbps * 1e6)


def fuse_projections(model) -> None:
    """Q/K/V and gate/up of every layer as one matrix each; the model's own projections become views of it
    (the same values, no second copy). Idempotent."""
    for layer in model.model.layers:
        for owner, names, fused in ((layer.self_attn, ("q_proj", "k_proj", "v_proj"), "roofline_qkv"),
                                    (layer.mlp, ("gate_proj", "up_proj"), "roofline_gate_up")):
            if hasattr(owner, fused):
                continue
            linears = [getattr(owner, n) for n in names]
            assert all(lin.bias is None for lin in linears), "the roofline step takes projections without bias"
            w = torch.cat([lin.weight.data for lin in linears])
            start = 0
            for lin in linears:
                n = lin.weight.shape[0]
                lin.weight.data = w[start:start + n]
                start += n
            setattr(owner, fused, w)


def _rms(x, weight, eps: float):
    """transformers' LlamaRMSNorm: in fp32, back to the input's dtype, times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def before_attention(x, norm, eps: float, w_qkv, cos, sin, hq: int, hkv: int):
    """RMSNorm, the Q/K/V product, RoPE: the query ``[B, Hkv, Hq/Hkv, D]`` (the query group of a KV head as
    SDPA's query axis), the new key and value ``[B, Hkv, 1, D]``."""
    b, d = x.shape[0], cos.shape[-1]
    qkv = torch.nn.functional.linear(_rms(x, norm, eps), w_qkv).view(b, hq + 2 * hkv, d)
    c, s = cos.view(b, 1, d), sin.view(b, 1, d)
    q = _rope(qkv[:, :hq], c, s)
    k = _rope(qkv[:, hq:hq + hkv], c, s)
    return q.view(b, hkv, hq // hkv, d), k.unsqueeze(2), qkv[:, hq + hkv:].unsqueeze(2)


def after_attention(x, attn, w_o, norm, eps: float, w_gate_up, w_down):
    """The output projection and residual, RMSNorm, the gated MLP (gate and up one product) and residual."""
    F = torch.nn.functional
    h = x + F.linear(attn.reshape(x.shape[0], 1, -1), w_o)
    gate, up = F.linear(_rms(h, norm, eps), w_gate_up).chunk(2, -1)
    return h + F.linear(F.silu(gate) * up, w_down)


_COMPILED = {}


def _compiled(fn):
    """``fn`` under ``torch.compile`` (Inductor, static shapes): one compilation per batch size, shared by every
    layer and point."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False, fullgraph=True)
    return _COMPILED[fn]


SDPA_FORMS = ("q group as query axis", "enable_gqa")
SDPA_BACKENDS = ("default", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


class RooflineStep:
    """The fastest fp16 decode step built here, over the model's own weights (``fuse_projections``): keys and
    values preallocated ``[batch, kv heads, max_len, head_dim]`` per layer as ``StaticCache`` holds them, the new
    token's written at its position, and attention = torch SDPA over the filled length only (no mask: one query
    token attends to every cached one). ``attention``: (form, backend) of the SDPA call (``SDPA_FORMS``,
    ``SDPA_BACKENDS``); ``compile``: the work before and after the attention under ``torch.compile``.

    A call takes the ids ``[batch, 1]`` and positions ``[batch, 1]`` (one position for the batch) and returns the
    logits ``[batch, 1, vocab]``. The filled length is a Python number: a CUDA graph captures the step at one
    length, and each replay writes the new token at the position it is given and attends over the length of the
    capture (64 replays move a 32k context by 0.2 %: the bytes, not the values, set a step's time)."""

    def __init__(self, model, batch: int, max_len: int, compile: bool = False,
                 attention: tuple[str, str] = (SDPA_FORMS[0], "default")):
        fuse_projections(model)
        cfg = model.config
        self.model, self.batch, self.compile, self.attention = model, batch, compile, attention
        self.hq, self.hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        w = model.get_input_embeddings().weight
        shape = (batch, self.hkv, max_len, cfg.head_dim)
        self.keys = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in model.model.layers]
        self.values = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in model.model.layers]
        self.length = 0

    def fill(self, keys, values) -> None:
        """The same ``keys``, ``values`` ``[batch, kv heads, n, head_dim]`` as the first n tokens of every layer."""
        n = keys.shape[2]
        for k, v in zip(self.keys, self.values):
            k[:, :, :n].copy_(keys)
            v[:, :, :n].copy_(values)
        self.length = n

    def attend(self, q, layer: int, length: int):
        """SDPA of the query ``[B, Hkv, G, D]`` over the first ``length`` tokens of a layer: ``[B, Hkv, G, D]``."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        k, v = self.keys[layer][:, :, :length], self.values[layer][:, :, :length]
        form, backend = self.attention
        if form == "enable_gqa":
            b, hkv, g, d = q.shape
            call = lambda: sdpa(q.reshape(b, hkv * g, 1, d), k, v, enable_gqa=True).view(b, hkv, g, d)  # noqa: E731
        else:
            call = lambda: sdpa(q, k, v)  # noqa: E731
        if backend == "default":
            return call()
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return call()

    def __call__(self, ids, pos):
        m = self.model.model
        before = _compiled(before_attention) if self.compile else before_attention
        after = _compiled(after_attention) if self.compile else after_attention
        x = m.embed_tokens(ids)
        cos, sin = m.rotary_emb(x, pos)
        at, length = pos[0], self.length + 1
        for i, layer in enumerate(m.layers):
            a, mlp, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
            q, k, v = before(x, n1.weight, n1.variance_epsilon, a.roofline_qkv, cos, sin, self.hq, self.hkv)
            self.keys[i].index_copy_(2, at, k)
            self.values[i].index_copy_(2, at, v)
            x = after(x, self.attend(q, i, length), a.o_proj.weight, n2.weight, n2.variance_epsilon,
                      mlp.roofline_gate_up, mlp.down_proj.weight)
        self.length = length
        return self.model.lm_head(m.norm(x))

    def fastest_attention(self) -> dict:
        """Time every form and backend of the SDPA call on the first layer at the filled length; keep the fastest.
        Returns the times (ms) by name."""
        from triton.testing import do_bench

        q = torch.randn(self.batch, self.hkv, self.hq // self.hkv, self.keys[0].shape[-1], device=self.keys[0].device,
                        dtype=self.keys[0].dtype)
        times = {}
        for form in SDPA_FORMS:
            for backend in SDPA_BACKENDS:
                self.attention = (form, backend)
                try:
                    times[(form, backend)] = do_bench(lambda: self.attend(q, 0, self.length + 1), warmup=5, rep=30,
                                                      return_mode="median")
                except RuntimeError as e:  # a backend that does not take this form
                    print(f"  SDPA {form}, {backend}: {type(e).__name__}: {str(e)[:100]}", flush=True)
        self.attention = min(times, key=times.get)
        return {", ".join(k): round(t, 4) for k, t in times.items()}


def roofline_check(model, batch: int = 3, context: int = 40, steps: int = 4) -> dict:
    """The roofline step against transformers' ``StaticCache`` step (SDPA) over the same random keys and values:
    ``steps`` greedy steps fed the same tokens; the largest ‖roofline − transformers‖ / ‖transformers‖ of the
    logits, and whether every step's greedy token is the same."""
    from transformers import StaticCache

    cfg, dev = model.config, model.get_input_embeddings().weight.device
    dtype = model.get_input_embeddings().weight.dtype
    g = torch.Generator(device=dev).manual_seed(3)
    k = torch.randn(batch, cfg.num_key_value_heads, context, cfg.head_dim, device=dev, dtype=dtype, generator=g)
    v = torch.randn(batch, cfg.num_key_value_heads, context, cfg.head_dim, device=dev, dtype=dtype, generator=g)
    model.set_attn_implementation("sdpa")
    cache = StaticCache(config=cfg, max_cache_len=context + steps)
    for i in range(cfg.num_hidden_layers):
        cache.update(k, v, i)
    step = RooflineStep(model, batch, context + steps)
    step.fill(k, v)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=dev, generator=g)
    err, same = 0.0, True
    with torch.no_grad():
        for t in range(steps):
            pos = torch.full((batch, 1), context + t, device=dev, dtype=torch.long)
            ref = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True).logits[:, -1].double()
            out = step(ids, pos)[:, -1].double()
            err = max(err, ((out - ref).norm() / ref.norm()).item())
            same &= bool(torch.equal(out.argmax(-1), ref.argmax(-1)))
            ids = ref.argmax(-1, keepdim=True)
    return dict(logits_rel_err=err, same_greedy_tokens=same, batch=batch, context=context, steps=steps)


def fill_paged(cache: PagedKVCache, context: int) -> None:
    """``context`` random tokens in every sequence of every layer (the store kernel, one layer copied to all)."""
    first = cache.layers[0]
    g = torch.Generator(device="cuda").manual_seed(1)
    chunk = max(1, (1 << 22) // (cache.num_kv_heads * cache.head_dim))
    for b in range(cache.batch):
        for start in range(0, context, chunk):
            n = min(chunk, context - start)
            k = torch.randn(n, cache.num_kv_heads, cache.head_dim, device="cuda", generator=g, dtype=torch.float16)
            v = torch.randn(n, cache.num_kv_heads, cache.head_dim, device="cuda", generator=g, dtype=torch.float16)
            pos = torch.arange(start, start + n, device="cuda")
            slots = (cache.block_table[b].long()[pos // cache.block_size] * cache.block_size + pos % cache.block_size)
            if cache.kind == "mse":
                kvlab.store_mse(k, v, slots, first.cache, cache.key_codec, cache.value_codec, check=False)
            else:
                kvlab.affine.store_affine(k, v, slots, first.cache, cache.key_codec, cache.value_codec, check=False)
    for layer in cache.layers:
        if layer is not first:
            layer.cache.copy_(first.cache)
        layer.seq_lens.fill_(context)
        layer.length = context


def fused_transform(cfg, counts):
    """A ``TransformKV`` in the fused layout for every layer of ``cfg``: random orthogonal per-head transforms, uniform
    levels (the bytes and the work of ``calibrate(..., layout="fused")``'s codecs)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "ops"))
    from transform_codecs import fused_codec
    from kvlab.transform import TransformKV

    h, d, n = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    return TransformKV([fused_codec(h, d, counts, 2 * i) for i in range(n)],
                       [fused_codec(h, d, counts, 2 * i + 1) for i in range(n)], None, FUSED_SINK, FUSED_RESIDUAL)


def fill_random(cache: PagedKVCache, context: int) -> None:
    """``context`` tokens of random codes (every code is one of the fused layout) and random fp16 copies."""
    g = torch.Generator(device="cuda").manual_seed(1)
    first = cache.layers[0]
    for t in (first.k_cache, first.v_cache):
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device="cuda", generator=g))
    first.kv16.copy_(torch.randn(first.kv16.shape, device="cuda", generator=g).half())
    for layer in cache.layers:
        if layer is not first:
            layer.k_cache.copy_(first.k_cache)
            layer.v_cache.copy_(first.v_cache)
            layer.kv16.copy_(first.kv16)
        layer.seq_lens.fill_(context)
        layer.length = context


def kv_bytes(cache) -> int:
    """Bytes the cache allocated for keys and values."""
    if isinstance(cache, PagedKVCache):
        return cache.allocated_nbytes()
    if isinstance(cache, RooflineStep):
        return sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def fill_dense(cache, cfg, batch: int, context: int) -> None:
    k = torch.randn(batch, cfg.num_key_value_heads, context, cfg.head_dim, device="cuda", dtype=torch.float16)
    for i in range(cfg.num_hidden_layers):
        cache.update(k, k, i)
    del k


def time_steps(model, cache, batch: int, context: int, steps: int, graph: bool, forward=None, warmups: int = 1):
    """Median ms of ``steps`` greedy decode steps after ``context`` cached tokens (CUDA events per step);
    ``forward``: the model's forward to call (default ``model``; e.g. a ``torch.compile`` of it)."""
    forward = model if forward is None else forward
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device="cuda")
    pos = torch.full((batch, 1), context, device="cuda", dtype=torch.long)
    paged = isinstance(cache, PagedKVCache)

    def step():
        if isinstance(cache, RooflineStep):
            logits = cache(ids, pos)[:, -1]
        else:
            logits = forward(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        ids.copy_(logits.argmax(-1, keepdim=True))
        pos.add_(1)

    with torch.no_grad():
        step()  # warm-up: compiles kernels, builds device tables
        if forward is not model or warmups > 1:  # compiled code: a second warm-up (its first calls may recompile)
            step()
        torch.cuda.synchronize()
        times = []
        if graph:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
                step()
            torch.cuda.current_stream().wait_stream(s)
            if paged:  # capture ran the step's Python, not its kernels (StaticCache counts on the device)
                cache.advance(-1)
            run = g.replay
        else:
            run = step
        for _ in range(steps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            if paged and graph:
                cache.advance(1)
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    return statistics.median(times[2:] if len(times) > 4 else times)


def make_cache(name: str, model, batch: int, context: int, steps: int):
    from transformers import DynamicCache, StaticCache

    cfg = model.config
    if name.startswith(ROOFLINE):
        cache = RooflineStep(model, batch, context + steps + 4, compile=name.endswith(SUFFIX))
        k = torch.randn(batch, cfg.num_key_value_heads, context, cfg.head_dim, device="cuda", dtype=torch.float16)
        cache.fill(k, k)
        del k
        cache.sdpa_ms = cache.fastest_attention()
    elif name == "fp16 DynamicCache":
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=cfg)
        fill_dense(cache, cfg, batch, context)
    elif name in ("fp16 StaticCache", COMPILED):
        model.set_attn_implementation("sdpa")
        cache = StaticCache(config=cfg, max_cache_len=context + steps + 4)
        fill_dense(cache, cfg, batch, context)
    elif name.removesuffix(SUFFIX) in FUSED:
        model.set_attn_implementation("kvlab")
        cache = PagedKVCache(KVFormat("transform"), config=cfg, batch_size=batch, max_length=context + steps + 4,
                             device="cuda", check_steps=False, transform=fused_transform(cfg, FUSED[name.removesuffix(SUFFIX)]))
        fill_random(cache, context)
    else:
        model.set_attn_implementation("kvlab")
        cache = PagedKVCache(FORMATS[name.removesuffix(SUFFIX)], config=cfg, batch_size=batch, max_length=context + steps + 4,
                             device="cuda", check_steps=False)  # steps captured in a CUDA graph: no host sync
        fill_paged(cache, context)
    return cache


def measure(model, name, mode, batch, context, steps):
    forward = None
    if name == COMPILED:  # transformers' static cache under torch.compile (Inductor), the step then captured
        torch._dynamo.reset()
        forward = torch.compile(model.forward, dynamic=False, fullgraph=True)
    row = dict(cache=name, mode=mode, batch=batch, context=context)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cache = None
    try:
        cache = make_cache(name, model, batch, context, steps)
        kv = kv_bytes(cache)
        if name.startswith("kvlab") and name.endswith(SUFFIX):
            with compiled_layers(model):
                ms = time_steps(model, cache, batch, context, steps, graph=mode == "graph", warmups=2)
        elif name.startswith(ROOFLINE):
            row["config"] = ", ".join(cache.attention)
            print("   SDPA", cache.sdpa_ms, flush=True)
            ms = time_steps(model, cache, batch, context, steps, graph=mode == "graph", warmups=2 if cache.compile else 1)
        else:
            ms = time_steps(model, cache, batch, context, steps, graph=mode == "graph", forward=forward)
        row.update(status="ok", ms_per_step=round(ms, 4), tokens_per_s=round(batch * 1000 / ms, 1),
                   kv_gib=round(kv / 2**30, 3), peak_gib=round((torch.cuda.max_memory_allocated() - base) / 2**30, 3))
    except torch.cuda.OutOfMemoryError as e:
        row.update(status="oom")
        print("  ", str(e)[:300], flush=True)
    except Exception as e:  # noqa: BLE001 - recorded in the row
        row.update(status=f"error: {type(e).__name__}: {str(e)[:160]}")
    finally:
        del cache
        gc.collect()
        torch.cuda.empty_cache()
    print(" ", {k: row.get(k) for k in KEYS if k in row}, flush=True)
    return row


def checks(smoke_model) -> dict:
    """Tokens of the fused path against the materialising path, and graph replay against eager calls."""
    model = smoke_model
    out = {}
    ids = torch.randint(3, model.config.vocab_size, (3, 37), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    mask[2, :36] = 0  # a one-token prompt
    for name, fmt in FORMATS.items():
        eager = kvlab.generate(model, ids, fmt, 64, attention_mask=mask, cuda_graph=False)
        graph = kvlab.generate(model, ids, fmt, 64, attention_mask=mask, cuda_graph=True)
        model.set_attn_implementation("sdpa")
        dense = model.generate(ids, attention_mask=mask, cache=KVCache(fmt, config=model.config), max_new_tokens=64,
                               do_sample=False)
        agree = (eager.sequences[:, 37:] == dense[:, 37:]).float().mean().item()
        first_diff = [int((eager.sequences[i, 37:] != dense[i, 37:]).nonzero()[0]) if agree < 1 else 64 for i in range(3)]
        compiled = kvlab.generate(model, ids, fmt, 64, attention_mask=mask, compile=True)
        out[name] = dict(graph_equals_eager=bool(torch.equal(eager.sequences, graph.sequences)),
                         compiled_agreement=(compiled.sequences[:, 37:] == graph.sequences[:, 37:]).float().mean().item(),
                         tokens_equal_materialising=bool(torch.equal(eager.sequences, dense)),
                         token_agreement=agree, first_difference=first_diff)
        print(" ", name, out[name], flush=True)
    return out


def profile_eager(model, path: Path) -> None:
    import cProfile
    import io
    import pstats

    path.parent.mkdir(parents=True, exist_ok=True)
    cache = make_cache("kvlab mse k4v4", model, 8, 1024, 40)
    time_steps(model, cache, 8, 1024, 5, graph=False)
    prof = cProfile.Profile()
    prof.enable()
    time_steps(model, cache, 8, 1029, 20, graph=False)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(45)
    pstats.Stats(prof, stream=text).sort_stats("cumtime").print_stats(45)
    path.write_text(text.getvalue())


def prefill_seconds(model, names, tokens: int = 4096) -> dict:
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device="cuda")
    res = {}
    for name in ["fp16 DynamicCache", *names]:
        best = math.inf
        for _ in range(3):
            if name.startswith("fp16"):
                model.set_attn_implementation("sdpa")
                cache = DynamicCache(config=model.config)
            else:
                model.set_attn_implementation("kvlab")
                cache = PagedKVCache(FORMATS[name], config=model.config, batch_size=1, max_length=tokens, device="cuda")
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                model(ids, cache=cache, use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
            del cache
        res[name] = round(best, 4)
    return res


def write_rows(path: Path, rows: list[dict], run: dict) -> None:
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        w = csv.DictWriter(f, fieldnames=KEYS + list(run))
        w.writeheader()
        for r in rows:
            w.writerow({**{k: r.get(k, "") for k in KEYS}, **run})


def copy_gbps(nbytes: int, repeats: int = 5) -> float:
    """Device copy bandwidth (GB/s, bytes read and written): the best of ``repeats`` medians of a device-to-device
    ``copy_`` of ``nbytes`` bytes (``benchmarks.bench_decode.copy_bandwidth``)."""
    from benchmarks.bench_decode import copy_bandwidth

    return max(copy_bandwidth(nbytes) for _ in range(repeats))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--points", default=None, help="batch:context,... (default: the grid)")
    ap.add_argument("--budget-gib", type=float, default=None,
                    help="memory budget of the capacity figures (default: 120 GiB, or the device's memory less 8 GiB)")
    ap.add_argument("--profile", action="store_true", help="write a cProfile of eager decode steps (small model)")
    ap.add_argument("--compiled", action="store_true",
                    help=f"add the rows '{ROOFLINE}{SUFFIX}' (the roofline step's work around the attention compiled) "
                         f"and '<kvlab format>{SUFFIX}' (kvlab.generate(..., compile=True): the decoder layers compiled)")
    ap.add_argument("--names", default=None, help=f"only these rows (comma-separated; '{COMPILED}' only when named)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"what to run, of {','.join(PARTS)} (default: all)")
    ap.add_argument("--stem", default=None, help="output file stem (default: generate)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if parts - set(PARTS):
        ap.error(f"--parts: {sorted(parts - set(PARTS))} not in {PARTS}")
    import transformers
    import triton

    t0 = time.time()
    run = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               transformers=transformers.__version__, python=platform.python_version(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command="python " + " ".join(sys.argv))
    run["copy_gbps"] = round(copy_gbps(1 << 28 if args.smoke else 4 << 30), 1)
    print(f"copy bandwidth {run['copy_gbps']:.0f} GB/s", flush=True)
    small = llama(True)
    check = checks(small) if "checks" in parts else {}
    check[ROOFLINE] = roofline_check(small)  # fp16 on the GPU: the logits of two orders of the same sums
    print(" ", ROOFLINE, check[ROOFLINE], flush=True)
    if args.profile:
        profile_eager(small, Path(args.out) / "generate_profile.txt")
    del small
    model = llama(args.smoke)
    cfg = model.config
    grid = [(int(b), int(c)) for b, c in (p.split(":") for p in args.points.split(","))] if args.points else GRID
    if args.smoke:
        grid = [(2, 300), (3, 1000)]
    names = [ROOFLINE, *([ROOFLINE + SUFFIX] if args.compiled else []), "fp16 DynamicCache", "fp16 StaticCache", *FORMATS,
             *([n + SUFFIX for n in FORMATS] if args.compiled else [])]
    if args.names:
        every = [ROOFLINE, ROOFLINE + SUFFIX, "fp16 DynamicCache", "fp16 StaticCache", COMPILED, *FORMATS,
                 *[n + SUFFIX for n in FORMATS], *FUSED, *[n + SUFFIX for n in FUSED]]
        names = [n for n in every if n in args.names.split(",")]
    # capacity at 32k: KV bytes per sequence next to the weights; each kvlab batch checked by one step
    capacity = {}
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    budget = args.budget_gib if args.budget_gib is not None else min(120.0, math.floor(total_gib - 8))
    capacity_context = 1024 if args.smoke else 32768
    for name in ["fp16 StaticCache", *FORMATS] if "capacity" in parts else []:
        per_seq = kv_token_bytes(name, cfg) * capacity_context
        act = 2 * 2**30  # activations and workspace of one step
        batch = int((budget * 2**30 - weights - act) // per_seq)
        entry = dict(max_batch=batch, kv_gib_per_sequence=round(per_seq / 2**30, 4))
        if not name.startswith("fp16") and batch > 0:
            print(f"  capacity {name}: batch {batch}, {torch.cuda.memory_allocated() / 2**30:.1f} GiB in use", flush=True)
            r = measure(model, name, "graph", batch, capacity_context, 4)
            entry.update(checked=r.get("status"), ms_per_step=r.get("ms_per_step"), peak_gib=r.get("peak_gib"))
        capacity[name] = entry
    rows = []
    for batch, context in grid if "grid" in parts else []:
        point = []
        for name in names:
            fits = kv_token_bytes(name, cfg) * batch * context < (torch.cuda.mem_get_info()[1] - 24 * 2**30)
            modes = (["eager"] if name == "fp16 DynamicCache" else ["graph"] if name.endswith(SUFFIX) or name == ROOFLINE
                     else ["eager", "graph"])
            for mode in modes:
                if not fits:
                    r = dict(cache=name, mode=mode, batch=batch, context=context, status="oom")
                    print(" ", r, flush=True)
                else:
                    r = measure(model, name, mode, batch, context, args.steps if mode == "graph" else min(args.steps, 16))
                point.append(r)
        w_read = weight_read_bytes(model, batch)
        fp16_floor = floor_ms("fp16", cfg, w_read, batch, context, run["copy_gbps"])
        ok = [r for r in point if r["cache"].startswith("fp16") and r.get("status") == "ok"]
        base = min(ok, key=lambda r: r["ms_per_step"]) if ok else None
        for r in point:
            floor = floor_ms(r["cache"], cfg, w_read, batch, context, run["copy_gbps"])
            r.update(floor_ms=round(floor, 4), byte_ceiling=round(fp16_floor / floor, 3))
            if r.get("status") == "ok":
                r["share_of_floor"] = round(floor / r["ms_per_step"], 3)
            if base is not None and r.get("status") == "ok":
                r["speedup_vs_fp16"] = round(base["ms_per_step"] / r["ms_per_step"], 3)
                r["fp16_baseline"] = f"{base['cache']} {base['mode']}"
        for r in point:
            print(f"  B={batch} L={context} {r['cache']} {r['mode']}: {r.get('ms_per_step')} ms, floor {r['floor_ms']:.2f} ms, "
                  f"share {r.get('share_of_floor')}, x{r.get('speedup_vs_fp16')} ({r.get('fp16_baseline')}), "
                  f"ceiling {r['byte_ceiling']}", flush=True)
        rows += point
        write_rows(Path(args.out) / f"{args.stem or 'generate'}.partial.csv", rows, run)  # a run cut short keeps its rows
        Path(args.out, f"{args.stem or 'generate'}.partial.json").write_text(json.dumps(dict(run, checks=check), indent=1))
    prefill = (prefill_seconds(model, ["kvlab mse k4v4", "kvlab affine k4v4"], 512 if args.smoke else 4096)
               if "prefill" in parts else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.stem or ("generate_smoke" if args.smoke else "generate")
    write_rows(out / f"{stem}.csv", rows, run)
    for suffix in ("csv", "json"):
        Path(args.out, f"{args.stem or 'generate'}.partial.{suffix}").unlink(missing_ok=True)
    meta = dict(run, model=dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, q_heads=cfg.num_attention_heads,
                                kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab=cfg.vocab_size,
                                weights="random fp16", weight_gib=round(weights / 2**30, 2),
                                weight_read_gib_batch_1=round(weight_read_bytes(model, 1) / 2**30, 3)),
                steps=args.steps, capacity_context=capacity_context, capacity_budget_gib=budget, capacity=capacity,
                prefill_tokens=512 if args.smoke else 4096, prefill_seconds=prefill, checks=check,
                formats={k: repr(v) for k, v in FORMATS.items()}, parts=sorted(parts), seconds=round(time.time() - t0, 1))
    (out / f"{stem}.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps({k: meta[k] for k in ("capacity", "prefill_seconds", "seconds")}, indent=1))


if __name__ == "__main__":
    main()
