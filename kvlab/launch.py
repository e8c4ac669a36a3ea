"""How the codec kernels are launched: ``CodecLaunch``, the one optional tuning argument (``launch=``) of
``store_mse``, ``load_mse``, ``encode_affine`` / ``decode_affine`` (and their ``_mixed`` forms) and
``kvlab.centered.store_centered_mse``. Left out, or any field left at ``None``, a kernel takes the
configuration measured fastest on an H200 (``benchmarks/bench_launch_configs.py``); the bytes written and read
never depend on it. ``decode_attention`` has its own, ``kvlab.attention.DecodeLaunch``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from . import _checks as C

__all__ = ["CodecLaunch"]

NUM_WARPS = (1, 2, 4, 8, 16, 32)
PIECES = (16, 32, 64, 128)


@dataclass(frozen=True)
class CodecLaunch:
    """Launch settings of a codec kernel; ``None`` is the default measured fastest.

    ``block_rows``: rows (vectors; affine codes on the channel axis) per program, a power of two.
    ``num_warps``: warps per program (1, 2, 4, 8, 16 or 32).
    ``piece`` (``store_mse`` only): columns of a row one thread holds (16, 32, 64 or 128).
    ``fast`` (``load_mse`` only, model space): look centroids up by byte permutes of 32-bit code words.
    """

    block_rows: int | None = None
    num_warps: int | None = None
    piece: int | None = None
    fast: bool | None = None


def launch_settings(launch, op: str, takes: tuple[str, ...] = ("block_rows", "num_warps")) -> tuple:
    """Check ``launch`` (a ``CodecLaunch`` or None) for ``op``, which takes the fields ``takes``; their values."""
    if launch is None:
        launch = CodecLaunch()
    elif not isinstance(launch, CodecLaunch):
        raise TypeError(f"launch must be a kvlab.CodecLaunch or None, got {type(launch).__name__}")
    for f in fields(CodecLaunch):
        if f.name not in takes and getattr(launch, f.name) is not None:
            raise ValueError(f"launch.{f.name} does not apply to {op}, which takes {', '.join(takes)}")
    if launch.block_rows is not None:
        C.check_int("launch.block_rows", launch.block_rows, minimum=1)
        if launch.block_rows & (launch.block_rows - 1):
            raise ValueError(f"launch.block_rows must be a power of two, got {launch.block_rows}")
    if launch.num_warps is not None:
        C.check_int("launch.num_warps", launch.num_warps, NUM_WARPS)
    if launch.piece is not None:
        C.check_int("launch.piece", launch.piece, PIECES)
    C.check_bool("launch.fast", launch.fast, optional=True)
    return tuple(getattr(launch, name) for name in takes)
