"""GPU benchmarks, one script per op, each timing its kernels against a baseline measured in the same run and
writing CSV/JSON (device, versions, date, command) under ``results/``. Run from the repository root:
``python -m benchmarks.<script> --help``.

* ``bench_codecs``: the MSE and affine codecs' store/load kernels against the device's copy bandwidth
  (``--only mse_store|mse_load|affine``); ``bench_launch_configs``: their launch configurations.
* ``bench_decode``: ``decode_attention`` over every cache format against torch SDPA in fp16 (batch x context grid).
* ``bench_transform``: the transform codec's store and decode against the MSE codec and SDPA.
* ``bench_generate``: whole-model decode steps through ``kvlab.generate`` against transformers' fastest fp16 generation.
* ``ncu_store`` / ``ncu_load`` / ``ncu_decode``: one call under Nsight Compute, summarised; ``sass_profile``: what
  the compiler makes of each kernel (no GPU needed).
* ``compare``: a rerun's timings against the committed ones; ``kernel_fingerprint``: the device code of every
  launch the benchmarks time, compiled on any machine (``compile_only``), to compare two checkouts without a GPU.
* ``common``: timing, test runs and CSV writing they share; ``baselines/``: the simpler kernels the codec
  benchmark compares against.
"""
