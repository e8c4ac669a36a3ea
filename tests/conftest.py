"""Test-wide setup.

* Triton runs in its interpreter when no GPU is present (set before anything imports triton), with
  an emulator of the inline PTX the decode kernel's fast path uses (``tests/ptx.py``).
* ``torch.empty`` and ``torch.empty_like`` return NaN-filled (float) or 0xFF-filled (integer)
  tensors, so a kernel that leaves part of its output unwritten fails loudly instead of passing on
  leftover memory.
"""

import os

# Busy-waiting OpenMP threads stall a 2-core machine between torch ops; set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import ptx  # noqa: E402  (tests/ptx.py: the interpreter runs the decode kernel's inline PTX too)

    ptx.install()

_empty, _empty_like = torch.empty, torch.empty_like


def _poison(t):
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(-1 if t.dtype.is_signed else torch.iinfo(t.dtype).max)
    return t


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch, request):
    if request.config.pluginmanager.hasplugin("compile_only"):  # kernels compile but never write: zeros let host checks pass
        monkeypatch.setattr(torch, "empty", lambda *a, **k: _empty(*a, **k).zero_())
        monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _empty_like(*a, **k).zero_())
        return
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(_empty_like(*a, **k)))


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def one_thread():
    """One intra-op thread, for tests of many small tensors (a thread pool only adds overhead there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
