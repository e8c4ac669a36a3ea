"""Attention over the paged quantized cache: ``decode_attention`` (one query step, fused with the codes'
decoding) and ``prefill_attention``. ``triton``: the split loop (every device; the CPU through Triton's
interpreter) and the launchers; ``gluon``: the register-MMA loop for 2- to 4-bit MSE caches on CUDA GPUs.
The oracle: ``kvlab.reference.decode_attention_reference``. Tests: ``tests/ops/test_attention.py``."""

from .triton import AffineSlot, decode_attention, prefill_attention, rope_mean_scores, rotate_attention_output, store_affine_slots

__all__ = ["AffineSlot", "decode_attention", "prefill_attention", "rope_mean_scores", "rotate_attention_output",
           "store_affine_slots"]
