"""TurboQuant's inner-product codec: a (bits - 1)-bit MSE code plus a 1-bit QJL sketch of its residual.

Pure torch: a readable reference, with no kernel. For a vector ``k`` of ``dim`` elements and
``m = sketch_dim`` (default ``dim``):

1. ``c = MSECodec(dim, bits - 1).encode(k)`` and ``k_mse = decode(c)`` (model space);
2. the residual ``r = k - k_mse`` is sketched by a fixed Gaussian matrix ``S [m, dim]`` (i.i.d.
   N(0, 1) entries, drawn from ``sketch_seed``): the code keeps the signs ``z = sign(S r)`` (one bit
   each, ``+1`` for ``>= 0``) and the norm ``||r||``;
3. ``decode`` returns ``k_tilde = k_mse + ||r|| sqrt(pi / 2) / m * S^T z``.

For any query ``q``, ``<q, k_tilde> = <q, k_mse> + ||r|| sqrt(pi / 2) / m <S q, z>``. For a Gaussian
row ``s``, ``E[<s, q> sign(<s, r>)] = sqrt(2 / pi) <q, r> / ||r||``, so over the draw of ``S`` the
estimate is unbiased: ``E[<q, k_tilde>] = <q, k>``. Its variance over ``S`` is

    Var = ||r||^2 / m * (pi / 2 * ||q||^2 - <q, r>^2 / ||r||^2),

about ``pi / 2`` times ``E[<q, r>^2] = ||q||^2 ||r||^2 / dim`` for ``m = dim`` and a query in a
random direction: the one-bit sketch trades the MSE code's shrinkage for noise. (The stored norm
is fp16, which leaves a relative bias of at most 2^-11 on the residual term.)

Code layout, per vector, ``nbytes`` bytes::

    MSE indices | MSE norm (fp16 LE) | sign bits | residual norm (fp16 LE)

The first two fields are exactly ``MSECodec(dim, bits - 1, rotation, seed, norm_correction)``'s code
(``kvlab.layout``). Sign ``j`` is bit ``j % 8`` of byte ``j // 8`` of the sign field
(``ceil(m / 8)`` bytes, unused high bits zero), the 1-bit case of the packing every kvlab code uses.
``bits_per_element = 8 * nbytes / dim`` counts both norms: ``bits + 32 / dim`` for ``m = dim``.
"""

from __future__ import annotations

import copy
import math

import torch

from .. import _checks as C
from ..layout import MSE_BITS, NORM_BYTES
from ..mse.reference import MSECodec
from ..packing import fp16_bytes, fp16_from_bytes

__all__ = ["QJLCodec", "pack_signs", "unpack_signs"]

QJL_BITS = tuple(b + 1 for b in MSE_BITS)  # total bits per coordinate: an MSE stage of 2, 3 or 4 bits plus the sign
# default sketch seed: seed + this offset, a random stream far from the small seeds of rotations and data
SKETCH_SEED_OFFSET = 0x9E3779B9


def pack_signs(positive: torch.Tensor) -> torch.Tensor:
    """Bool ``[..., m]`` -> uint8 ``[..., ceil(m / 8)]``: element ``j`` at bit ``j % 8`` of byte ``j // 8``."""
    C.check_tensor("positive", positive, (torch.bool,), ndim_min=1)
    m = positive.shape[-1]
    pad = (-m) % 8
    bits = torch.nn.functional.pad(positive.to(torch.int32), (0, pad)).reshape(*positive.shape[:-1], -1, 8)
    weights = 1 << torch.arange(8, dtype=torch.int32, device=positive.device)
    return (bits * weights).sum(-1).to(torch.uint8)


