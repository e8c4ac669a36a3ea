"""Attention over the paged quantized cache: ``decode_attention`` (one query step, fused with the codes'
decoding) and ``prefill_attention``. ``api``: checks, then the loop the support matrix picks (``DecodeLaunch``
overrides it); ``triton`` / ``triton_tiles``: the split loop (every device; the CPU through Triton's
interpreter); ``gluon``: the register-MMA loop for 2- to 4-bit MSE caches on CUDA GPUs; ``checks``: which cache
a pair of codecs reads. The oracle: ``kvlab.attention.reference.decode_attention_reference``. Tests:
``tests/ops/test_attention.py``; benchmark: ``benchmarks/bench_decode.py``; pages 10 and 14."""

from .api import DecodeLaunch, decode_attention, prefill_attention, rotate_attention_output
from .triton import rope_mean_scores

__all__ = ["DecodeLaunch", "decode_attention", "prefill_attention", "rope_mean_scores", "rotate_attention_output"]
