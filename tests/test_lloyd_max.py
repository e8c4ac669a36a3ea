import time

import numpy as np
import pytest
from scipy import integrate, special, stats

from kvlab import lloyd_max
from kvlab.lloyd_max import _lloyd_max

DIMS = [None, 3, 5, 64, 128, 256]


def _density(dim):
    if dim is None:
        return stats.norm.pdf, -np.inf, np.inf
    a = (dim - 1) / 2
    return (lambda t: (1 - t * t) ** ((dim - 3) / 2) / special.beta(0.5, a)), -1.0, 1.0


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_shape_order_symmetry(bits, dim):
    q = lloyd_max(bits, dim)
    assert q.centroids.dtype == np.float64 and q.centroids.shape == (2**bits,)
    assert q.boundaries.shape == (2**bits - 1,)
    assert np.all(np.diff(q.centroids) > 0)
    np.testing.assert_allclose(q.centroids, -q.centroids[::-1], rtol=0, atol=1e-14)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6])
def test_optimality_conditions_by_quadrature(bits, dim):
    """Each boundary is a midpoint; each centroid is its cell's conditional mean (checked with
    numerical integration, independent of the closed forms used by the solver)."""
    q = lloyd_max(bits, dim)
    np.testing.assert_allclose(q.boundaries, 0.5 * (q.centroids[1:] + q.centroids[:-1]), rtol=0, atol=1e-15)
    f, lo, hi = _density(dim)
    edges = np.concatenate([[lo], q.boundaries, [hi]])
    mse = 0.0
    for c, a, b in zip(q.centroids, edges[:-1], edges[1:]):
        p = integrate.quad(f, a, b, epsabs=1e-14, epsrel=1e-12)[0]
        m1 = integrate.quad(lambda t: t * f(t), a, b, epsabs=1e-14, epsrel=1e-12)[0]
        mse += integrate.quad(lambda t: (t - c) ** 2 * f(t), a, b, epsabs=1e-16, epsrel=1e-12)[0]
        assert c == pytest.approx(m1 / p, rel=1e-7, abs=1e-12)
    assert q.mse == pytest.approx(mse, rel=1e-6)


def test_gaussian_matches_published_values():
    # Max (1960), optimum quantizer for a unit Gaussian: mean-squared error for 1..4 bits.
    for bits, mse in [(1, 0.3634), (2, 0.1175), (3, 0.03455), (4, 0.009501)]:
        assert lloyd_max(bits).mse == pytest.approx(mse, rel=2e-3)
    assert lloyd_max(1).centroids[-1] == pytest.approx(np.sqrt(2 / np.pi), rel=1e-12)


def test_dim_three_is_uniform():
    # For dim 3 a coordinate is uniform on [-1, 1]: the optimum is the uniform quantizer.
    for bits in (1, 2, 3, 5):
        n = 2**bits
        q = lloyd_max(bits, 3)
        np.testing.assert_allclose(q.centroids, -1 + (2 * np.arange(n) + 1) / n, atol=1e-10)
        assert q.mse == pytest.approx((2 / n) ** 2 / 12, rel=1e-8)


@pytest.mark.parametrize("bits", [2, 4])
def test_large_dim_tends_to_gaussian(bits):
    g = lloyd_max(bits)
    errors = [np.max(np.abs(np.sqrt(d) * lloyd_max(bits, d).centroids - g.centroids)) for d in (16, 128, 4096)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 2e-3


def test_distortion_within_shannon_and_panter_dite_bounds():
    # TurboQuant's bounds on D_mse = dim * mse: 4^-b <= D_mse <= (sqrt(3) pi / 2) 4^-b.
    for bits in (1, 2, 3, 4):
        for dim in (64, 128, 256):
            d_mse = dim * lloyd_max(bits, dim).mse
            assert 4.0**-bits <= d_mse <= np.sqrt(3) * np.pi / 2 * 4.0**-bits


def test_cached_and_fast():
    assert lloyd_max(4, 128) is lloyd_max(4, 128)
    _lloyd_max.cache_clear()
    for bits in range(1, 9):
        for dim in (None, 128, 4096):
            t0 = time.perf_counter()
            lloyd_max(bits, dim)
            assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((0,), ValueError, "bits"),
        ((9,), ValueError, "bits"),
        ((2.0,), TypeError, "bits"),
        ((True,), TypeError, "bits"),
        ((2, 2), ValueError, "dim"),
        ((2, 128.0), TypeError, "dim"),
    ],
)
def test_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        lloyd_max(*args)
