"""The transform codec's parameters and pure-torch reference: slot layout, round trips, checks."""

import math

import pytest
import torch

from kvlab.transform import TransformCodec
from kvlab.transform import reference as R


def random_codec(groups, dim, *, max_bits=4, gain=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(groups, dim, dim, generator=g))
    bits = torch.randint(0, max_bits + 1, (groups, dim), generator=g)
    books = torch.sort(torch.randn(groups, dim, 1 << max_bits, generator=g), -1).values
    return TransformCodec(torch.randn(groups, dim, generator=g), q.contiguous(), q.transpose(1, 2).contiguous(),
                          bits, books, gain)


@pytest.mark.parametrize("groups,dim,max_bits,gain", [(1, 7, 3, True), (3, 5, 8, True), (2, 64, 4, False), (1, 192, 2, True)])
def test_pack_unpack_round_trip(groups, dim, max_bits, gain):
    codec = random_codec(groups, dim, max_bits=max_bits, gain=gain)
    g = torch.Generator().manual_seed(1)
    codes = (torch.rand(13, groups, dim, generator=g) * (1 << codec.bits.long())).long()
    gain_t = torch.randn(13, groups, generator=g).to(torch.float16) if gain else torch.ones(13, groups, dtype=torch.float16)
    rows = R.pack(codec, codes, gain_t)
    assert rows.shape == (13, codec.row_bytes) and rows.dtype == torch.uint8
    c2, g2 = R.unpack(codec, rows)
    assert torch.equal(c2, codes)
    assert torch.equal(g2.view(torch.int16), gain_t.view(torch.int16))


@pytest.mark.parametrize("gain", [False, True])
def test_rows_of_whole_bytes_ending_in_components_of_no_bits(gain):
    """Codes that fill whole bytes, then components of 0 bits: nothing is read or written past the row."""
    bits = torch.tensor([[4, 4, 4, 4, 0, 0, 0, 0]])
    books = torch.sort(torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(5)), -1).values
    codec = TransformCodec(torch.zeros(1, 8), torch.eye(8)[None], torch.eye(8)[None], bits, books, gain)
    assert codec.row_bytes == 2 + 2 * gain
    x = torch.randn(9, 8, generator=torch.Generator().manual_seed(6))
    codes, g = R.quantize(codec, R.transform(codec, x))
    rows = R.pack(codec, codes, g)
    assert rows.shape == (9, codec.row_bytes)
    c2, g2 = R.unpack(codec, rows)
    assert torch.equal(c2, codes) and torch.equal(g2.view(torch.int16), g.view(torch.int16))
    assert torch.equal(R.decode(codec, rows), R.untransform(codec, R.dequantize(codec, codes, g)))


def test_slot_layout_is_a_little_endian_bit_stream():
    bits = torch.tensor([[3, 0, 5, 8]])
    codec = TransformCodec(torch.zeros(1, 4), torch.eye(4)[None], torch.eye(4)[None], bits,
                           torch.arange(256.0).expand(1, 4, 256).contiguous(), True)
    assert codec.row_bytes == 2 + 2 and codec.bits_per_element == (16 + 16) / 4
    rows = R.pack(codec, torch.tensor([[[5, 0, 17, 200]]]), torch.tensor([[1.5]], dtype=torch.float16))
    stream = 5 | (17 << 3) | (200 << 8)
    assert rows[0, :2].tolist() == [stream & 0xFF, (stream >> 8) & 0xFF]
    assert rows[0, 2:4].view(torch.float16).item() == 1.5


