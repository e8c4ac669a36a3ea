"""The transform codec: a calibrated linear transform, a per-token gain and per-component codebooks.

``codec.py`` holds its parameters and slot layout, ``reference.py`` the pure-torch oracle, ``triton.py`` the
kernels that store rows of a paged cache (gain, codes, packing: ``store_transform``) and load them
(``load_transform``), ``api.py`` ``store`` / ``load`` (checks, the two matrix products, the kernels),
``attention.py`` one decode step of attention over the paged caches (``decode_attention``), ``calibration.py``
how the parameters are measured on a model. Tests: ``tests/ops/test_transform*.py``; benchmark:
``benchmarks/bench_transform.py``; page 15.
"""

from . import api, reference
from .api import load, store
from .codec import TransformCodec, TransformKV

__all__ = ["TransformCodec", "TransformKV", "api", "load", "reference", "store"]
