"""``benchmarks.kernel_fingerprint``: the benchmarks' launches compiled for sm_90 on a machine without a GPU, each
fingerprinted; a second run compares with the first, naming each launch whose device code differs."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def fingerprint(*args, timeout=900):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | dict(PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "benchmarks.kernel_fingerprint", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("fingerprint") / "decode.json"
    run = fingerprint("--only", "decode", "--quick", "--out", str(out))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only: the CPU's run (on a GPU the benchmarks themselves run)")
def test_the_gpu_paths_compile_and_compare(quick, tmp_path):
    made = json.loads(quick.read_text())
    assert made["target"] == "cuda sm_90" and made["quick"] and made["only"] == ["decode"]
    points = made["points"]
    assert len(points) == 6  # every codec of bench_decode, at its headline point
    mse = points["decode_attention mse k4v4 batch 8 context 32768"]
    kernels = [x for x in mse if "kernel" in x]
    assert [x["kernel"] for x in kernels] == ["_rotate_rows_kernel", "decode_mma_kernel", "_merge_splits_kernel", "_rotate_rows_kernel"]
    assert all(len(x["sass"]) == 16 and x["instructions"] > 100 for x in kernels)
    # a later call's torch operations between the launches: check=False clamps the block table and the lengths
    assert [x["torch"] for x in mse if "torch" in x] == ["clamp", "clamp"]
    loop = {label.split()[1] + " " + label.split()[2]: next(x for x in p if x.get("kernel", "").startswith(("_decode", "decode")))
            for label, p in points.items()}
    assert loop["affine k4v4"]["kernel"] == loop["centered k4v4"]["kernel"] == "_decode_split_kernel"
    assert len({x["sass"] for x in loop.values()}) == 6, "each codec's loop is its own build"

    same = fingerprint("--only", "decode", "--quick", "--against", str(quick))
    assert same.returncode == 0 and "every launch as in" in same.stdout, same.stdout[-2000:] + same.stderr[-2000:]

    edited = json.loads(quick.read_text())
    launch = next(x for x in edited["points"]["decode_attention affine k8v8 batch 8 context 32768"] if "kernel" in x)
    launch["sass"], launch["instructions"] = "0" * 16, launch["instructions"] - 8
    next(x for x in edited["points"]["decode_attention mse k2v2 batch 8 context 32768"]
         if x.get("kernel") == "decode_mma_kernel")["grid"][0] += 1
    edited["points"]["decode_attention mse k3v3 batch 8 context 32768"].remove(dict(torch="clamp"))
    other = tmp_path / "edited.json"
    other.write_text(json.dumps(edited))
    diff = fingerprint("--only", "decode", "--quick", "--against", str(other))
    assert diff.returncode == 1, diff.stdout[-2000:] + diff.stderr[-2000:]
    lines = [ln.strip() for ln in diff.stdout.splitlines() if ln.startswith("  ")]
    assert lines == [
        "decode_attention mse k3v3 batch 8 context 32768: launches _rotate_rows_kernel, torch.clamp, decode_mma_kernel, "
        "_merge_splits_kernel, _rotate_rows_kernel -> _rotate_rows_kernel, torch.clamp, torch.clamp, decode_mma_kernel, "
        "_merge_splits_kernel, _rotate_rows_kernel",
        "decode_attention mse k2v2 batch 8 context 32768: decode_mma_kernel differs in grid",
        f"decode_attention affine k8v8 batch 8 context 32768: _decode_split_kernel differs in sass "
        f"({launch['instructions']} -> {launch['instructions'] + 8} SASS instructions)"], diff.stdout


def test_bad_arguments_exit_2_naming_them(quick, tmp_path):
    bad = fingerprint("--only", "decode,prefill")
    assert bad.returncode == 2 and "--only takes decode, step, codecs, transform" in bad.stderr
    junk = tmp_path / "junk.json"
    junk.write_text("[1, 2]")
    for against, words in ((junk, "is not a fingerprint"), (tmp_path / "missing.json", "is not a fingerprint")):
        run = fingerprint("--only", "decode", "--quick", "--against", str(against))
        assert run.returncode == 2 and words in run.stderr, run.stderr[-2000:]
    run = fingerprint("--only", "decode", "--against", str(quick))  # not --quick: another grid, refused before compiling
    assert run.returncode == 2 and "another quick" in run.stderr, run.stderr[-2000:]
