"""A fingerprint of the bytes kvlab's codecs write, for results computed with them.

``codec_fingerprint()`` encodes one fixed set of vectors with every reference codec (MSE with Haar and
Hadamard rotations at 2, 3 and 4 bits, the centred MSE key codec with and without RoPE, affine at 2, 3,
4 and 8 bits on the token and channel axes) and hashes the codes. A committed result that was measured
with the codecs records the fingerprint it was measured under; ``tests/test_results.py`` fails when the
codecs' bytes change and such a result was not measured again. The Haar rotation is a float32 matrix
product, whose last bits depend on the path the CPU's matrix products take (MKL's AVX-512, AVX2 or
reproducible path): the vectors are those whose codes and fp16 scales lie at least ``MARGIN`` from a
decision, judged in float64, so that every path writes the same bytes for them.

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


MARGIN = 1e-5  # far beyond the float32 rounding in which two floating-point paths differ (about 1e-7)


def _decided_with_margin(codec: MSECodec, z: torch.Tensor) -> torch.Tensor:
    """``[...]`` bool: tokens ``z [..., dim]`` whose Haar codes and fp16 scale lie at least ``MARGIN`` from a decision
    (a boundary or zero for a normalised coordinate, a rounding midpoint of fp16 for the scale), judged in float64."""
    y = z.double() @ codec.rotation.double()
    norm = y.square().sum(-1).sqrt()
    unit = y / norm.unsqueeze(-1)
    half = 1 << (codec.bits - 1)
    positive = codec.boundaries[half:].double()
    clear = (unit.abs() > MARGIN) & ((unit.abs().unsqueeze(-1) - positive).abs() > MARGIN).all(-1)
    m = torch.bucketize(unit.abs(), positive)
    scale = norm / codec.codebook.double()[torch.where(unit > 0, m, half + m)].square().sum(-1).sqrt()
    steady = (scale * (1 - MARGIN)).to(torch.float16) == (scale * (1 + MARGIN)).to(torch.float16)
    return clear.all(-1) & steady


def _fingerprint_vectors(tokens: int = 64, heads: int = 3, dim: int = 64):
    """The first ``tokens`` of a fixed random set (``_vectors``) whose codes every Haar codec of the fingerprint
    decides with ``MARGIN`` to spare, and their positions in that set (the RoPE-centred codec's positions)."""
    x = _vectors(8 * tokens, heads, dim)
    positions = torch.arange(x.shape[0])
    keep = torch.ones(x.shape[0], dtype=torch.bool)
    for bits in (2, 3, 4):
        keep &= _decided_with_margin(MSECodec(dim, bits, rotation="haar"), x).all(-1)
        for codec, z in _centred_codecs(x, bits, positions):
            keep &= _decided_with_margin(codec.mse, z).all(-1)
    chosen = keep.nonzero().flatten()[:tokens]
    if chosen.numel() < tokens:
        raise RuntimeError(f"only {chosen.numel()} of {x.shape[0]} vectors are decided with margin {MARGIN}")
    return x[chosen], positions[chosen]


def _centred_codecs(x: torch.Tensor, bits: int, positions: torch.Tensor):
    """The fingerprint's two centred codecs at ``bits`` and what each hands its MSE codec for ``x``. Their mean and
    scale come from the first 64 vectors of ``_vectors``, whichever vectors are coded."""
    base = _vectors()
    dim = x.shape[-1]
    mean, scale = base.mean(0), base.std(0) + 0.5
    rope = RoPE(1e4 ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    plain = CenteredMSECodec(dim, bits, mean, scale)
    turned = CenteredMSECodec(dim, bits, mean, scale, rope=rope)
    return [(plain, plain.normalize(x)), (turned, turned.normalize(x, positions))]


def codec_fingerprint() -> str:
    """SHA-256 (hex, 16 characters) of the codes every reference codec writes for one fixed input."""
    x, positions = _fingerprint_vectors()
    tokens, heads, dim = x.shape
    h = hashlib.sha256()

    def add(label: str, codes: torch.Tensor) -> None:
        h.update(label.encode())
        h.update(codes.contiguous().view(torch.uint8).numpy().tobytes())

    for rotation in ("haar", "hadamard"):
        for bits in (2, 3, 4):
            add(f"mse {rotation} {bits}", MSECodec(dim, bits, rotation=rotation).encode(x))
    for bits in (2, 3, 4):
        (plain, _), (turned, _) = _centred_codecs(x, bits, positions)
        add(f"centered {bits}", plain.encode(x))
        add(f"centered rope {bits}", turned.encode(x, positions))
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
