"""The QJL inner-product codec (kvlab.study.qjl): layout, bits, and unbiasedness over the random draws."""

import math

import pytest
import torch

import kvlab
from kvlab.study.qjl import QJLCodec, pack_signs, unpack_signs


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("m", [1, 8, 37, 128])
def test_sign_packing_roundtrip(m):
    positive = torch.rand(5, m) > 0.5
    packed = pack_signs(positive)
    assert packed.dtype == torch.uint8 and packed.shape == (5, math.ceil(m / 8))
    assert torch.equal(unpack_signs(packed, m), positive.float() * 2 - 1)


def test_sign_byte_layout():
    # element j at bit j % 8 of byte j // 8; unused high bits of the last byte are zero
    bits = torch.tensor([True, False, True, False, False, False, False, False, False, True])
    assert pack_signs(bits).tolist() == [0b101, 0b10]


@pytest.mark.parametrize(
    "dim, bits, sketch_dim, nbytes",
    [
        (128, 3, None, 32 + 2 + 16 + 2),  # 2-bit MSE indices, MSE norm, 128 signs, residual norm
        (128, 5, None, 64 + 2 + 16 + 2),
        (64, 4, None, 24 + 2 + 8 + 2),
        (100, 3, 37, 25 + 2 + 5 + 2),
    ],
)
def test_code_layout_and_bits_per_element(dim, bits, sketch_dim, nbytes):
    codec = QJLCodec(dim, bits, sketch_dim=sketch_dim)
    assert codec.nbytes == nbytes
    assert codec.bits_per_element == 8 * nbytes / dim  # both fp16 norms included
    if sketch_dim is None:
        assert codec.bits_per_element == bits + 32 / dim
    x = torch.randn(3, 4, dim) * 3
    codes = codec.encode(x)
    assert codes.shape == (3, 4, nbytes) and codes.dtype == torch.uint8
    # the first bytes are exactly the (bits - 1)-bit MSE code
    mse = kvlab.MSECodec(dim, bits - 1, rotation="haar", seed=0, norm_correction=False)
    assert torch.equal(codes[..., : mse.nbytes], mse.encode(x))
    assert torch.equal(codec.decode_mse(codes), mse.decode(mse.encode(x)))
    r_norm = (x - codec.decode_mse(codes)).norm(dim=-1)
    assert torch.allclose(codec.residual_norm(codes), r_norm, rtol=1e-3)
    assert torch.equal(codes, QJLCodec(dim, bits, sketch_dim=sketch_dim).encode(x))  # deterministic


def test_decode_is_the_estimator():
    codec = QJLCodec(64, 4, rotation="hadamard", seed=5)
    k, q = torch.randn(10, 64), torch.randn(3, 64)
    codes = codec.encode(k)
    z = unpack_signs(codes[..., codec.mse.nbytes : codec.mse.nbytes + codec.sign_bytes], 64)
    est = q @ codec.decode_mse(codes).T + codec.residual_norm(codes) * math.sqrt(math.pi / 2) / 64 * (
        (q @ codec.sketch.T) @ z.T
    )
    assert torch.allclose(q @ codec.decode(codes).T, est, atol=1e-4)


def _pairs(dim, n, seed=0):
    """Queries correlated with their keys, so <q, k> is far from 0 and a shrinkage is visible."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, dim, generator=g)
    q = k + torch.randn(n, dim, generator=g)
    return q, k


def test_unbiased_over_seeds():
    """Averaged over the rotation and the sketch, <q, decode(encode(k))> is <q, k>; the MSE codec alone is not."""
    dim, n, seeds = 64, 4, 200
    q, k = _pairs(dim, n)
    s = (q * k).sum(-1).double()
    err_qjl = torch.empty(seeds, n, dtype=torch.float64)
    err_mse = torch.empty(seeds, n, dtype=torch.float64)
    for i in range(seeds):  # Hadamard: a new rotation per seed costs nothing
        codec = QJLCodec(dim, 3, rotation="hadamard", seed=i)
        codes = codec.encode(k)
        err_qjl[i] = (q * codec.decode(codes)).sum(-1).double() - s
        err_mse[i] = (q * codec.decode_mse(codes)).sum(-1).double() - s
    mean, se = err_qjl.mean(0), err_qjl.std(0) / math.sqrt(seeds)
    assert bool((mean.abs() < 4.5 * se).all()), (mean / se).tolist()
    # the test has power: the 2-bit MSE stage shrinks <q, k> by D_mse, dozens of standard errors away
    d_mse = dim * codec.mse.quantizer.mse
    assert bool(((err_mse.mean(0) + d_mse * s).abs() < 0.1 * d_mse * s.abs()).all())
    assert bool((err_mse.mean(0).abs() > 20 * err_mse.std(0) / math.sqrt(seeds)).all())


def test_variance_over_sketches():
    """For a fixed residual r, the variance over S is ||r||^2 / m (pi/2 ||q||^2 - <q, r>^2 / ||r||^2)."""
    dim, n, seeds = 64, 3, 300
    q, k = _pairs(dim, n, seed=1)
    estimates = torch.empty(seeds, n, dtype=torch.float64)
    base = QJLCodec(dim, 4, seed=0)
    for i in range(seeds):
        codec = base.with_sketch(1000 + i)
        assert codec.mse is base.mse and codec.sketch_seed == 1000 + i
        estimates[i] = (q * codec.decode(codec.encode(k))).sum(-1).double()
    r = (k - codec.decode_mse(codec.encode(k))).double()
    r_norm2 = r.square().sum(-1)
    predicted = r_norm2 / dim * (math.pi / 2 * q.double().square().sum(-1) - (q.double() * r).sum(-1).square() / r_norm2)
    assert torch.allclose(estimates.var(0), predicted, rtol=0.25), (estimates.var(0) / predicted).tolist()


def test_checks():
    with pytest.raises(ValueError, match="bits"):
        QJLCodec(64, 2)
    with pytest.raises(ValueError, match="sketch_dim"):
        QJLCodec(64, 3, sketch_dim=0)
    with pytest.raises(ValueError, match="dim"):
        QJLCodec(100, 3, rotation="hadamard")
    codec = QJLCodec(64, 3)
    with pytest.raises(ValueError, match="x"):
        codec.encode(torch.randn(2, 32))
    with pytest.raises(ValueError, match="codes"):
        codec.decode(torch.zeros(2, codec.nbytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="x"):
        codec.encode(torch.full((1, 64), float("nan")))
    assert "QJLCodec(dim=64, bits=3" in repr(codec)
    assert torch.equal(codec.with_sketch(codec.sketch_seed).sketch, codec.sketch)
    with pytest.raises(TypeError, match="sketch_seed"):
        codec.with_sketch(1.5)
