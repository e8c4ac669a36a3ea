"""The affine (min/max per group) codec: token- and channel-axis codes, mixed bits per head, the paged
affine cache. ``api``: the checked launchers (``encode_affine``, ``decode_affine`` and their mixed-bit forms);
``triton``, ``triton_bits``: the kernels; ``paged``: the store into the paged affine cache (``store_affine``);
the oracle is ``kvlab.affine.reference.AffineCodec``.
Tests: ``tests/ops/test_affine.py``; benchmark: ``benchmarks/bench_codecs.py --only affine``; pages 02 and 08."""

from .paged import AffineStoreStep, store_affine
from .api import MixedAffineLayout, affine_code_bytes, encode_affine, encode_affine_mixed, decode_affine, decode_affine_mixed

__all__ = ["AffineStoreStep", "MixedAffineLayout", "affine_code_bytes", "encode_affine", "encode_affine_mixed", "decode_affine", "decode_affine_mixed", "store_affine"]
