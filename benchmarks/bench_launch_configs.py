"""Launch configurations of the codec kernels, and where the MSE store's time goes (GPU only).

One run at 4M vectors of dim 128 (8 heads; ``--vectors`` millions): times (median of ``do_bench``)

* ``mse``: the MSE store with Haar (rotation by an fp32 GEMM before the kernel) and with Hadamard
  rotation (fused in the kernel) over several ``num_warps`` / ``block_rows`` / ``piece``, the fp32
  rotation GEMM alone and the same product in fp16, and the rotated-space MSE load over a grid of tiles;
* ``affine``: affine pack (token and channel groups of 32, every width) and the mixed per-head pack
  over tiles of ``block_rows`` x ``num_warps`` 1, 2 and 4, and the channel-axis 3-bit unpack.

Fractions are of the copy bandwidth measured in the same run, over the bytes each call must move (as
``bench_codecs.py`` counts them). Writes ``results/codec_launch_configs.csv`` (with ``--only``:
``codec_launch_configs_<only>.csv``); the libraries' default launches are the fastest of these, and
``bench_codecs.py`` times every kernel at its default.

    python -m benchmarks.bench_launch_configs [--out results] [--only mse|affine|mse_load] [--vectors 4]
"""

from __future__ import annotations

import argparse
import datetime as dt
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

import kvlab
from benchmarks.common import write_csv, write_reference_slots

ROOT = Path(__file__).resolve().parents[1]

D, H = 128, 8


