"""Decode steps of a whole model: kvlab's paged cache and fused decode against transformers' fp16 caches.

A Llama at the Llama-3-8B shape (32 layers, hidden 4096, 32 query heads, 8 KV heads, head_dim 128,
vocab 32000 here) with random fp16 weights made on the GPU: no download. A decode step's time does not
depend on the cached values, so each cache is filled straight with ``context`` random tokens (kvlab
caches: random keys and values through the store kernel; transformers' caches: random tensors through
``update``), then ``steps`` greedy decode steps run, each timed with CUDA events; the median is reported.

Rows, at every (batch, context) point of the grid, in one run:
- ``fp16 DynamicCache``: transformers' default cache, SDPA, eager (what ``model.generate`` does);
- ``fp16 StaticCache``: transformers' static cache, SDPA, eager and replayed from a CUDA graph (the
  whole step captured once: the fastest fp16 decode transformers offers without a compiler);
- kvlab formats (``PagedKVCache``, attention ``"kvlab"``: ``decode_attention`` on the codes), eager
  and CUDA graph;
- with ``--compiled``: ``fp16 StaticCache compiled`` (``torch.compile`` of the whole forward, Inductor,
  then the step captured in a CUDA graph) and ``<kvlab format> compiled`` (the decoder layers compiled
  around kvlab's attention, ``kvlab.generate(..., compile=True)``, then the CUDA graph).
Where a cache does not fit on the device, the row says so (``status=oom``). ``--capacity`` adds, for
context 32k, the largest batch that fits in ``--budget-gib`` GiB for each cache (KV bytes per sequence
and the weights; each kvlab figure checked by one decode step at that batch). Also measured: one
prefill (batch 1, 4096 tokens), and checks (the fused path's tokens equal the materialising path's;
graph replay equals eager; compiled layers against the graph) on a small random model.

    python -m benchmarks.bench_generate --out results --compiled   # -> results/generate.csv, generate.json
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
COMPILED = "fp16 StaticCache compiled"
SUFFIX = " compiled"  # a kvlab row with this suffix: decoder layers compiled (kvlab.hf.generation.compiled_layers)
GRID = [(1, 4096), (8, 4096), (32, 4096), (1, 32768), (8, 32768), (32, 32768), (1, 131072)]
KEYS = ["cache", "mode", "batch", "context", "status", "ms_per_step", "tokens_per_s", "kv_gib", "peak_gib",
        "speedup_vs_fp16", "fp16_baseline"]


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
    return 2 * FORMATS[name.removesuffix(SUFFIX)].bits_per_element(d) / 8 * d * h * n


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


def kv_bytes(cache) -> int:
    """Bytes the cache allocated for keys and values."""
    if isinstance(cache, PagedKVCache):
        return cache.allocated_nbytes()
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
    if name == "fp16 DynamicCache":
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=cfg)
        fill_dense(cache, cfg, batch, context)
    elif name in ("fp16 StaticCache", COMPILED):
        model.set_attn_implementation("sdpa")
        cache = StaticCache(config=cfg, max_cache_len=context + steps + 4)
        fill_dense(cache, cfg, batch, context)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--points", default=None, help="batch:context,... (default: the grid)")
    ap.add_argument("--budget-gib", type=float, default=120.0)
    ap.add_argument("--profile", action="store_true", help="write a cProfile of eager decode steps (small model)")
    ap.add_argument("--compiled", action="store_true",
                    help=f"add the rows '{COMPILED}' (torch.compile of the forward, then a CUDA graph) and "
                         f"'<kvlab format>{SUFFIX}' (kvlab.generate(..., compile=True): the decoder layers compiled)")
    ap.add_argument("--names", default=None, help="only these rows (comma-separated); skips capacity, prefill, checks")
    ap.add_argument("--stem", default=None, help="output file stem (default: generate)")
    args = ap.parse_args()
    import transformers
    import triton

    t0 = time.time()
    run = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               transformers=transformers.__version__, python=platform.python_version(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command="python " + " ".join(sys.argv))
    small = llama(True)
    check = checks(small) if args.names is None else None
    if args.profile:
        profile_eager(small, Path(args.out) / "generate_profile.txt")
    del small
    model = llama(args.smoke)
    cfg = model.config
    grid = [(int(b), int(c)) for b, c in (p.split(":") for p in args.points.split(","))] if args.points else GRID
    if args.smoke:
        grid = [(2, 300), (3, 1000)]
    names = ["fp16 DynamicCache", "fp16 StaticCache", *([COMPILED] if args.compiled else []), *FORMATS,
             *([n + SUFFIX for n in FORMATS] if args.compiled else [])]
    if args.names:
        every = ["fp16 DynamicCache", "fp16 StaticCache", COMPILED, *FORMATS, *[n + SUFFIX for n in FORMATS]]
        names = [n for n in every if n in args.names.split(",")]
    # capacity at 32k: KV bytes per sequence next to the weights; each kvlab batch checked by one step
    capacity = {}
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    capacity_context = 1024 if args.smoke else 32768
    for name in [] if args.names else [n for n in names[1:] if not n.endswith(SUFFIX)]:
        per_seq = kv_token_bytes(name, cfg) * capacity_context
        act = 2 * 2**30  # activations and workspace of one step
        batch = int((args.budget_gib * 2**30 - weights - act) // per_seq)
        entry = dict(max_batch=batch, kv_gib_per_sequence=round(per_seq / 2**30, 4))
        if not name.startswith("fp16") and batch > 0:
            print(f"  capacity {name}: batch {batch}, {torch.cuda.memory_allocated() / 2**30:.1f} GiB in use", flush=True)
            r = measure(model, name, "graph", batch, capacity_context, 4)
            entry.update(checked=r.get("status"), ms_per_step=r.get("ms_per_step"), peak_gib=r.get("peak_gib"))
        capacity[name] = entry
    rows = []
    for batch, context in grid:
        point = []
        for name in names:
            fits = kv_token_bytes(name, cfg) * batch * context < (torch.cuda.mem_get_info()[1] - 24 * 2**30)
            for mode in (["eager"] if name == "fp16 DynamicCache" else ["graph"] if name.endswith(SUFFIX) else ["eager", "graph"]):
                if not fits:
                    r = dict(cache=name, mode=mode, batch=batch, context=context, status="oom")
                    print(" ", r, flush=True)
                else:
                    r = measure(model, name, mode, batch, context, args.steps)
                point.append(r)
        ok = [r for r in point if r["cache"].startswith("fp16") and r.get("status") == "ok"]
        base = min(ok, key=lambda r: r["ms_per_step"]) if ok else None
        for r in point:
            if base is not None and r.get("status") == "ok":
                r["speedup_vs_fp16"] = round(base["ms_per_step"] / r["ms_per_step"], 3)
                r["fp16_baseline"] = f"{base['cache']} {base['mode']}"
        rows += point
    prefill = None if args.names else prefill_seconds(model, ["kvlab mse k4v4", "kvlab affine k4v4"], 512 if args.smoke else 4096)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.stem or ("generate_smoke" if args.smoke else "generate")
    with open(out / f"{stem}.csv", "w") as f:
        import csv

        w = csv.DictWriter(f, fieldnames=KEYS + list(run))
        w.writeheader()
        for r in rows:
            w.writerow({**{k: r.get(k, "") for k in KEYS}, **run})
    meta = dict(run, model=dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, q_heads=cfg.num_attention_heads,
                                kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab=cfg.vocab_size,
                                weights="random fp16", weight_gib=round(weights / 2**30, 2)),
                steps=args.steps, capacity_context=capacity_context, capacity_budget_gib=args.budget_gib, capacity=capacity,
                prefill_tokens=512 if args.smoke else 4096, prefill_seconds=prefill, checks=check,
                formats={k: repr(v) for k, v in FORMATS.items()}, seconds=round(time.time() - t0, 1))
    (out / f"{stem}.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps({k: meta[k] for k in ("capacity", "prefill_seconds", "seconds")}, indent=1))


if __name__ == "__main__":
    main()
