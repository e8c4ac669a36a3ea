"""Random rotations applied before the MSE codec quantizes a vector.

Convention used everywhere in kvlab: a row vector ``x`` is rotated as ``y = x @ R`` and rotated
back as ``x = y @ R.T``. Both constructions below are built on the CPU in float64 from a seeded
generator and only then cast and moved, so a seed gives the same matrix on every device.

* ``haar``: a Haar-random orthogonal matrix, the Q factor of a Gaussian matrix with the signs of
  R's diagonal folded into Q (without that correction QR's output is not uniformly distributed).
* ``hadamard``: a randomized Hadamard transform ``R = diag(s) H / sqrt(dim)`` with ``s`` random
  signs (``hadamard_signs``) and ``H`` the Sylvester Walsh-Hadamard matrix; ``dim`` must be a power
  of two. ``x @ R = fwht(x * s) / sqrt(dim)``: ``fwht`` applies ``H`` in ``dim log2(dim)`` adds
  instead of a ``dim``-wide matrix product, in a fixed order, so every device gives the same bits.
"""

from __future__ import annotations

import torch

__all__ = ["KINDS", "check_seed", "fwht", "haar", "hadamard", "hadamard_scale", "hadamard_signs", "rotation_matrix"]

KINDS = ("haar", "hadamard")


def check_seed(seed) -> int:
    """``seed`` if it is an int a ``torch.Generator`` takes, else a TypeError or ValueError naming it."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must be in [-2**63, 2**64) (a torch.Generator seed), got {seed}")
    return seed


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(check_seed(seed))


MAX_DIM = 8192  # a dense [dim, dim] rotation: 512 MiB in float64 at this size, seconds to build


def _check_dim(dim) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not 3 <= dim <= MAX_DIM:
        raise ValueError(f"dim must be in [3, {MAX_DIM}] (a dense dim x dim rotation), got {dim}")


def haar(dim: int, seed: int = 0) -> torch.Tensor:
    """Haar-random orthogonal ``[dim, dim]`` float64 matrix (CPU)."""
    _check_dim(dim)
    a = torch.randn(dim, dim, generator=_generator(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def _check_power_of_two(dim) -> None:
    _check_dim(dim)
    if dim & (dim - 1):
        raise ValueError(f"dim must be a power of two for the Hadamard rotation, got {dim}")


def hadamard_signs(dim: int, seed: int = 0) -> torch.Tensor:
    """The random signs ``s`` (``+-1``, float64 ``[dim]``, CPU) of ``hadamard(dim, seed)``."""
    _check_power_of_two(dim)
    signs = torch.randint(0, 2, (dim,), generator=_generator(seed), dtype=torch.int64) * 2 - 1
    return signs.to(torch.float64)


def hadamard_scale(dim: int) -> float:
    """``1 / sqrt(dim)`` rounded to float32 (returned as the Python float of that float32)."""
    _check_power_of_two(dim)
    return float(torch.tensor(dim**-0.5, dtype=torch.float64).to(torch.float32))


def hadamard(dim: int, seed: int = 0) -> torch.Tensor:
    """Randomized Hadamard ``[dim, dim]`` float64 matrix (CPU); ``dim`` a power of two."""
    _check_power_of_two(dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return hadamard_signs(dim, seed).unsqueeze(1) * h / dim**0.5


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh-Hadamard transform along the last dim, in float32: ``x @ H``.

    ``H`` is the Sylvester matrix (``H[j, k] = (-1)**popcount(j & k)``); the last dim must be a
    power of two. The butterflies run in a fixed order: for ``h = 1, 2, 4, ..., n / 2``, the pair
    ``(j, j + h)`` of each block of ``2 h`` elements becomes ``(a + b, a - b)``. Each output is thus
    the same sequence of float32 additions on every device (what the fused Triton store
    reproduces bit for bit).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not (x.dtype.is_floating_point or x.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)):
        raise TypeError(f"x must hold real numbers (a float or integer dtype), got {x.dtype}: transform the real and "
                        "imaginary parts apart")
    n = x.shape[-1] if x.dim() else 0
    if n < 1 or n & (n - 1):
        raise ValueError(f"x's last dimension must be a power of two, got shape {tuple(x.shape)}")
    y = x.float()
    lead = y.shape[:-1]
    h = 1
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2)
        h *= 2
    return y.reshape(*lead, n)


def rotation_matrix(kind: str, dim: int, seed: int = 0, *, device=None, dtype=torch.float32) -> torch.Tensor:
    """``haar`` or ``hadamard`` matrix, cast to ``dtype`` on ``device``."""
    if kind not in KINDS:
        raise ValueError(f"rotation must be one of {KINDS}, got {kind!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype}")
    m = haar(dim, seed) if kind == "haar" else hadamard(dim, seed)
    return m.to(dtype).to(device)
