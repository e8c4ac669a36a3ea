"""A codec's parameters, apart from its arithmetic: what kernels and references both take.

``MSEParams`` (bits, dim, rotation, centroids and boundaries), ``AffineParams`` (bits, group size, axis)
and ``CenteredParams`` (an MSE codec plus per-head mean and scale) are small classes that build and check
the parameters once. The pure-torch codecs (``kvlab.mse.reference.MSECodec``,
``kvlab.affine.reference.AffineCodec``, ``kvlab.centered.reference.CenteredMSECodec``) subclass them with
``encode``/``decode``; the kernels recognise a codec by its parameter class and never import a reference.
"""

from __future__ import annotations

import torch

from . import _checks as C
from .layout import AFFINE_BITS, MSE_BITS, NORM_BYTES, code_order, packed_bytes
from .lloyd_max import lloyd_max
from .rotation import KINDS, MAX_DIM, hadamard_scale, hadamard_signs, rotation_matrix

__all__ = ["AffineParams", "CenteredParams", "MSEParams"]


class MSEParams:
    """Rotated Lloyd-Max parameters for vectors of ``dim`` elements at ``bits`` per element.

    ``rotation``: float32 ``[dim, dim]`` (``rotation_kind`` ``"haar"`` or ``"hadamard"``, drawn from
    ``seed``; for Hadamard also ``hadamard_signs`` and ``hadamard_scale``); ``centroids`` and
    ``boundaries``: float32, ascending (``kvlab.lloyd_max``); ``codebook``: the centroid of each stored
    code; ``nbytes``: one code (packed indices and an fp16 scale, ``kvlab.layout``).
    """

    def __init__(self, dim: int, bits: int, rotation: str = "haar", seed: int = 0, norm_correction: bool = True):
        C.check_int("dim", dim, minimum=3)
        if dim > MAX_DIM:
            raise ValueError(f"dim must be in [3, {MAX_DIM}] (a dense dim x dim rotation), got {dim}")
        C.check_int("bits", bits, MSE_BITS)
        C.check_choice("rotation", rotation, KINDS)
        C.check_int("seed", seed)
        C.check_bool("norm_correction", norm_correction)
        self.dim, self.bits, self.rotation_kind, self.seed = dim, bits, rotation, seed
        self.norm_correction = norm_correction
        self.quantizer = lloyd_max(bits, dim)
        self.rotation = rotation_matrix(rotation, dim, seed)  # validates dim for the kind
        self.hadamard_signs = self.hadamard_scale = None
        if rotation == "hadamard":  # x @ R == fwht(x * signs) * scale, R = diag(signs) H / sqrt(dim)
            self.hadamard_signs = hadamard_signs(dim, seed).to(torch.float32)
            self.hadamard_scale = hadamard_scale(dim)
        self.centroids = torch.tensor(self.quantizer.centroids, dtype=torch.float32)
        self.boundaries = torch.tensor(self.quantizer.boundaries, dtype=torch.float32)
        self.index_bytes = packed_bytes(dim, bits)
        self.nbytes = self.index_bytes + NORM_BYTES

    @property
    def codebook(self) -> torch.Tensor:
        """float32 ``[2**bits]``: the centroid of each stored code (``kvlab.layout.code_order``)."""
        return self.centroids[code_order(self.bits)]

    @property
    def bits_per_element(self) -> float:
        return 8.0 * self.nbytes / self.dim

    def identity(self) -> tuple:
        """What a decoder of these codes must agree on (``kvlab._checks.check_reader``): dim, bits, rotation, seed,
        norm correction, and the fingerprint of the statistics of a centred codec that writes through this one."""
        plain = ("mse", self.dim, self.bits, self.rotation_kind, self.seed, self.norm_correction)
        stats = getattr(self, "centered_stats", None)  # set by the centred codec this one codes for
        return plain if stats is None else ("centered", plain, stats)

    def __repr__(self) -> str:
        return (
            f"MSECodec(dim={self.dim}, bits={self.bits}, rotation={self.rotation_kind!r}, "
            f"seed={self.seed}, norm_correction={self.norm_correction})"
        )


class AffineParams:
    """Asymmetric min/max parameters: ``bits`` per index, one fp16 scale and zero per ``group_size``
    channels of a token (``axis="token"``) or tokens of a channel (``axis="channel"``)."""

    def __init__(self, bits: int, group_size: int, axis: str = "token"):
        C.check_int("bits", bits, AFFINE_BITS)
        C.check_int("group_size", group_size, minimum=8)
        if group_size % 8:
            raise ValueError(f"group_size must be a multiple of 8, got {group_size}")
        C.check_choice("axis", axis, ("token", "channel"))
        self.bits, self.group_size, self.axis = bits, group_size, axis
        self.levels = (1 << bits) - 1

    @property
    def bits_per_element(self) -> float:
        return self.bits + 32.0 / self.group_size

    def __repr__(self) -> str:
        return f"AffineCodec(bits={self.bits}, group_size={self.group_size}, axis={self.axis!r})"

    def identity(self) -> tuple:
        """What a decoder of these codes must agree on: bits, group size and axis."""
        return ("affine", self.bits, self.group_size, self.axis)

    def nbytes(self, dim: int) -> int:
        """Bytes of one code: one vector (token axis) or ``group_size`` vectors (channel axis)."""
        if self.axis == "token":
            return packed_bytes(dim, self.bits) + 4 * (dim // self.group_size)
        return self.group_size * packed_bytes(dim, self.bits) + 4 * dim


class CenteredParams:
    """MSE keys centred and scaled per head and channel: ``mse`` (an ``MSEParams``), float32 ``mean``,
    ``scale`` and ``inv_scale`` ``[num_heads, dim]``, ``rope`` (None or a ``kvlab.calibration.RoPE``) and
    ``mean_rows(positions)``. ``kvlab.centered.reference.CenteredMSECodec`` builds them."""

    mse: MSEParams
    mean: torch.Tensor
    scale: torch.Tensor
    inv_scale: torch.Tensor
    num_heads: int
    dim: int
    rope: object

    def identity(self) -> tuple:
        """That of its MSE codec, which carries the fingerprint of these statistics: the codes mean keys only
        with them."""
        return self.mse.identity()
