"""The codec benchmark's smoke mode (tiny sizes, Triton interpreter): the script runs, checks and writes its files."""

import csv
import importlib
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is the CPU run; on a GPU the benchmark itself runs")


def smoke(tmp_path, only):
    """Run ``bench_codecs.py --smoke --only only`` into ``tmp_path``: its CSV rows and its JSON."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "benchmarks.bench_codecs", "--smoke", "--sizes", "1", "--only", only,
                    "--out", str(tmp_path)], cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    rows = list(csv.DictReader(open(tmp_path / f"codec_kernels_{only}.csv")))
    return rows, json.loads((tmp_path / f"codec_kernels_{only}.json").read_text())


@CPU_ONLY
def test_bench_codecs_smoke_affine(tmp_path):
    rows, meta = smoke(tmp_path, "affine")
    kernels = {(r["kernel"], r["variant"].split()[0], r["bits"]) for r in rows}
    assert {("affine_pack", axis, b) for axis in ("token", "channel") for b in ("2", "3", "4", "8")} <= kernels
    assert {("affine_mixed_pack", "heads", "mixed"), ("affine_mixed_unpack", "heads", "mixed")} <= kernels
    assert not any(r["kernel"].startswith("mse") for r in rows), "--only affine timed MSE kernels"
    assert meta["checks"] and all(meta["checks"].values()), meta["checks"]
    assert not (tmp_path / "codec_kernels_affine.partial.csv").exists()


@CPU_ONLY
def test_bench_codecs_smoke_mse_load(tmp_path):
    rows, meta = smoke(tmp_path, "mse_load")
    kernels = {(r["kernel"], r["variant"], r["bits"]) for r in rows}
    for b in ("2", "3", "4"):
        assert {("mse_load", "value, rotated space", b), ("mse_load", "value, model space", b),
                ("mse_load", "value, model space, hadamard", b), ("mse_load", "baseline: one program per vector", b)} <= kernels
    assert [r["kernel"] for r in rows].count("copy") == 1, "one device copy a size"
    assert not any(r["kernel"] in ("mse_store",) or r["kernel"].startswith("affine") for r in rows), "--only mse_load timed other kernels"
    # the loads decode the reference encoder's slots as the reference does
    errs = {k: v for k, v in meta["checks"].items() if not k.startswith("baseline")}
    assert len(errs) == 12 and all(v < 1e-3 for v in errs.values()), errs


@CPU_ONLY
def test_bench_codecs_smoke_mse_store(tmp_path):
    rows, meta = smoke(tmp_path, "mse_store")
    kernels = {(r["kernel"], r["variant"], r["bits"]) for r in rows}
    assert kernels == {("copy", "device copy of the fp16 vectors", "")} | {
        ("mse_store", "hadamard, K+V, FWHT fused", b) for b in ("2", "3", "4")}, kernels
    # the store's bytes at a sample are the reference encoder's
    assert meta["checks"] == {f"mse_store_hadamard_b{b}_bytes_equal": True for b in (2, 3, 4)}, meta["checks"]


def test_ncu_store_summary_reads_the_committed_run(tmp_path):
    out = tmp_path / "ncu.json"
    subprocess.run([sys.executable, "-m", "benchmarks.ncu_store", "--summarise", "results/codec_store_ncu.csv.gz", "--out", str(out),
                    "--run-from", "results/codec_store_ncu.json"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    assert json.loads(out.read_text()) == json.loads((ROOT / "results" / "codec_store_ncu.json").read_text())


def test_ncu_load_summary_reads_the_committed_run(tmp_path):
    out = tmp_path / "ncu.json"
    subprocess.run([sys.executable, "-m", "benchmarks.ncu_load", "--summarise", "results/codec_load_ncu.csv.gz", "--out", str(out),
                    "--run-from", "results/codec_load_ncu.json"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    assert json.loads(out.read_text()) == json.loads((ROOT / "results" / "codec_load_ncu.json").read_text())


@CPU_ONLY
@pytest.mark.parametrize("script", ["bench_transform", "bench_fused"])
def test_bench_transform_smoke(script):
    """bench_transform.py and bench_fused.py --smoke: the transform decode (any layout; the fused one) against its
    reference at tiny shapes."""
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{script}", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "relative error" in proc.stdout


def test_the_gluon_hooks_the_codec_benchmark_watches_exist():
    """bench_codecs.py names the kernel each timing ran (Gluon or Triton) by watching one function per Gluon
    kernel; on a CPU it never looks, so a renamed module would only fail on the GPU."""
    from benchmarks.bench_codecs import GLUON_HOOKS

    for module, hook in GLUON_HOOKS.values():
        assert callable(getattr(importlib.import_module(f"kvlab.{module}"), hook)), (module, hook)


def test_the_roofline_fp16_step_computes_transformers_static_cache_step():
    """bench_generate's fastest fp16 step (fused projections, SDPA over the filled length, no mask) gives the logits
    of transformers' StaticCache step over the same keys and values, step after step (CPU, fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.bench_generate import floor_ms, roofline_check, weight_read_bytes

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, rope_theta=500000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    before = {n: p.clone() for n, p in model.named_parameters()}
    res = roofline_check(model, batch=3, context=40, steps=4)
    assert res["logits_rel_err"] < 1e-5 and res["same_greedy_tokens"], res
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "fusing the projections changed a weight"
    # the byte floor: the weights less the embedding table but the batch's rows, and the KV of the filled length
    w = weight_read_bytes(model, 3)
    assert w == 4 * sum(p.numel() for p in model.parameters()) - 4 * 512 * 256 + 4 * 3 * 256
    kv16 = 2 * 2 * 64 * 2 * 2 * 3 * 1000  # K and V, fp16, head dim 64, 2 KV heads, 2 layers, batch 3, 1000 tokens
    assert math.isclose(floor_ms("fp16 roofline", cfg, w, 3, 1000, 1.0), (w + kv16) / 1e6)
