"""MSE keys centred and scaled per channel: ``reference`` (``CenteredMSECodec``, the oracle) and ``api``
(``store_centered_mse`` / ``load_centered_mse`` over the MSE kernels); the statistics come from
``kvlab.calibration``. Tests: ``tests/ops/test_centered.py``; benchmark: ``benchmarks/bench_decode.py``; page 09."""

from .api import load_centered_mse, store_centered_mse
from .reference import CenteredMSECodec

__all__ = ["CenteredMSECodec", "load_centered_mse", "store_centered_mse"]
