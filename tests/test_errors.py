"""Bad input raises a clear TypeError/ValueError that names the argument."""

import pytest
import torch

import kvlab

LAYOUT = kvlab.MSESlot(64, 4, 4)


def _cache():
    return torch.zeros(2, 4, 2, LAYOUT.slot_bytes, dtype=torch.uint8)


def _codes(n=3, heads=2):
    return torch.zeros(n, heads, LAYOUT.key_code_bytes, dtype=torch.uint8)


CASES = [
    ("mse bits unsupported", lambda: kvlab.MSECodec(64, 5), ValueError, "bits"),
    ("mse dim too small", lambda: kvlab.MSECodec(2, 4), ValueError, "dim"),
    ("hadamard dim not a power of two", lambda: kvlab.MSECodec(96, 4, rotation="hadamard"), ValueError, "power of two"),
    ("unknown rotation", lambda: kvlab.MSECodec(64, 4, rotation="dct"), ValueError, "rotation"),
    ("norm_correction not bool", lambda: kvlab.MSECodec(64, 4, norm_correction=1), TypeError, "norm_correction"),
    ("x integer dtype", lambda: kvlab.MSECodec(64, 4).encode(torch.ones(2, 64, dtype=torch.int32)), TypeError, "x must have dtype"),
    ("x not a tensor", lambda: kvlab.MSECodec(64, 4).encode([0.0] * 64), TypeError, "x must be a torch.Tensor"),
    ("x wrong last dim", lambda: kvlab.MSECodec(64, 4).encode(torch.ones(2, 63)), ValueError, "last dimension 64"),
    ("x NaN", lambda: kvlab.MSECodec(64, 4).encode(torch.full((2, 64), float("nan"))), ValueError, "NaN or Inf"),
    ("x Inf", lambda: kvlab.MSECodec(64, 4).encode(torch.full((2, 64), float("inf"))), ValueError, "NaN or Inf"),
    ("norm overflows fp16", lambda: kvlab.MSECodec(64, 4).encode(torch.full((1, 64), 1e4)), ValueError, "norm above"),
    ("codes wrong dtype", lambda: kvlab.MSECodec(64, 4).decode(torch.zeros(2, 34)), TypeError, "codes"),
    ("codes wrong width", lambda: kvlab.MSECodec(64, 4).decode(torch.zeros(2, 33, dtype=torch.uint8)), ValueError, "codes"),
    ("decode space", lambda: kvlab.MSECodec(64, 4).decode(torch.zeros(2, 34, dtype=torch.uint8), space="world"), ValueError, "space"),
    ("affine bits", lambda: kvlab.AffineCodec(5, 32), ValueError, "bits"),
    ("affine group_size", lambda: kvlab.AffineCodec(4, 12), ValueError, "group_size"),
    ("affine axis", lambda: kvlab.AffineCodec(4, 32, axis="head"), ValueError, "axis"),
    ("affine dim vs group", lambda: kvlab.AffineCodec(4, 32).encode(torch.ones(2, 48)), ValueError, "group_size"),
    ("affine tokens vs group", lambda: kvlab.AffineCodec(4, 32, "channel").encode(torch.ones(40, 64)), ValueError, "token dimension"),
    ("affine range overflows fp16", lambda: kvlab.AffineCodec(4, 32).encode(torch.tensor([[-7e4] + [7e4] * 31])), ValueError, "overflows fp16"),
    ("affine NaN", lambda: kvlab.AffineCodec(4, 32).encode(torch.full((1, 32), float("nan"))), ValueError, "NaN"),
    ("cache wrong dtype", lambda: kvlab.mse.reference.store_slots(_cache().float(), torch.arange(3), _codes(), _codes(), LAYOUT), TypeError, "cache"),
    ("cache wrong slot bytes", lambda: kvlab.mse.reference.store_slots(_cache()[..., :-1], torch.arange(3), _codes(), _codes(), LAYOUT), ValueError, "cache must have shape"),
    ("slot out of range", lambda: kvlab.mse.reference.store_slots(_cache(), torch.tensor([0, 1, 8]), _codes(), _codes(), LAYOUT), ValueError, "slot_mapping values"),
    ("slot below -1", lambda: kvlab.mse.reference.store_slots(_cache(), torch.tensor([0, 1, -2]), _codes(), _codes(), LAYOUT), ValueError, "slot_mapping values"),
    ("slot_mapping float", lambda: kvlab.mse.reference.store_slots(_cache(), torch.zeros(3), _codes(), _codes(), LAYOUT), TypeError, "slot_mapping"),
    ("slot_mapping length", lambda: kvlab.mse.reference.store_slots(_cache(), torch.arange(2), _codes(), _codes(), LAYOUT), ValueError, "slot_mapping must have shape"),
    ("codes heads mismatch", lambda: kvlab.mse.reference.store_slots(_cache(), torch.arange(3), _codes(heads=3), _codes(heads=3), LAYOUT), ValueError, "key_codes"),
]


@pytest.mark.parametrize("name, call, error, match", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, call, error, match):
    with pytest.raises(error, match=match):
        call()


KERNEL_CALLS = [
    ("store_mse", lambda: kvlab.store_mse(torch.randn(3, 2, 64), torch.randn(3, 2, 64), torch.arange(3), _cache(),
                                          kvlab.MSECodec(64, 4), kvlab.MSECodec(64, 4)), "cache is on cpu"),
    ("load_mse", lambda: kvlab.load_mse(_cache(), torch.arange(3), kvlab.MSECodec(64, 4)), "cache is on cpu"),
    ("encode_affine", lambda: kvlab.encode_affine(torch.randn(4, 64), 4, 32), "x is on cpu"),
    ("decode_affine", lambda: kvlab.decode_affine(torch.zeros(4, 40, dtype=torch.uint8), 4, 32, "token", 64), "codes is on cpu"),
]


@pytest.mark.parametrize("name, call, match", KERNEL_CALLS, ids=[c[0] for c in KERNEL_CALLS])
def test_kernels_need_cuda_unless_interpreted(name, call, match, monkeypatch):
    """CPU tensors reach a kernel only under TRITON_INTERPRET=1; without it the launcher says so."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=match + r".*TRITON_INTERPRET=1"):
        call()
