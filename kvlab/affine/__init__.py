"""The affine (min/max per group) codec: token- and channel-axis codes, mixed bits per head, the paged
affine cache. ``triton``: the kernels and their launchers; the oracle is ``kvlab.reference.AffineCodec``.
Tests: ``tests/ops/test_affine.py``."""

from .paged import AffineStoreStep, store_affine_slots
from .api import MixedAffineLayout, affine_code_bytes, pack_affine, pack_affine_mixed, unpack_affine, unpack_affine_mixed

__all__ = ["AffineStoreStep", "MixedAffineLayout", "affine_code_bytes", "pack_affine", "pack_affine_mixed", "unpack_affine", "unpack_affine_mixed", "store_affine_slots"]
