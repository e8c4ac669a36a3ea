"""A fingerprint of the bytes kvlab's codecs write, for results computed with them.

``codec_fingerprint()`` encodes one fixed set of vectors with every reference codec (MSE with Haar and
Hadamard rotations at 2, 3 and 4 bits, the centred MSE key codec with and without RoPE, affine at 2, 3,
4 and 8 bits on the token and channel axes) and hashes the codes. A committed result that was measured
with the codecs records the fingerprint it was measured under; ``tests/test_results.py`` fails when the
codecs' bytes change and such a result was not measured again.

``source_fingerprint(notebook)`` hashes the code a run of a page executed: the page's cells (not its outputs)
and every Python file of the ``kvlab`` package. ``scripts/run_notebooks.py --record`` stores it with each
page's run, so the book can tell a run of the current code from a run of an earlier one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..calibration import RoPE
from ..centered.reference import CenteredMSECodec
from ..affine.reference import AffineCodec
from ..mse.reference import MSECodec

__all__ = ["codec_fingerprint", "source_fingerprint", "transform_fingerprint"]

PACKAGE = Path(__file__).resolve().parent.parent


def _vectors(tokens: int = 64, heads: int = 3, dim: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(20261203)
    x = torch.randn(tokens, heads, dim, generator=g)
    x[..., :4] *= 8.0  # outlier channels, as real keys have
    return x + torch.randn(heads, dim, generator=g)  # a mean per channel


def codec_fingerprint() -> str:
    """SHA-256 (hex, 16 characters) of the codes every reference codec writes for one fixed input."""
    x = _vectors()
    tokens, heads, dim = x.shape
    h = hashlib.sha256()

    def add(label: str, codes: torch.Tensor) -> None:
        h.update(label.encode())
        h.update(codes.contiguous().view(torch.uint8).numpy().tobytes())

    for rotation in ("haar", "hadamard"):
        for bits in (2, 3, 4):
            add(f"mse {rotation} {bits}", MSECodec(dim, bits, rotation=rotation).encode(x))
    mean, scale = x.mean(0), x.std(0) + 0.5
    rope = RoPE(1e4 ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    positions = torch.arange(tokens)
    for bits in (2, 3, 4):
        add(f"centered {bits}", CenteredMSECodec(dim, bits, mean, scale).encode(x))
        add(f"centered rope {bits}", CenteredMSECodec(dim, bits, mean, scale, rope=rope).encode(x, positions))
    for bits in (2, 3, 4, 8):
        add(f"affine token {bits}", AffineCodec(bits, 32, "token").encode(x.transpose(0, 1)))
        add(f"affine channel {bits}", AffineCodec(bits, 32, "channel").encode(x.transpose(0, 1)))
    return h.hexdigest()[:16]


def transform_fingerprint() -> str:
    """SHA-256 (hex, 16 characters) of the codes of a transform codec calibrated on fixed synthetic vectors
    (``kvlab.transform.calibration``: weighting, KLT, codebooks, greedy and uniform bits) and of its encoding."""
    from ..transform import reference as TR
    from ..transform.calibration import assemble, fit_curves

    g = torch.Generator().manual_seed(20261204)
    x = _vectors(512, 2, 16) @ torch.randn(16, 16, generator=g)  # correlated channels
    a = torch.randn(2, 16, 16, generator=g, dtype=torch.float64)
    weight = a @ a.transpose(1, 2) / 16 + torch.eye(16, dtype=torch.float64)
    h = hashlib.sha256()
    for groups in (1, 2):
        fits = fit_curves(x, weight, groups=groups)
        for allocation in ("greedy", "uniform"):
            codec = assemble(fits, 3 * 32 // groups, allocation=allocation)
            h.update(f"transform {groups} {allocation}".encode())
            h.update(codec.bits.numpy().tobytes())
            h.update(TR.encode(codec, x.reshape(512, 32)).numpy().tobytes())
    return h.hexdigest()[:16]


def source_fingerprint(notebook: str | Path, package: str | Path = PACKAGE) -> dict[str, str]:
    """SHA-256 (hex, 16 characters each) of a notebook's cells and of a package's Python files.

    ``{"page": ..., "kvlab": ...}``. The page's hash covers each cell's type and source, in order, and not its
    outputs, execution counts or metadata, and skips the cell papermill injects with a run's parameters (so a
    source notebook and its executed copy hash alike); the
    package's covers every ``*.py`` file under ``package`` with its relative path."""
    notebook, package = Path(notebook), Path(package)
    if not notebook.is_file():
        raise ValueError(f"notebook: no such file {notebook}")
    if not package.is_dir():
        raise ValueError(f"package: no such folder {package}")
    cells = json.loads(notebook.read_text())["cells"]
    page = hashlib.sha256()
    for cell in cells:
        if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
            continue
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        page.update(json.dumps([cell["cell_type"], source]).encode())
    code = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        code.update(str(path.relative_to(package).as_posix()).encode() + b"\0")
        code.update(path.read_bytes() + b"\0")
    return {"page": page.hexdigest()[:16], "kvlab": code.hexdigest()[:16]}
