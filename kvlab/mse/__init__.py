"""The MSE codec in the paged cache: rotated Lloyd-Max codes of keys and values.

``api``: ``store_mse`` / ``load_mse`` (checks, then the kernel the support matrix picks); ``triton_store`` /
``triton_load``: the Triton kernels (every device, and the CPU through Triton's interpreter); ``gluon_store`` /
``gluon_load``: the Gluon kernels of the Hadamard store and the model-space load on CUDA GPUs. The oracle is
``reference`` (``MSECodec``, ``store_slots`` / ``load_slots``), which none of these import. Tests:
``tests/ops/test_mse.py``; benchmark: ``benchmarks/bench_codecs.py``; pages 02 and 14.
"""

from .api import load_mse, store_mse

__all__ = ["load_mse", "store_mse"]