def bench(fn, rep=100):
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--only", choices=("mse", "affine", "mse_load"),
                    help="one part of the sweep (mse_load: the rotated-space MSE load alone, slots written by the reference encoder)")
    ap.add_argument("--vectors", type=int, default=4, help="millions (2^20) of vectors")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    torch.manual_seed(0)
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / bench(lambda: dst.copy_(src)) / 1e6  # GB/s, read + write
    del src, dst
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=dt.date.today().isoformat(), copy_gbps=copy)
    n = args.vectors << 20
    tokens = n // H
    x = torch.randn(tokens, H, D, device="cuda", dtype=torch.float16)
    v = torch.randn_like(x) if args.only in (None, "mse") else None  # the MSE store's values
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("codec_launch_configs" + (f"_{args.only}" if args.only else "") + ".csv")

    def record(kernel, variant, bits, cfg, ms, nbytes):
        rows.append(dict(kernel=kernel, variant=variant, bits=bits, config=" ".join(f"{k}={c}" for k, c in cfg.items()),
                         n_vectors=n, dim=D, time_ms=ms, frac_copy=nbytes / ms / 1e6 / copy))
        write_csv(path, rows, list(rows[0]), meta)  # every row as it is measured: a run cut short keeps them
        print(f"{kernel:12s} {variant:34s} b={bits!s:3s} {rows[-1]['config']:26s} {ms:8.3f} ms "
              f"{100 * rows[-1]['frac_copy']:6.1f} %", flush=True)

    def timed(kernel, variant, bits, configs, call, nbytes):
        for cfg in configs:
            try:
                record(kernel, variant, bits, cfg, bench(lambda: call(kvlab.CodecLaunch(**cfg))), nbytes)
            except Exception as e:  # a config the kernel rejects or cannot compile
                print(f"{kernel} {variant} b={bits} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)

    for bits in (4, 2, 3) if args.only == "mse_load" else ():
        vc = kvlab.MSECodec(D, bits, rotation="haar", seed=1)
        layout = kvlab.MSESlot(D, bits, bits)
        cache = torch.zeros(tokens // 16, 16, H, layout.slot_bytes, dtype=torch.uint8, device="cuda")
        slots = torch.randperm(tokens, device="cuda").to(torch.int32)
        write_reference_slots(cache, slots, vc, vc, x, x.flip(0), layout)
        configs = [dict(block_rows=br, num_warps=w) for br in (16, 32, 64, 128) for w in (1, 2, 4)]
        timed("mse_load", "value, rotated space", bits, configs,
              lambda launch: kvlab.load_mse(cache, slots, vc, part="value", check=False, launch=launch),
              n * layout.value_code_bytes + n * D * 2)
        del cache
    for bits in (4, 2, 3) if args.only in (None, "mse") else ():
        for rot in ("hadamard", "haar"):
            kc, vc = kvlab.MSECodec(D, bits, rotation=rot, seed=0), kvlab.MSECodec(D, bits, rotation=rot, seed=1)
            layout = kvlab.MSESlot(D, bits, bits)
            cache = torch.zeros(tokens // 16, 16, H, layout.slot_bytes, dtype=torch.uint8, device="cuda")
            slots = torch.randperm(tokens, device="cuda").to(torch.int32)
            sweep = rot == "hadamard" and bits == 4
            configs = ([dict(num_warps=w) for w in (1, 2, 4, 8)] + [dict(block_rows=64, num_warps=4), dict(block_rows=256, num_warps=4)]
                       + [dict(num_warps=w, piece=p) for p in (16, 32, 64) for w in (4, 8)] if sweep else [dict(num_warps=4)])
            variant = "haar, K+V, GEMM included" if rot == "haar" else "hadamard, K+V, FWHT fused"
            timed("mse_store", variant, bits, configs,
                  lambda launch: kvlab.store_mse(x, v, slots, cache, kc, vc, check=False, launch=launch), 2 * n * D * 2 + n * layout.slot_bytes)
            if rot == "haar" and bits == 4:
                rot_m = kc.rotation.to("cuda", torch.float32)
                record("gemm", "fp32 x.float() @ R, one tensor", "", {}, bench(lambda: x.view(-1, D).float() @ rot_m), n * D * 2 + n * D * 4)
                rot_h = rot_m.half()
                record("gemm", "fp16 x @ R, one tensor", "", {}, bench(lambda: x.view(-1, D) @ rot_h), n * D * 4)
            if rot == "haar":
                configs = [dict(block_rows=br, num_warps=w) for br in (16, 32, 64, 128) for w in (1, 2, 4)]
                timed("mse_load", "value, rotated space", bits, configs,
                      lambda launch: kvlab.load_mse(cache, slots, vc, part="value", check=False, launch=launch),
                      n * layout.value_code_bytes + n * D * 2)
            del cache

    flat, by_head = x.view(n, D), x.transpose(0, 1).contiguous()
    for axis in ("token", "channel") if args.only in (None, "affine") else ():
        xx = flat if axis == "token" else by_head
        for bits in (4, 3, 8, 2):
            codes = kvlab.encode_affine(xx, bits, 32, axis)
            blocks = (4, 8, 16, 32, 64) if axis == "token" else (1, 2, 4, 8)
            configs = [dict(block_rows=br, num_warps=w) for br in blocks for w in (1, 2, 4)]
            timed("affine_pack", f"{axis} groups of 32", bits, configs,
                  lambda launch: kvlab.encode_affine(xx, bits, 32, axis, check=False, launch=launch), n * D * 2 + codes.numel())
            if axis == "channel" and bits == 3:
                timed("affine_unpack", "channel groups of 32", bits, [dict(block_rows=br, num_warps=w) for br in blocks for w in (4, 8)],
                      lambda launch: kvlab.decode_affine(codes, bits, 32, axis, D, launch=launch), n * D * 2 + codes.numel())
            del codes
    if args.only in (None, "affine"):
        mixed = kvlab.affine.MixedAffineLayout([4, 8] * (H // 2), D, 32)
        codes = kvlab.affine.encode_affine_mixed(x, mixed)
        timed("affine_mixed_pack", "heads 4/8...", "mixed", [dict(block_rows=br, num_warps=w) for br in (4, 8, 16, 32) for w in (1, 2, 4)],
              lambda launch: kvlab.affine.encode_affine_mixed(x, mixed, check=False, launch=launch), n * D * 2 + codes.numel())

    print(f"wrote {path}")


if __name__ == "__main__":
    main()