def unpack_signs(packed: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of ``pack_signs``: uint8 ``[..., ceil(m / 8)]`` -> float32 ``[..., m]`` of ``+1`` / ``-1``."""
    C.check_tensor("packed", packed, (torch.uint8,), ndim_min=1, last_dim=(m + 7) // 8)
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device)
    bits = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    bits = bits.reshape(*packed.shape[:-1], -1)[..., :m]
    return bits.float() * 2.0 - 1.0


class QJLCodec:
    """Unbiased inner products: a ``(bits - 1)``-bit ``MSECodec`` code plus a 1-bit QJL sketch of the residual.

    ``encode(x [..., dim]) -> uint8 [..., nbytes]``; ``decode(codes) -> float32 [..., dim]`` is the
    vector ``k_tilde`` whose inner product with any query is the unbiased estimate (see the module
    doc); ``decode_mse(codes)`` is the MSE stage alone. ``seed`` picks the rotation of the MSE stage,
    ``sketch_seed`` (default ``seed + SKETCH_SEED_OFFSET``) the Gaussian sketch ``S [sketch_dim, dim]``;
    ``with_sketch(sketch_seed)`` redraws only the sketch.
    """

    def __init__(
        self,
        dim: int,
        bits: int,
        rotation: str = "haar",
        seed: int = 0,
        *,
        sketch_dim: int | None = None,
        sketch_seed: int | None = None,
        norm_correction: bool = False,
    ):
        C.check_int("bits", bits, QJL_BITS)
        C.check_int("seed", seed)
        self.mse = MSECodec(dim, bits - 1, rotation=rotation, seed=seed, norm_correction=norm_correction)
        sketch_dim = dim if sketch_dim is None else sketch_dim
        sketch_seed = seed + SKETCH_SEED_OFFSET if sketch_seed is None else sketch_seed
        C.check_int("sketch_dim", sketch_dim, minimum=1)
        C.check_int("sketch_seed", sketch_seed)
        self.dim, self.bits, self.seed = dim, bits, seed
        self.rotation_kind, self.norm_correction = rotation, norm_correction
        self.sketch_dim, self.sketch_seed = sketch_dim, sketch_seed
        self.sketch = self._draw_sketch(sketch_dim, dim, sketch_seed)  # S [m, dim]
        self.sign_bytes = (sketch_dim + 7) // 8
        self.nbytes = self.mse.nbytes + self.sign_bytes + NORM_BYTES

    @staticmethod
    def _draw_sketch(m: int, dim: int, seed: int) -> torch.Tensor:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        return torch.randn(m, dim, generator=gen, dtype=torch.float64).float()

    def with_sketch(self, sketch_seed: int) -> "QJLCodec":
        """The same codec (same MSE stage, shared) with the sketch drawn from ``sketch_seed``."""
        C.check_int("sketch_seed", sketch_seed)
        other = copy.copy(self)
        other.sketch_seed = sketch_seed
        other.sketch = self._draw_sketch(self.sketch_dim, self.dim, sketch_seed)
        return other

    @property
    def bits_per_element(self) -> float:
        return 8.0 * self.nbytes / self.dim

    def __repr__(self) -> str:
        return (
            f"QJLCodec(dim={self.dim}, bits={self.bits}, rotation={self.rotation_kind!r}, seed={self.seed}, "
            f"sketch_dim={self.sketch_dim}, sketch_seed={self.sketch_seed}, norm_correction={self.norm_correction})"
        )

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        C.check_tensor("x", x, C.FLOAT_DTYPES, ndim_min=1, last_dim=self.dim)
        mse_codes = self.mse.encode(x)  # checks finiteness and the fp16 range of the norm
        r = x.float() - self.mse.decode(mse_codes)
        r_norm = r.double().square().sum(-1).sqrt().float()
        if bool((r_norm > C.FP16_MAX).any()):
            raise ValueError(f"x has vectors whose residual norm exceeds {C.FP16_MAX:g}; it is stored in fp16")
        positive = (r @ self.sketch.to(x.device).T) >= 0
        return torch.cat([mse_codes, pack_signs(positive), fp16_bytes(r_norm)], -1)

    def _split(self, codes: torch.Tensor):
        C.check_tensor("codes", codes, (torch.uint8,), ndim_min=1, last_dim=self.nbytes)
        n = self.mse.nbytes
        return codes[..., :n], codes[..., n : n + self.sign_bytes], codes[..., n + self.sign_bytes :]

    def decode_mse(self, codes: torch.Tensor) -> torch.Tensor:
        """The MSE stage's reconstruction ``k_mse`` (model space), float32 ``[..., dim]``."""
        mse_codes, _, _ = self._split(codes)
        return self.mse.decode(mse_codes)

    def residual_norm(self, codes: torch.Tensor) -> torch.Tensor:
        """The stored ``||r||`` (fp16, returned as float32 ``[...]``)."""
        _, _, norm = self._split(codes)
        return fp16_from_bytes(norm).float()

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``k_tilde = k_mse + ||r|| sqrt(pi / 2) / m * S^T z``, float32 ``[..., dim]``."""
        mse_codes, signs, norm = self._split(codes)
        z = unpack_signs(signs, self.sketch_dim)
        scale = fp16_from_bytes(norm).float() * (math.sqrt(math.pi / 2) / self.sketch_dim)
        return self.mse.decode(mse_codes) + scale.unsqueeze(-1) * (z @ self.sketch.to(codes.device))
