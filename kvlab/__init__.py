"""kvlab: KV-cache quantization codecs, their pure-torch references and Triton kernels."""

from . import layout, rotation
from .layout import MSESlot, packed_bytes
from .lloyd_max import LloydMax, lloyd_max
from .reference import AffineCodec, MSECodec, pack_indices, read_slots, unpack_indices, write_slots

__all__ = [
    "AffineCodec",
    "LloydMax",
    "MSECodec",
    "MSESlot",
    "layout",
    "lloyd_max",
    "pack_indices",
    "packed_bytes",
    "read_slots",
    "rotation",
    "unpack_indices",
    "write_slots",
]

from .mse import load_mse, store_mse  # noqa: E402  Triton kernels of the MSE codec in the paged cache

__all__ += ["load_mse", "store_mse"]

from .affine import MixedAffineLayout, pack_affine, pack_affine_mixed, unpack_affine, unpack_affine_mixed  # noqa: E402  Triton kernels of the affine codec

__all__ += ["MixedAffineLayout", "pack_affine", "pack_affine_mixed", "unpack_affine", "unpack_affine_mixed"]

from . import metrics  # noqa: E402  codec error metrics and synthetic vectors
from .qjl import QJLCodec  # noqa: E402  pure-torch inner-product codec: MSE code plus a 1-bit residual sketch

__all__ += ["QJLCodec", "metrics"]

from .decode import AffineSlot, decode_attention, prefill_attention, rotate_attention_output, store_affine_slots  # noqa: E402  fused decode attention over the paged cache

__all__ += ["AffineSlot", "decode_attention", "prefill_attention", "rotate_attention_output", "store_affine_slots"]

from .centered_reference import CenteredMSECodec  # noqa: E402  MSE keys centred and scaled per channel: reference
from .centered import load_centered_mse, store_centered_mse  # noqa: E402  ... and its Triton kernels in the paged cache
from .calibration import ChannelStats, RoPE, calibrate_keys, key_moments  # noqa: E402  key statistics for it

__all__ += ["CenteredMSECodec", "ChannelStats", "RoPE", "calibrate_keys", "key_moments", "load_centered_mse", "store_centered_mse"]

# The transformers cache and the real model import transformers: loaded on first use (PEP 562).
_LAZY = {
    "KVCache": "cache", "KVFormat": "cache",
    "corpus": "model", "load_model": "model", "perplexity": "model", "Perplexity": "model",
    "SimulatedCache": "simulated",
    "PagedKVCache": "generation", "generate": "generation", "GenerateOutput": "generation",
    "fused_support": "generation",
}
__all__ += [*_LAZY, "cache", "generation", "model", "simulated"]


def __getattr__(name):
    import importlib

    if name in ("cache", "generation", "model", "simulated"):
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
