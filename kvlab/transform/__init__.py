"""The transform codec: a calibrated linear transform, a per-token gain and per-component codebooks.

``codec.py`` holds its parameters and slot layout, ``reference.py`` the pure-torch oracle.
"""

from .codec import TransformCodec, TransformKV

__all__ = ["TransformCodec", "TransformKV"]
