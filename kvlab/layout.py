"""Byte layouts of kvlab's packed codes and of the paged MSE cache. Stated here once.

Packed indices (``bits`` per element, element ``j`` of a vector):

* 8 bit: byte ``j``.
* 4 bit: two per byte, low nibble first: byte ``j // 2``, bits ``4 * (j % 2)``.
* 3 bit: a little-endian bit stream, element ``j`` at bit ``3 j``, in ``ceil(3 dim / 8)`` bytes
  (an element may straddle two bytes).
* 2 bit: four per byte from the low bits: byte ``j // 4``, bits ``2 * (j % 4)``.

In general a ``bits``-wide field of element ``j`` starts at bit ``bits * j`` of a little-endian
stream of ``ceil(bits * dim / 8)`` bytes; unused high bits of the last byte are zero.

An MSE code of one vector is ``[indices | norm]``: the packed centroid codes, then the vector's
scale as fp16, little-endian (2 bytes). A centroid code is sign-magnitude: its top bit (bit
``bits - 1``) is set for a negative centroid, its low ``bits - 1`` bits are the rank of the centroid's
magnitude (0: the smallest); ``MSECodec.codebook[code]`` is its value (``code_order`` below).
The decoded vector is ``codebook[codes] * scale``; with norm correction (``MSECodec``'s default) the
scale is the norm divided by the length of the centroid vector, ``|y| / |codebook[codes]|``,
computed at encode time, so that decoders do no more than multiply
(the fields are still called "norm" below and in the code).

The paged cache is one uint8 tensor ``[num_blocks, block_size, num_heads, slot_bytes]``. Token ``i``
of a batch goes to slot ``slot_mapping[i] = block * block_size + offset`` (``-1``: padding, not
written). One slot of one head holds, in order::

    key indices | key norm (fp16) | value indices | value norm (fp16)

Key and value bits may differ.

An affine code (``AffineCodec``) with ``axis="token"`` is, per vector, ``[indices | scales | zeros]``:
the packed indices of all ``dim`` elements, then one fp16 scale per group, then one fp16 zero per
group (groups of ``group_size`` consecutive channels). With ``axis="channel"`` one code covers
``group_size`` consecutive tokens: their ``group_size`` rows of packed indices, then ``dim`` fp16
scales and ``dim`` fp16 zeros (one per channel).

Mixed precision per head (``kvlab.affine.MixedAffineLayout(bit_alloc, dim, group_size)``): a layer's
K (or V) ``[num_tokens, num_heads, dim]`` with ``bit_alloc[h]`` bits for head ``h`` (2, 3, 4 or 8)
and token-axis groups is one uint8 tensor ``[num_tokens, bytes_per_token]``. Row ``t`` holds the
heads' token-axis affine codes in head order, each exactly ``AffineCodec(bit_alloc[h],
group_size).encode(x[t, h])``, back to back with no padding::

    head 0 [indices | scales | zeros] | head 1 [indices | scales | zeros] | ... | head H-1 [...]

``head_bytes[h] = packed_bytes(dim, bit_alloc[h]) + 4 dim / group_size``, ``head_offsets[h] =
head_bytes[0] + ... + head_bytes[h-1]`` (a small table computed once from ``bit_alloc``), and
``bytes_per_token = sum(head_bytes)``: a 4-bit head costs half the index bytes of an 8-bit one in
every row. E.g. ``bit_alloc = [4, 8, 4, 8]``, ``dim = 128``, ``group_size = 32``: heads of 80 and
144 bytes at offsets 0, 80, 224, 304; 448 bytes per token, against 1024 in fp16 and 576 if every head
were padded to the 8-bit code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "AFFINE_BITS", "ATTENTION_AFFINE_BITS", "HEAD_DIMS", "MMA_BITS", "MMA_DIMS", "MSE_BITS", "NORM_BYTES",
    "PACK_BITS", "STORE_GLUON_DIMS", "AffineSlot", "MSESlot", "code_order", "packed_bytes",
]

NORM_BYTES = 2  # fp16

# ----------------------------------------------------------------------------- the support matrix
# What each codec and backend serves; every module reads it from here.
PACK_BITS = (2, 3, 4, 8)  # packed indices (pack_indices / unpack_indices)
MSE_BITS = (2, 3, 4)  # MSE codes: encode/decode, the paged cache's store and load
AFFINE_BITS = PACK_BITS  # affine codes (token or channel axis), mixed per-head codes, the paged affine cache
ATTENTION_AFFINE_BITS = (4, 8)  # affine caches that decode_attention and prefill_attention read
HEAD_DIMS = (64, 128, 256)  # head dims of decode_attention (Triton split loop) and the generation path
MMA_DIMS = (64, 128)  # the Gluon register-MMA decode loop and the model-space MSE load (CUDA, Hopper)
MMA_BITS = (2, 3, 4)  # their key and value widths (3-bit codes and 2-bit values: dim 128 only)
STORE_GLUON_DIMS = (128,)  # the Gluon Hadamard MSE store (CUDA); other dims take the Triton store


def packed_bytes(dim: int, bits: int) -> int:
    """Bytes holding ``dim`` packed ``bits``-wide indices (``dim >= 0``, ``bits`` 1 to 8)."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise ValueError(f"dim must be an int >= 0, got {dim!r}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in [1, 8], got {bits!r}")
    return (dim * bits + 7) // 8