def test_nearest_centroid_and_round_trip_error():
    codec = random_codec(2, 16, max_bits=4, seed=3)
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(4))
    y = R.transform(codec, x)
    codes, gain = R.quantize(codec, y)
    u = y / gain.float().unsqueeze(-1)
    for gi in range(2):
        for c in range(16):
            book = codec.codebooks[gi, c, : 1 << int(codec.bits[gi, c])]
            nearest = (u[:, gi, c, None] - book).abs().argmin(-1)
            close = (u[:, gi, c, None] - book).abs().sort(-1).values
            tie = (close[:, 1] - close[:, 0]).abs() < 1e-5 if close.shape[1] > 1 else torch.zeros(50, dtype=torch.bool)
            assert torch.equal(codes[~tie, gi, c], nearest[~tie])
    x_hat = R.decode(codec, R.encode(codec, x))
    y_hat = R.dequantize(codec, codes, gain)
    assert torch.allclose(x_hat, R.untransform(codec, y_hat), atol=1e-5)
    # with the transform orthogonal, the error in x equals the error in y
    assert math.isclose(float((x_hat - x).square().sum()), float((y_hat - y).square().sum()), rel_tol=1e-3)


def test_paged_rows():
    codec = random_codec(1, 9)
    cache = torch.zeros(3, 4, codec.row_bytes, dtype=torch.uint8)
    rows = torch.randint(0, 256, (5, codec.row_bytes), dtype=torch.uint8)
    slots = torch.tensor([0, 5, -1, 11, 2])
    R.write_rows(cache, slots, rows)
    assert torch.equal(R.read_rows(cache, torch.tensor([0, 5, 11, 2])), rows[[0, 1, 3, 4]])
    assert int(cache.view(-1, codec.row_bytes)[[1, 3, 4, 6, 7, 8, 9, 10]].sum()) == 0


def test_save_load(tmp_path):
    codec = random_codec(3, 6, max_bits=3)
    codec.save(tmp_path / "c.pt")
    back = TransformCodec.load(tmp_path / "c.pt")
    for name in ("mean", "forward", "inverse", "codebooks", "boundaries"):
        assert torch.equal(getattr(back, name), getattr(codec, name))
    assert torch.equal(back.bits.long(), codec.bits.long()) and back.gain == codec.gain


@pytest.mark.parametrize("change,error,match", [
    (dict(mean=torch.zeros(4)), ValueError, "mean"),
    (dict(forward=torch.zeros(1, 4, 3)), ValueError, "forward"),
    (dict(inverse=torch.zeros(1, 4, 4, dtype=torch.float64)), TypeError, "inverse"),
    (dict(bits=torch.full((1, 4), 9)), ValueError, "bits"),
    (dict(bits=torch.full((1, 4), 2.0)), TypeError, "bits"),
    (dict(codebooks=torch.zeros(1, 4, 2)), ValueError, "codebooks"),
    (dict(codebooks=-torch.arange(16.0).expand(1, 4, 16).contiguous()), ValueError, "ascending"),
    (dict(mean=torch.full((1, 4), math.nan)), ValueError, "mean"),
    (dict(gain=1), TypeError, "gain"),
])
def test_bad_parameters(change, error, match):
    args = dict(mean=torch.zeros(1, 4), forward=torch.eye(4)[None], inverse=torch.eye(4)[None],
                bits=torch.full((1, 4), 2), codebooks=torch.arange(16.0).expand(1, 4, 16).contiguous(), gain=True)
    args.update(change)
    with pytest.raises(error, match=match):
        TransformCodec(**args)


def test_transform_kv_save_load(tmp_path):
    from kvlab import RoPE
    from kvlab.transform import TransformKV

    kv = TransformKV([random_codec(1, 8, seed=s) for s in range(2)], [random_codec(2, 4, seed=s) for s in range(2)],
                     RoPE(torch.rand(4, dtype=torch.float64)), sink=1, residual=16)
    kv.save(tmp_path / "kv.pt")
    back = TransformKV.load(tmp_path / "kv.pt")
    assert back.layers == 2 and back.sink == 1 and back.residual == 16
    assert torch.equal(back.rope.inv_freq, kv.rope.inv_freq)
    assert torch.equal(back.values[1].forward, kv.values[1].forward)
    assert back.bits_per_element() == kv.bits_per_element()
    with pytest.raises(ValueError, match="one TransformCodec per layer"):
        TransformKV(kv.keys, kv.values[:1])
    with pytest.raises(TypeError, match="rope"):
        TransformKV(kv.keys, kv.values, rope="yes")
