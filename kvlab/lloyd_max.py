"""Lloyd-Max scalar quantizers for the coordinates of rotated vectors.

After a uniformly random rotation, one coordinate ``t`` of a unit vector in R^d has density

    f_d(t) = (1 - t^2)^((d - 3) / 2) / B(1/2, (d - 1) / 2),    t in [-1, 1],

i.e. ``(1 + t) / 2 ~ Beta((d - 1) / 2, (d - 1) / 2)``; as d grows, ``sqrt(d) * t`` tends to N(0, 1).
The Lloyd-Max quantizer with ``2**bits`` levels alternates the two optimality conditions until the
centroids move by less than ``1e-10`` (relative):

* boundary condition: each boundary is the midpoint of its two neighbouring centroids;
* centroid condition: each centroid is the conditional mean of its cell.

Both conditional moments have closed forms, so no numerical integration is needed:

* sphere:   int_a^b t f_d(t) dt = [(1 - a^2)^((d-1)/2) - (1 - b^2)^((d-1)/2)] / ((d - 1) B(1/2, (d-1)/2)),
            int_a^b t^2 f_d(t) dt = P_d(a, b) - (d - 1) / d * P_{d+2}(a, b),
  where P_d(a, b) = F_d(b) - F_d(a) and F_d is a regularized incomplete beta function;
* Gaussian: int_a^b t phi(t) dt = phi(a) - phi(b),
            int_a^b t^2 phi(t) dt = Phi(b) - Phi(a) + a phi(a) - b phi(b).

The iteration starts from the high-resolution optimum (centroid density proportional to f^(1/3))
and takes Newton steps on the fixed-point equation c = T(c) of the Lloyd update T, whose Jacobian is
tridiagonal; plain Lloyd steps (which converge, but slowly) are the fallback. Even 8-bit quantizers
converge in a few milliseconds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy import linalg, special, stats

__all__ = ["LloydMax", "lloyd_max"]


@dataclass(frozen=True)
class LloydMax:
    """A scalar quantizer: ``centroids`` (ascending), ``boundaries`` between them, its ``mse``.

    ``mse`` is the expected squared error of one coordinate; for the sphere quantizer
    ``dim * mse`` is the normalised distortion D_mse of a whole unit vector.
    """

    bits: int
    dim: int | None
    centroids: np.ndarray
    boundaries: np.ndarray
    mse: float
    iterations: int


class _Sphere:
    """One coordinate of a uniform random unit vector in R^dim."""

    def __init__(self, dim: int):
        self.dim = dim
        self.a = (dim - 1) / 2.0
        self.lo, self.hi = -1.0, 1.0
        self._log_c = -special.betaln(0.5, self.a)  # log normalising constant

    def cdf(self, t, dim=None):
        a = self.a if dim is None else (dim - 1) / 2.0
        return special.betainc(a, a, np.clip((1.0 + t) / 2.0, 0.0, 1.0))

    def _power(self, t, e):
        # exp(log C + e * log(1 - t^2)), with 0 at the end points where e > 0
        if e == 0:
            return np.full_like(t, math.exp(self._log_c))
        with np.errstate(divide="ignore"):
            return np.exp(self._log_c + e * np.log1p(-np.minimum(t * t, 1.0)))

    def pdf(self, t):
        return self._power(t, (self.dim - 3) / 2.0)

    def moments(self, lo, hi):
        """Probability, first and second moment of each cell [lo, hi]."""
        d = self.dim
        p = self.cdf(hi) - self.cdf(lo)
        m1 = (self._power(lo, self.a) - self._power(hi, self.a)) / (d - 1)
        m2 = p - (d - 1) / d * (self.cdf(hi, d + 2) - self.cdf(lo, d + 2))
        return p, m1, m2

    def initial_centroids(self, n):
        # f^(1/3) is again a symmetric beta density with exponent (d - 3) / 6.
        a3 = (self.dim - 3) / 6.0 + 1.0
        u = (np.arange(n) + 0.5) / n
        return 2.0 * special.betaincinv(a3, a3, u) - 1.0


class _Gaussian:
    """The N(0, 1) limit of sqrt(dim) * coordinate."""

    lo, hi = -np.inf, np.inf

    def pdf(self, t):
        return stats.norm.pdf(t)

    def moments(self, lo, hi):
        phi_lo, phi_hi = stats.norm.pdf(lo), stats.norm.pdf(hi)
        p = special.ndtr(hi) - special.ndtr(lo)
        m1 = phi_lo - phi_hi
        # t * phi(t) -> 0 at +-inf
        m2 = p + np.where(np.isfinite(lo), lo, 0.0) * phi_lo - np.where(np.isfinite(hi), hi, 0.0) * phi_hi
        return p, m1, m2

    def initial_centroids(self, n):
        # f^(1/3) is N(0, 3).
        return math.sqrt(3.0) * special.ndtri((np.arange(n) + 0.5) / n)


MAX_DIM = 1 << 24  # beyond, the sphere's coordinate law is the Gaussian limit to double precision (dim=None)


def _check(bits, dim):
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise TypeError(f"bits must be an int in 1..8, got {type(bits).__name__}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if dim is not None:
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
            raise TypeError(f"dim must be an int >= 3 or None, got {type(dim).__name__}")
        if not 3 <= dim <= MAX_DIM:
            raise ValueError(f"dim must be in [3, {MAX_DIM}] (or None for the Gaussian limit), got {dim}")


def lloyd_max(bits: int, dim: int | None = None) -> LloydMax:
    """Lloyd-Max quantizer with ``2**bits`` levels.

    With ``dim`` it quantizes one coordinate of a uniform random unit vector in R^dim (values in
    [-1, 1]); with ``dim=None`` it quantizes N(0, 1). Results are cached; arrays are read-only.
    """
    _check(bits, dim)
    return _lloyd_max(int(bits), None if dim is None else int(dim))


def _cells(law, c):
    b = 0.5 * (c[1:] + c[:-1])
    return b, np.concatenate([[law.lo], b]), np.concatenate([b, [law.hi]])


def _lloyd_step(law, c):
    """One Lloyd update c -> T(c) and the tridiagonal Jacobian of T (as banded rows)."""
    b, lo, hi = _cells(law, c)
    p, m1, _ = law.moments(lo, hi)
    t = m1 / p
    # dT_i/db = f(b) (b - T_i) / p_i at the upper boundary, f(b) (T_i - b) / p_i at the lower one;
    # each inner boundary is the midpoint of its two centroids, the two ends of the support are fixed.
    f_b = law.pdf(b)
    d_lo = np.zeros_like(c)
    d_hi = np.zeros_like(c)
    d_lo[1:] = 0.5 * f_b * (t[1:] - b) / p[1:]
    d_hi[:-1] = 0.5 * f_b * (b - t[:-1]) / p[:-1]
    jac = np.zeros((3, len(c)))
    jac[0, 1:] = d_hi[:-1]  # dT_i / dc_{i+1}
    jac[1] = d_lo + d_hi  # dT_i / dc_i
    jac[2, :-1] = d_lo[1:]  # dT_i / dc_{i-1}
    return t, jac


@functools.lru_cache(maxsize=None)
def _lloyd_max(bits: int, dim: int | None) -> LloydMax:
    law = _Gaussian() if dim is None else _Sphere(dim)
    c = law.initial_centroids(1 << bits)
    for it in range(1, 10_000):
        t, jac = _lloyd_step(law, c)
        t = 0.5 * (t - t[::-1])  # symmetric law: keep the centroids exactly antisymmetric
        change = np.max(np.abs(t - c)) / np.max(np.abs(t))
        if change < 1e-10:
            c = t
            break
        # Newton step on T(c) - c = 0; a plain Lloyd step whenever it would leave the support
        # or reorder the centroids.
        jac[1] -= 1.0
        step = linalg.solve_banded((1, 1), jac, c - t)
        newton = c + step
        newton = 0.5 * (newton - newton[::-1])
        ok = np.all(np.diff(newton) > 0) and newton[0] > law.lo and newton[-1] < law.hi
        c = newton if ok else t
    else:  # pragma: no cover
        raise RuntimeError("Lloyd-Max iteration did not converge")
    b, lo, hi = _cells(law, c)
    p, m1, m2 = law.moments(lo, hi)
    mse = float(np.sum(m2 - 2.0 * c * m1 + c * c * p))
    c.setflags(write=False)
    b.setflags(write=False)
    return LloydMax(bits=bits, dim=dim, centroids=c, boundaries=b, mse=mse, iterations=it)
