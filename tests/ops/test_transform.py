"""The transform codec's Triton kernels against its pure-torch reference: the same bytes, the same values."""

import pytest
import torch

import kvlab.transform

from kvlab.transform import TransformCodec
from kvlab.transform import api
from kvlab.transform import reference as R
from kvlab.transform.triton import load_transform, store_transform

SHAPES = [  # groups, dim, bits ("0-8": random widths up to 8, "4|0": halves of two widths, or one width), gain, tokens
    (1, 7, "0-3", True, 1),
    (3, 64, "0-4", True, 63),
    (1, 192, "0-8", True, 130),
    (3, 200, "0-8", False, 37),
    (1, 200, "1", True, 17),  # eight codes in every byte
    (2, 5, "8", False, 500),  # byte-aligned codes
    (3, 64, "8", True, 63),
    (4, 16, "0", True, 9),  # no code bits: rows of gains only
    (3, 7, "0-2", False, 63),
    (1, 8, "4|0", False, 21),  # whole bytes of codes, then components of no bits at the row's end
    (2, 16, "2|0", True, 5),
]


def random_codec(groups, dim, bits, gain, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(groups, dim, dim, generator=g, dtype=torch.float64))
    s = torch.rand(groups, 1, dim, generator=g, dtype=torch.float64) * 2 + 0.1
    inverse = (q / s).transpose(1, 2)  # (Q diag(s))^-1 = diag(1/s) Q^T, no factorization
    q = q * s
    if "|" in bits:  # the first half of the components one width, the second half another
        first, second = map(int, bits.split("|"))
        high = max(first, second)
        width = torch.tensor([first] * (dim // 2) + [second] * (dim - dim // 2)).expand(groups, dim).contiguous()
    elif "-" in bits:
        low, high = map(int, bits.split("-"))
        width = torch.randint(low, high + 1, (groups, dim), generator=g)
        width[0, 0] = high
    else:
        high = int(bits)
        width = torch.full((groups, dim), high)
    books = torch.sort(torch.randn(groups, dim, 1 << high, generator=g) * 1.5, -1).values
    return TransformCodec(torch.randn(groups, dim, generator=g), q.float().contiguous(), inverse.float().contiguous(),
                          width, books, gain)


def random_y(tokens, groups, dim, seed=1):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(tokens, groups, dim, generator=g) * torch.rand(tokens, groups, 1, generator=g) * 3
    y[0, 0] = 0.0  # a zero vector: gain 0
    return y


@pytest.mark.parametrize("groups,dim,bits,gain,tokens", SHAPES)
def test_store_and_load_equal_the_reference(groups, dim, bits, gain, tokens, device):
    codec = random_codec(groups, dim, bits, gain)  # the reference on the CPU, the kernels on `device`
    kernel_codec = codec.to(device)
    y = random_y(tokens, groups, dim)
    g = torch.Generator().manual_seed(2)
    cache = torch.full((tokens + 5, codec.row_bytes), 0xAB, dtype=torch.uint8)
    slots = torch.randperm(tokens + 5, generator=g)[:tokens]
    if tokens > 1:
        slots[-1] = -1  # padding
    expect = torch.full_like(cache, 0xAB)
    R.write_rows(expect, slots, R.pack(codec, *R.quantize(codec, y)))
    for dtype in (torch.int64, torch.int32):
        cache.fill_(0xAB)
        out = cache.to(device)
        store_transform(y.to(device), kernel_codec, out, slots.to(device, dtype))
        assert torch.equal(out.cpu(), expect)  # codes and gain bytes; rows of padding tokens and unused rows untouched
    keep = slots[slots >= 0]
    y_hat = load_transform(out, kernel_codec, keep.to(device))
    ref = R.dequantize(codec, *R.unpack(codec, R.read_rows(expect, keep)))
    assert torch.equal(y_hat.cpu(), ref)
    pairs = torch.stack([keep, keep.flip(0)]).int().to(device)  # slots of any shape
    both = load_transform(out.view(1, -1, codec.row_bytes), kernel_codec, pairs)
    assert both.shape == (2, keep.shape[0], groups, dim) and torch.equal(both[1].cpu(), ref.flip(0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the GPU tiling; on a GPU it is compiled")
def test_compiled_tiling_under_the_interpreter(monkeypatch):
    """The tiles a GPU launch uses (2048 elements a program: a few tokens each) give the same bytes and values."""
    from kvlab.transform import triton as K

    monkeypatch.setattr(K, "INTERPRETED_BLOCK_ELEMENTS", K.BLOCK_ELEMENTS)
    codec = random_codec(3, 200, "0-8", True)
    y = random_y(37, 3, 200)
    cache = torch.zeros(40, codec.row_bytes, dtype=torch.uint8)
    slots = torch.randperm(40, generator=torch.Generator().manual_seed(3))[:37]
    store_transform(y, codec, cache, slots)
    expect = torch.zeros_like(cache)
    R.write_rows(expect, slots, R.pack(codec, *R.quantize(codec, y)))
    assert torch.equal(cache, expect)
    assert torch.equal(load_transform(cache, codec, slots), R.dequantize(codec, *R.quantize(codec, y)))


def test_paged_cache_round_trip(device):
    """api.store / api.load (their own matrix products) against the reference's encode / decode on the CPU."""
    codec = random_codec(3, 16, "0-5", True, seed=3)
    cache = torch.zeros(4, 8, codec.row_bytes, dtype=torch.uint8, device=device)
    x = torch.randn(20, 48, generator=torch.Generator().manual_seed(2))
    slots = torch.arange(20, dtype=torch.int32, device=device) + 5
    kvlab.transform.store(x.to(device), codec, cache, slots)  # a CPU codec: moved to the cache's device once
    rows = cache.view(-1, codec.row_bytes).cpu()
    ref = R.encode(codec.to(device), x.to(device)).cpu()  # the same matrix product on the same device
    assert torch.equal(rows[5:25], ref)
    assert torch.equal(rows[:5], torch.zeros(5, codec.row_bytes, dtype=torch.uint8))
    assert torch.allclose(kvlab.transform.load(cache, codec, slots.long()).cpu(), R.decode(codec, ref), atol=1e-5)
    assert api.load(cache, codec, slots[:0]).shape == (0, 48)
    api.store(x[:0].to(device), codec, cache, slots[:0])  # no tokens: nothing to do


def test_gain_ties_and_extremes(device):
    """Gains at fp16's ends and values on a boundary times the gain: the same codes as the reference."""
    codec = random_codec(1, 32, "0-4", True, seed=5)
    y = torch.randn(6, 1, 32, generator=torch.Generator().manual_seed(4))
    y[1] *= 3e4  # gains near 65504
    y[2] *= 2e-4  # gains near fp16's smallest normal number
    y[3, 0, :] = 1.0  # gain exactly 1: every component on codebook boundaries' scale
    y[3, 0, 0] = float(codec.boundaries[0, 0, 0])  # a value on a boundary (gain 1): not above it
    cache = torch.zeros(6, codec.row_bytes, dtype=torch.uint8, device=device)
    store_transform(y.to(device), codec.to(device), cache, torch.arange(6, device=device))
    assert torch.equal(cache.cpu(), R.pack(codec, *R.quantize(codec, y)))


BAD_STORE = [  # case, error, message
    ("x_dtype", TypeError, "x must have dtype"),
    ("x_shape", ValueError, "x must be"),
    ("x_device", ValueError, "x is on the meta device, which holds shapes but no data"),
    ("nan", ValueError, "NaN"),
    ("inf", ValueError, "NaN or Inf"),
    ("huge", ValueError, "65504"),
    ("tiny", ValueError, "smallest normal"),
    ("slot_range", ValueError, "slot_mapping must hold rows"),
    ("slot_low", ValueError, "slot_mapping must hold rows"),
    ("slot_dtype", TypeError, "slot_mapping must have dtype"),
    ("slot_shape", ValueError, "slot_mapping must be 1-d with 4 entries"),
    ("cache_dtype", TypeError, "cache must have dtype"),
    ("cache_bytes", ValueError, "cache must have last dimension"),
    ("cache_strided", ValueError, "cache must be contiguous"),
    ("codec", TypeError, "codec must be"),
]


@pytest.mark.parametrize("case,error,match", BAD_STORE)
def test_store_bad_inputs_write_nothing(case, error, match, device):
    codec = random_codec(1, 16, "0-3", True).to(device)
    cache = torch.zeros(10, codec.row_bytes, dtype=torch.uint8, device=device)
    x, slots, c = torch.randn(4, 16, device=device), torch.arange(4, device=device), codec
    if case == "x_dtype":
        x = x.long()
    elif case == "x_shape":
        x = x[:, :15]
    elif case == "x_device":
        x = x.to("meta")
    elif case == "nan":
        x[2, 3] = float("nan")
    elif case == "inf":
        x[0, 0] = float("inf")
    elif case == "huge":
        x[1] = 1e9
    elif case == "tiny":
        x[1] = codec.mean[0] + 1e-6 * torch.randn(16, device=device)
    elif case == "slot_range":
        slots = torch.tensor([0, 1, 2, 10], device=device)
    elif case == "slot_low":
        slots = torch.tensor([0, 1, -2, 3], device=device)
    elif case == "slot_dtype":
        slots = slots.float()
    elif case == "slot_shape":
        slots = torch.arange(5, device=device)
    elif case == "cache_dtype":
        cache = cache.to(torch.int8)
    elif case == "cache_bytes":
        cache = torch.zeros(10, codec.row_bytes + 1, dtype=torch.uint8, device=device)
    elif case == "cache_strided":
        cache = torch.zeros(10, 2 * codec.row_bytes, dtype=torch.uint8, device=device)[:, : codec.row_bytes]
    elif case == "codec":
        c = "codec"
    before = cache.clone()
    with pytest.raises(error, match=match):
        api.store(x, c, cache, slots)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("case,error,match", [
    ("slot_range", ValueError, r"slots must hold rows in \[0, 10\)"),
    ("padding", ValueError, "slots must hold rows"),
    ("slot_dtype", TypeError, "slots must have dtype"),
    ("slot_shape", ValueError, "slots must be 1-d"),
    ("cache_bytes", ValueError, "cache must have last dimension"),
    ("codec", TypeError, "codec must be"),
])
def test_load_bad_inputs(case, error, match, device):
    codec = random_codec(1, 16, "0-3", True).to(device)
    cache = torch.zeros(10, codec.row_bytes, dtype=torch.uint8, device=device)
    slots, c = torch.arange(4, device=device), codec
    if case == "slot_range":
        slots = torch.tensor([0, 10], device=device)
    elif case == "padding":
        slots = torch.tensor([0, -1], device=device)
    elif case == "slot_dtype":
        slots = slots.double()
    elif case == "slot_shape":
        slots = slots.view(2, 2)
    elif case == "cache_bytes":
        cache = torch.zeros(10, codec.row_bytes + 2, dtype=torch.uint8, device=device)
    elif case == "codec":
        c = codec.mean
    with pytest.raises(error, match=match):
        api.load(cache, c, slots)


def test_kernel_launchers_check_types_and_shapes(device):
    codec = random_codec(2, 8, "0-3", True).to(device)
    cache = torch.zeros(10, codec.row_bytes, dtype=torch.uint8, device=device)
    y, slots = torch.randn(3, 2, 8, device=device), torch.arange(3, device=device)
    with pytest.raises(TypeError, match="y must have dtype"):
        store_transform(y.double(), codec, cache, slots)
    with pytest.raises(ValueError, match=r"y must be \[tokens, groups, dim\]"):
        store_transform(y.view(3, 16), codec, cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        store_transform(y, codec, cache, torch.arange(4, device=device))
    with pytest.raises(ValueError, match="y is on the meta device, which holds shapes but no data"):
        store_transform(y.to("meta"), codec, cache, slots)
    with pytest.raises(TypeError, match="slots must have dtype"):
        load_transform(cache, codec, torch.zeros(3, device=device))
    assert torch.equal(cache, torch.zeros_like(cache))


def test_unchecked_rows_outside_the_cache_are_neither_written_nor_read(device):
    """check=False skips the host sync: a row outside the cache is not written, and reads as zeros (never memory
    past the cache, here a neighbouring layer of one buffer)."""
    codec = random_codec(2, 16, "0-4", True, seed=2).to(device)
    layers = torch.zeros(2, 3, 4, codec.row_bytes, dtype=torch.uint8, device=device)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3)).to(device)
    slots = torch.tensor([0, 1, 2, 12], device=device)  # 12: past the 12 rows of layer 0
    api.store(x, codec, layers[0], slots, check=False)
    assert not layers[1].any()
    assert torch.equal(layers[0].view(-1, codec.row_bytes)[:3].cpu(), R.encode(codec, x[:3]).cpu())
    layers[1].fill_(255)
    y = load_transform(layers[0], codec, torch.tensor([2, 12, -1, 10**9], device=device)).cpu()
    assert torch.equal(y[1:], torch.zeros_like(y[1:]))
    assert torch.equal(y[0], load_transform(layers[0], codec, torch.tensor([2], device=device)).cpu()[0])
    for bad in (None, "yes", 1):
        with pytest.raises(TypeError, match="check must be a bool"):
            api.store(x, codec, layers[0], slots, check=bad)
        with pytest.raises(TypeError, match="check must be a bool"):
            api.load(layers[0], codec, slots, check=bad)
