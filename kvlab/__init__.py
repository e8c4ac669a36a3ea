"""kvlab: KV-cache quantization codecs, their pure-torch references and Triton kernels.

One folder per op, each with its api, its kernels (``triton``, ``gluon``) and its tests in
``tests/ops/test_<op>.py``: ``mse/`` and ``affine/`` (the codecs in the paged cache), ``centered/`` (centred
MSE keys), ``attention/`` (decode and prefill attention over the codes). The oracle of every kernel is
``reference`` (and ``centered/reference``); the byte layouts and the support matrix are ``layout``.
``hf/`` plugs the cache into transformers, ``study/`` holds what the pages measure with.
"""

from . import layout, rotation
from .attention import decode_attention, prefill_attention
from .affine import pack_affine, unpack_affine
from .calibration import ChannelStats, RoPE, calibrate_keys
from .centered import CenteredMSECodec, load_centered_mse, store_centered_mse
from .layout import MSESlot
from .lloyd_max import LloydMax, lloyd_max
from .mse import load_mse, store_mse
from .reference import AffineCodec, MSECodec

# The transformers integration and the real model import transformers: loaded on first use (PEP 562).
_LAZY = {
    "KVCache": "hf.cache", "KVFormat": "hf.formats",
    "PagedKVCache": "hf.paged", "generate": "hf.generation", "GenerateOutput": "hf.generation",
    "fused_support": "hf.paged",
    "corpus": "hf.model", "load_model": "hf.model", "perplexity": "hf.model", "Perplexity": "hf.model",
    "SimulatedCache": "study.simulated",
}

__all__ = [
    # codecs (pure torch: the oracle) and the cache's layout
    "AffineCodec", "CenteredMSECodec", "LloydMax", "MSECodec", "MSESlot", "lloyd_max", "layout", "rotation",
    # kernels: codes in the paged cache, attention over them
    "decode_attention", "load_centered_mse", "load_mse", "pack_affine", "prefill_attention", "store_centered_mse",
    "store_mse", "unpack_affine",
    # key statistics of a model (centred keys)
    "ChannelStats", "RoPE", "calibrate_keys",
    # transformers: caches, generation, the model and its perplexity
    *_LAZY,
]


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
