"""Codec error metrics and synthetic vectors (kvlab.study.metrics)."""

import math

import pytest
import torch

import kvlab
from kvlab.study import metrics as M


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", M.KINDS)
def test_synthetic_vectors_shape_and_seed(kind):
    x = M.synthetic_vectors(kind, 300, 64, seed=3)
    assert x.shape == (300, 64) and x.dtype == torch.float32 and bool(torch.isfinite(x).all())
    assert torch.equal(x, M.synthetic_vectors(kind, 300, 64, seed=3))
    assert not torch.equal(x, M.synthetic_vectors(kind, 300, 64, seed=4))


def test_synthetic_vectors_distributions():
    g = M.synthetic_vectors("gaussian", 20_000, 16)
    t = M.synthetic_vectors("student_t", 20_000, 16, df=5)
    assert g.var().item() == pytest.approx(1.0, rel=0.03)
    assert t.var().item() == pytest.approx(1.0, rel=0.1)  # scaled to unit variance
    kurtosis = lambda x: (x.double().pow(4).mean() / x.double().square().mean().square()).item()  # noqa: E731
    assert kurtosis(g) == pytest.approx(3.0, rel=0.05)
    assert kurtosis(t) > 5.0  # Student-t(5): 9 in theory; heavy tails
    o = M.synthetic_vectors("outlier_channels", 5000, 64, num_outliers=3, outlier_scale=10.0)
    std = o.std(0)
    assert int((std > 5).sum()) == 3
    assert std[std > 5].mean().item() == pytest.approx(10.0, rel=0.05)
    assert std[std < 5].mean().item() == pytest.approx(1.0, rel=0.05)


def test_synthetic_vectors_checks():
    with pytest.raises(ValueError, match="kind"):
        M.synthetic_vectors("uniform", 4, 8)
    with pytest.raises(ValueError, match="num_outliers"):
        M.synthetic_vectors("outlier_channels", 4, 8, num_outliers=9)
    with pytest.raises(ValueError, match="df"):
        M.synthetic_vectors("student_t", 4, 8, df=2)
    with pytest.raises(TypeError, match="num"):
        M.synthetic_vectors("gaussian", 4.0, 8)


def test_scaled_queries_set_the_score_spread():
    k = M.synthetic_vectors("outlier_channels", 1000, 64)
    for std in (0.5, 3.0):
        q = M.scaled_queries(k, 50, std, seed=1)
        assert q.shape == (50, 64)
        assert (q.double() @ k.double().T / 8.0).std().item() == pytest.approx(std, rel=1e-6)
    with pytest.raises(ValueError, match="score_std"):
        M.scaled_queries(k, 5, 0.0)


def test_relative_mse():
    x = torch.randn(100, 32)
    assert M.relative_mse(x, x) == 0.0
    assert M.relative_mse(x, 0.9 * x) == pytest.approx(0.01, rel=1e-5)
    with pytest.raises(ValueError, match="x_hat"):
        M.relative_mse(x, x[:, :16])


def test_inner_product_error_splits_shrinkage_and_noise():
    torch.manual_seed(0)
    q, k = torch.randn(200, 64, dtype=torch.float64), torch.randn(500, 64, dtype=torch.float64)
    e = M.inner_product_error(q, k, 0.9 * k)
    assert e.bias == pytest.approx(-0.1, abs=1e-12) and e.variance == pytest.approx(0.0, abs=1e-20)
    # independent noise of variance 0.04 per channel: no shrinkage, variance 0.04 * ||q||^2 / E<q, k>^2 = 0.04
    e = M.inner_product_error(q, k, k + 0.2 * torch.randn_like(k))
    assert abs(e.bias) < 0.01 and e.variance == pytest.approx(0.04, rel=0.05)
    with pytest.raises(ValueError, match="q"):
        M.inner_product_error(q[:, :32], k, k)


def test_attention_matches_torch():
    torch.manual_seed(0)
    q, k, v = torch.randn(7, 32), torch.randn(50, 32), torch.randn(50, 16)
    w, o = M.attention(q, k, v)
    assert torch.allclose(w.sum(-1), torch.ones(7, dtype=torch.float64))
    ref = torch.nn.functional.scaled_dot_product_attention(q.double()[None], k.double()[None], v.double()[None])[0]
    assert torch.allclose(o, ref, atol=1e-12)
    with pytest.raises(ValueError, match="v"):
        M.attention(q, k, v[:10])


def test_attention_error():
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 16) * 10, torch.randn(40, 16), torch.randn(40, 16)
    same = M.attention_error(q, k, v, k, v)
    assert same.score == 0.0 and same.output == 0.0
    # reversed keys move the attention elsewhere; weights that are nearly one-hot make TV close to 1
    far = M.attention_error(q, k, v, -k, v)
    assert 0.9 < far.score <= 1.0
    assert M.attention_error(q, k, v, k, 1.1 * v).output == pytest.approx(0.01, rel=1e-5)


@pytest.mark.parametrize(
    "codec",
    [
        kvlab.MSECodec(64, 3, rotation="hadamard"),
        kvlab.AffineCodec(4, 32, "token"),
        kvlab.AffineCodec(2, 32, "channel"),
        kvlab.study.qjl.QJLCodec(64, 3),
    ],
    ids=repr,
)
def test_roundtrip_every_codec(codec):
    x = M.synthetic_vectors("gaussian", 64, 64)
    x_hat = M.roundtrip(codec, x)
    assert x_hat.shape == x.shape and x_hat.dtype == torch.float32
    assert M.relative_mse(x, x_hat) < 0.5


def test_codec_errors_of_the_mse_codec():
    """Without norm correction the MSE codec shrinks inner products by its distortion D_mse."""
    k = M.synthetic_vectors("gaussian", 2048, 128, seed=100)
    v = M.synthetic_vectors("gaussian", 2048, 128, seed=101)
    q = M.scaled_queries(k, 32, 2.0, seed=102)
    codec = kvlab.MSECodec(128, 2, norm_correction=False)
    e = M.codec_errors(codec, k, v, q)
    d_mse = 128 * codec.quantizer.mse
    assert e.bits_per_element == codec.bits_per_element == 2.125
    assert e.relative_mse == pytest.approx(d_mse, rel=0.05)
    assert e.ip_bias == pytest.approx(-d_mse, rel=0.1)
    assert e.ip_variance == pytest.approx(d_mse * (1 - d_mse), rel=0.1)
    keys_only = M.codec_errors(codec, k, v, q, quantize_values=False)
    assert keys_only.attention_score == e.attention_score and keys_only.attention_output < e.attention_output
    with pytest.raises(TypeError, match="quantize_values"):
        M.codec_errors(codec, k, v, q, quantize_values=1)


def test_frontier():
    bits = [2.0, 3.0, 4.0, 3.5, 5.0, 6.0]
    errs = [0.4, 0.1, 0.06, 0.2, 0.01, 0.02]
    xs, ys = M.frontier(bits, errs)
    assert xs == [2.0, 3.0, 5.0] and ys == [0.4, 0.1, 0.01]  # 3.5 is dominated, 4.0 lies above the chord, 6.0 is worse
    assert M.frontier_at(bits, errs, 2.5) == pytest.approx(0.25)
    assert M.frontier_at(bits, errs, 4.0) == pytest.approx(0.055)
    assert M.frontier_at(bits, errs, 7.0) == 0.01
    assert math.isnan(M.frontier_at(bits, errs, 1.9))
    assert M.frontier([3.0, 3.0], [0.2, 0.1]) == ([3.0], [0.1])
    with pytest.raises(ValueError, match="at least one"):
        M.frontier([], [])
