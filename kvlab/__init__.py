"""kvlab: KV-cache quantization codecs, their pure-torch references and Triton kernels.

One folder per op: ``mse/`` and ``affine/`` (the codecs in the paged cache), ``centered/`` (centred MSE keys),
``transform/`` (the calibrated transform codec), ``attention/`` (decode and prefill attention over the codes).
Each has its ``api`` (checks, then the kernel the support matrix picks), its kernels (``triton``, ``gluon``),
its oracle ``reference`` (pure torch; no kernel imports it) and its tests in ``tests/ops/test_<op>.py``.
``layout`` holds the byte layouts and the support matrix; ``hf/`` plugs the cache into transformers,
``study/`` holds what the pages measure with, ``sweep/`` runs a page over a grid of parameters.
"""

from . import layout, rotation
from .affine import decode_affine, encode_affine
from .affine.reference import AffineCodec
from .attention import DecodeLaunch, decode_attention, prefill_attention
from .calibration import RoPE
from .centered import CenteredMSECodec
from .layout import MSESlot
from .launch import CodecLaunch
from .lloyd_max import lloyd_max
from .mse import load_mse, store_mse
from .mse.reference import MSECodec

# The transformers integration and the real model import transformers: loaded on first use (PEP 562).
_LAZY = {
    "KVCache": "hf.cache", "KVFormat": "hf.formats", "PagedKVCache": "hf.paged", "generate": "hf.generation",
    "corpus": "hf.model", "load_model": "hf.model", "perplexity": "hf.model", "SimulatedCache": "study.simulated",
}

__all__ = [
    # use a quantized KV cache with a transformers model: generate, measure perplexity, simulate a format
    "KVCache", "KVFormat", "PagedKVCache", "SimulatedCache", "corpus", "generate", "load_model", "perplexity",
    # the codecs (pure torch, the oracle of the kernels), their centroids and the paged cache's byte layout
    "AffineCodec", "CenteredMSECodec", "MSECodec", "MSESlot", "RoPE", "layout", "lloyd_max", "rotation",
    # the kernels: codes in the paged cache, attention over them, and how they are launched (optional tuning)
    "CodecLaunch", "DecodeLaunch", "decode_affine", "decode_attention", "encode_affine", "load_mse", "prefill_attention", "store_mse",
]


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
