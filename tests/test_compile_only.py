"""The compile-only plugin (``tests/compile_only.py``): on a machine without a GPU, a test's launches take the GPU's
paths and compile for sm_90, and nothing runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite itself compiles and runs every kernel")
def test_compile_only_compiles_for_hopper_without_running(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]), KVLAB_COMPILE_LOG=str(tmp_path / "log.json"))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "compile_only", "-p", "no:cacheprovider",
         "tests/ops/test_affine.py::test_non_contiguous_input_and_one_code"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["target"] == "cuda sm_90" and not log["failures"], run.stdout[-3000:]
    assert "kvlab.affine.triton.affine_pack_token_kernel" in {c["kernel"] for c in log["compiled"]}
    assert "1 failed" in run.stdout  # nothing ran: the codes are not the reference's
    assert "launches compiled for cuda sm_90" in run.stdout and ", 0 failed" in run.stdout
