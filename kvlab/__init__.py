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
