import pytest
import torch

from kvlab import rotation


@pytest.mark.parametrize("kind, dim", [("haar", 3), ("haar", 100), ("haar", 128), ("hadamard", 64), ("hadamard", 256)])
def test_orthogonal_and_seeded(kind, dim):
    r = rotation.rotation_matrix(kind, dim, seed=7, dtype=torch.float64)
    torch.testing.assert_close(r @ r.T, torch.eye(dim, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(r, rotation.rotation_matrix(kind, dim, seed=7, dtype=torch.float64))
    assert not torch.equal(r, rotation.rotation_matrix(kind, dim, seed=8, dtype=torch.float64))


def test_hadamard_structure():
    r = rotation.hadamard(64, seed=3)
    # every entry is +-1/sqrt(dim); rows are a Walsh-Hadamard matrix with signed rows
    torch.testing.assert_close(r.abs(), torch.full((64, 64), 64**-0.5, dtype=torch.float64))
    h = r * r[:, :1].sign() * 64**0.5  # undo the random row signs
    assert torch.equal(h[0], torch.ones(64, dtype=torch.float64))


def test_haar_sign_correction_removes_bias():
    # Without the sign correction, QR of a Gaussian matrix has a biased diagonal; Haar has none.
    dim, n = 16, 400
    diag = torch.stack([torch.diagonal(rotation.haar(dim, seed=s)) for s in range(n)])
    # each diagonal entry has mean 0 and variance 1/dim under Haar measure
    assert diag.mean().abs() < 4 * (1 / dim / (n * dim)) ** 0.5


def test_same_matrix_on_every_device():
    r = rotation.rotation_matrix("haar", 128, seed=1)
    if torch.cuda.is_available():
        assert torch.equal(rotation.rotation_matrix("haar", 128, seed=1, device="cuda").cpu(), r)
    assert torch.equal(r, rotation.haar(128, seed=1).float())


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: rotation.hadamard(96), ValueError, "power of two"),
        (lambda: rotation.haar(2), ValueError, "dim"),
        (lambda: rotation.haar(64, seed=1.5), TypeError, "seed"),
        (lambda: rotation.rotation_matrix("givens", 64), ValueError, "rotation"),
    ],
)
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()
