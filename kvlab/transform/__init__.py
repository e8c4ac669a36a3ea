"""The transform codec: a calibrated linear transform, a per-token gain and per-component codebooks.

``codec.py`` holds its parameters and slot layout, ``reference.py`` the pure-torch oracle, ``triton.py`` the
kernels that quantize, pack and unpack rows of a paged cache, ``api.py`` ``store`` / ``load`` (checks, the two
matrix products, the kernels), ``calibration.py`` how the parameters are measured on a model.
"""

from . import api, reference
from .codec import TransformCodec, TransformKV

__all__ = ["TransformCodec", "TransformKV", "api", "reference"]