def code_order(bits: int) -> torch.Tensor:
    """int64 ``[2**bits]``: the index, in ascending order, of the centroid each MSE code stands for.

    A code is sign-magnitude: with ``h = 2**(bits - 1)``, code ``m`` (``m < h``) is the positive
    centroid of magnitude rank ``m`` (``c[h + m]``) and code ``h + m`` its mirror, the negative one
    (``c[h - 1 - m]``). So ``centroids[code_order(bits)]`` is the table a code indexes
    (``MSECodec.codebook``), and a decoder of the symmetric codebook takes the magnitude from the low
    ``bits - 1`` bits and the sign from the top bit as they are.
    """
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in MSE_BITS:
        raise ValueError(f"bits must be 2, 3 or 4, got {bits!r}")
    h = 1 << (bits - 1)
    m = torch.arange(h)
    return torch.cat([h + m, h - 1 - m])


@dataclass(frozen=True)
class MSESlot:
    """Offsets inside one ``[key | key norm | value | value norm]`` slot of the paged cache."""

    dim: int
    key_bits: int
    value_bits: int

    def __post_init__(self):
        for name in ("dim", "key_bits", "value_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.dim < 1:
            raise ValueError(f"dim must be an int >= 1, got {self.dim!r}")
        for name in ("key_bits", "value_bits"):
            if getattr(self, name) not in MSE_BITS:
                raise ValueError(f"{name} must be 2, 3 or 4, got {getattr(self, name)!r}")

    @property
    def key_bytes(self) -> int:
        return packed_bytes(self.dim, self.key_bits)

    @property
    def value_bytes(self) -> int:
        return packed_bytes(self.dim, self.value_bits)

    @property
    def key_offset(self) -> int:
        return 0

    @property
    def key_norm_offset(self) -> int:
        return self.key_bytes

    @property
    def value_offset(self) -> int:
        return self.key_bytes + NORM_BYTES

    @property
    def value_norm_offset(self) -> int:
        return self.value_offset + self.value_bytes

    @property
    def slot_bytes(self) -> int:
        return self.value_norm_offset + NORM_BYTES

    @property
    def key_code_bytes(self) -> int:
        """Bytes of one key's MSE code (indices + norm), i.e. ``MSECodec.nbytes``."""
        return self.key_bytes + NORM_BYTES

    @property
    def value_code_bytes(self) -> int:
        return self.value_bytes + NORM_BYTES


@dataclass(frozen=True)
class AffineSlot:
    """Offsets inside one ``[key code | value code]`` slot of the paged affine cache (token-axis codes)."""

    dim: int
    key_bits: int
    value_bits: int
    group_size: int

    @property
    def key_code_bytes(self) -> int:
        return packed_bytes(self.dim, self.key_bits) + 4 * (self.dim // self.group_size)

    @property
    def value_code_bytes(self) -> int:
        return packed_bytes(self.dim, self.value_bits) + 4 * (self.dim // self.group_size)

    @property
    def value_offset(self) -> int:
        return self.key_code_bytes

    @property
    def slot_bytes(self) -> int:
        return self.key_code_bytes + self.value_code_bytes
