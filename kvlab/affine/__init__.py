"""The affine (min/max per group) codec: token- and channel-axis codes, mixed bits per head, the paged
affine cache. ``triton``: the kernels and their launchers; the oracle is ``kvlab.affine.reference.AffineCodec``.
Tests: ``tests/ops/test_affine.py``; benchmark: ``benchmarks/bench_codecs.py --only affine``; pages 02 and 08."""

from .paged import AffineStoreStep, store_affine
from .api import MixedAffineLayout, affine_code_bytes, encode_affine, encode_affine_mixed, decode_affine, decode_affine_mixed

__all__ = ["AffineStoreStep", "MixedAffineLayout", "affine_code_bytes", "encode_affine", "encode_affine_mixed", "decode_affine", "decode_affine_mixed", "store_affine"]
