"""The transform codec's Triton kernels against its pure-torch reference: the same bytes, the same values."""

import pytest
import torch

from kvlab.transform import TransformCodec
from kvlab.transform import api
from kvlab.transform import reference as R
from kvlab.transform import triton as K

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU: Triton's interpreter

SHAPES = [  # groups, dim, max bits, gain, tokens
    (1, 7, 3, True, 1),
    (3, 64, 4, True, 63),
    (1, 192, 7, True, 130),
    (2, 5, 8, False, 37),
    (1, 200, 1, True, 17),
    (4, 16, 0, True, 9),
]


def random_codec(groups, dim, max_bits, gain, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(groups, dim, dim, generator=g, dtype=torch.float64))
    q = q.float() * torch.rand(groups, 1, dim, generator=g) * 2
    bits = torch.randint(0, max_bits + 1, (groups, dim), generator=g)
    if max_bits:
        bits[0, 0] = max_bits
    books = torch.sort(torch.randn(groups, dim, 1 << max_bits, generator=g) * 1.5, -1).values
    return TransformCodec(torch.randn(groups, dim, generator=g), q.contiguous(),
                          torch.linalg.inv(q).contiguous(), bits, books, gain).to(DEVICE)


@pytest.mark.parametrize("groups,dim,max_bits,gain,tokens", SHAPES)
def test_store_and_load_equal_the_reference(groups, dim, max_bits, gain, tokens):
    codec = random_codec(groups, dim, max_bits, gain)
    g = torch.Generator().manual_seed(1)
    y = (torch.randn(tokens, groups, dim, generator=g) * torch.rand(tokens, 1, 1, generator=g) * 3).to(DEVICE)
    y[0] = 0.0  # a zero vector: gain 0, codes of 0 (or 1 with ties at 0)
    codes, gains = K.quantize_rows(y, codec)
    ref_codes, ref_gains = R.quantize(codec, y)
    assert torch.equal(codes.long(), ref_codes) and torch.equal(gains.view(torch.int16), ref_gains.view(torch.int16))
    cache = torch.full((tokens + 5, codec.row_bytes), 0xAB, dtype=torch.uint8, device=DEVICE)
    slots = torch.randperm(tokens + 5, generator=g)[:tokens].to(DEVICE)
    slots[-1] = -1 if tokens > 1 else slots[-1]
    K.pack_rows(codes, gains, codec, cache, slots)
    expect = torch.full_like(cache, 0xAB)
    R.write_rows(expect, slots, R.pack(codec, ref_codes, ref_gains))
    assert torch.equal(cache, expect)  # rows of padding tokens and unused rows untouched
    keep = slots[slots >= 0]
    y_hat = K.load_rows(cache, codec, keep)
    rows = R.read_rows(expect, keep)
    assert torch.equal(y_hat, R.dequantize(codec, *R.unpack(codec, rows)))


def test_api_round_trip_in_a_paged_cache():
    codec = random_codec(1, 48, 4, True, seed=3)
    cache = torch.zeros(4, 8, codec.row_bytes, dtype=torch.uint8, device=DEVICE)
    x = torch.randn(20, 48, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    slots = torch.arange(20, dtype=torch.int32, device=DEVICE) + 5
    api.store(x, codec, cache, slots)
    assert torch.equal(cache.view(-1, codec.row_bytes)[5:25], R.encode(codec, x))
    assert torch.allclose(api.load(cache, codec, slots.long()), R.decode(codec, R.encode(codec, x)), atol=1e-5)


@pytest.mark.parametrize("case,error,match", [
    ("x_dtype", TypeError, "x must have dtype"),
    ("x_shape", ValueError, "x must be"),
    ("nan", ValueError, "NaN"),
    ("huge", ValueError, "65504"),
    ("slot_range", ValueError, "slot_mapping must hold rows"),
    ("slot_dtype", TypeError, "slot_mapping"),
    ("cache_bytes", ValueError, "cache must have last dimension"),
    ("codec", TypeError, "codec must be"),
])
def test_bad_inputs_write_nothing(case, error, match):
    codec = random_codec(1, 16, 3, True)
    cache = torch.zeros(10, codec.row_bytes, dtype=torch.uint8, device=DEVICE)
    x, slots, c = torch.randn(4, 16, device=DEVICE), torch.arange(4, device=DEVICE), codec
    if case == "x_dtype":
        x = x.long()
    elif case == "x_shape":
        x = x[:, :15]
    elif case == "nan":
        x[2, 3] = float("nan")
    elif case == "huge":
        x[1] = 1e9
    elif case == "slot_range":
        slots = torch.tensor([0, 1, 2, 10], device=DEVICE)
    elif case == "slot_dtype":
        slots = slots.float()
    elif case == "cache_bytes":
        cache = torch.zeros(10, codec.row_bytes + 1, dtype=torch.uint8, device=DEVICE)
    elif case == "codec":
        c = "codec"
    before = cache.clone()
    with pytest.raises(error, match=match):
        api.store(x, c, cache, slots)
    assert torch.equal(cache, before)
