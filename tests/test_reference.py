"""The pure-torch reference codecs and the paged layout."""

import math

import pytest
import torch

import kvlab
from kvlab.layout import code_order
from kvlab.packing import fp16_bytes, fp16_from_bytes


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 63, 128, 130])
def test_pack_roundtrip(bits, n):
    idx = torch.randint(0, 2**bits, (5, n))
    packed = kvlab.packing.pack_indices(idx, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, kvlab.layout.packed_bytes(n, bits))
    assert torch.equal(kvlab.packing.unpack_indices(packed, bits, n), idx)


def test_pack_byte_layout():
    # 4 bit: low nibble first; 2 bit: four per byte from the low bits; 3 bit: bit stream, j at bit 3j.
    assert kvlab.packing.pack_indices(torch.tensor([1, 2, 15, 0]), 4).tolist() == [0x21, 0x0F]
    assert kvlab.packing.pack_indices(torch.tensor([1, 2, 3, 0, 3]), 2).tolist() == [0b00111001, 0b11]
    # 3 bit: [5, 6, 7] -> bits 101 110 111 -> stream (LSB first) 0b111_110_101 -> bytes 0xF5, 0x01
    assert kvlab.packing.pack_indices(torch.tensor([5, 6, 7]), 3).tolist() == [0xF5, 0x01]
    assert kvlab.packing.pack_indices(torch.tensor([7] * 8), 3).tolist() == [0xFF, 0xFF, 0xFF]


def testfp16_bytes_little_endian():
    x = torch.tensor([1.0, -2.5, 65504.0, 0.0, 6e-8], dtype=torch.float16)
    b = fp16_bytes(x)
    assert b[0].tolist() == [0x00, 0x3C] and b[1].tolist() == [0x00, 0xC1]
    assert torch.equal(fp16_from_bytes(b), x)


@pytest.mark.parametrize("dim, rotation", [(64, "haar"), (128, "hadamard"), (100, "haar"), (256, "hadamard")])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_mse_distortion_matches_lloyd_max(dim, rotation, bits):
    """Unit vectors: E||u - u_hat||^2 equals dim * mse of the Lloyd-Max quantizer (no norm correction)."""
    torch.manual_seed(0)
    u = torch.nn.functional.normalize(torch.randn(4000, dim, dtype=torch.float64), dim=-1).float()
    codec = kvlab.MSECodec(dim, bits, rotation=rotation, norm_correction=False)
    d_mse = (codec.decode(codec.encode(u)) - u).square().sum(-1).mean().item()
    assert d_mse == pytest.approx(dim * codec.quantizer.mse, rel=0.03)


def test_mse_code_layout_and_norm():
    codec = kvlab.MSECodec(128, 4)
    assert codec.nbytes == 66 and codec.bits_per_element == 4.125
    assert kvlab.MSECodec(128, 3).bits_per_element == 3.125
    assert kvlab.MSECodec(100, 3).nbytes == math.ceil(300 / 8) + 2
    x = torch.randn(3, 5, 128) * 7
    codes = codec.encode(x)
    assert codes.shape == (3, 5, 66)
    # the stored scale: the norm without norm correction; with it, the norm over |c[idx]|, rounded once
    plain = kvlab.MSECodec(128, 4, norm_correction=False)
    assert torch.equal(plain.encode(x)[..., :64], codes[..., :64])
    norms = fp16_from_bytes(plain.encode(x)[..., 64:])
    assert torch.equal(norms, x.norm(dim=-1).half())
    length = codec.codebook[kvlab.packing.unpack_indices(codes[..., :64], 4, 128)].double().square().sum(-1).sqrt().float()
    assert torch.equal(fp16_from_bytes(codes[..., 64:]), (x.norm(dim=-1) / length).half())
    # rotated and model space agree through the rotation; norm correction keeps the norm (fp16 rounding)
    rot = codec.decode(codes, space="rotated")
    torch.testing.assert_close(codec.decode(codes), rot @ codec.rotation.T)
    torch.testing.assert_close(rot.norm(dim=-1), x.norm(dim=-1), rtol=2**-11, atol=0)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codes_are_sign_magnitude(bits):
    """Code m (m < h = 2**(bits-1)) is the positive centroid of magnitude rank m, code h + m its negative."""
    h = 1 << (bits - 1)
    codec = kvlab.MSECodec(64, bits)
    book = codec.codebook
    assert torch.equal(book, codec.centroids[code_order(bits)])
    assert bool((book[:h] > 0).all()) and bool((book[:h].diff() > 0).all()) and torch.equal(book[h:], -book[:h])
    assert sorted(code_order(bits).tolist()) == list(range(2 * h))
    assert code_order(2).tolist() == [2, 3, 1, 0]


@pytest.mark.parametrize("bits", [1, 5, 8, True, 4.0, "4"])
def test_code_order_rejects_bits(bits):
    with pytest.raises(ValueError, match="bits must be 2, 3 or 4"):
        code_order(bits)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_mse_quantizer_is_odd_and_nearest(bits):
    """Each coordinate gets its nearest centroid, and -x the mirrored centroids of x: the same codes with
    the sign bit flipped (no zero coordinates; exact ties: tests/ops/test_mse.py::test_store_ties_round_half_to_even)."""
    torch.manual_seed(bits)
    dim = 64
    codec = kvlab.MSECodec(dim, bits, rotation="haar")
    codec.rotation = torch.eye(dim)  # quantize x itself
    x = torch.randn(500, dim)
    idx = kvlab.packing.unpack_indices(codec.encode(x)[..., : codec.index_bytes], bits, dim)
    u = x / x.double().norm(dim=-1, keepdim=True).float()
    dist = (u.unsqueeze(-1) - codec.codebook).abs()
    assert torch.equal(dist.gather(-1, idx.unsqueeze(-1)).squeeze(-1), dist.min(-1).values)
    assert torch.equal((codec.codebook[idx] > 0), u > 0)  # the top bit is the sign
    mirrored = kvlab.packing.unpack_indices(codec.encode(-x)[..., : codec.index_bytes], bits, dim)
    assert torch.equal(mirrored, idx ^ (1 << (bits - 1)))


def test_mse_norm_correction_keeps_norms_and_zero_vector():
    """Plain decoding shrinks norms by sqrt(1 - D_mse); norm correction restores them (at some MSE)."""
    torch.manual_seed(1)
    x = torch.randn(2000, 128)
    plain = kvlab.MSECodec(128, 2, norm_correction=False)
    corrected = kvlab.MSECodec(128, 2, norm_correction=True)
    assert torch.equal(plain.encode(x)[:, :32], corrected.encode(x)[:, :32])  # same indices, another scale
    ratio_plain = (plain.decode(plain.encode(x)).norm(dim=-1) / x.norm(dim=-1)).mean().item()
    ratio_corr = (corrected.decode(corrected.encode(x)).norm(dim=-1) / x.norm(dim=-1)).mean().item()
    assert ratio_plain == pytest.approx((1 - 128 * plain.quantizer.mse) ** 0.5, rel=5e-3)
    assert ratio_corr == pytest.approx(1.0, abs=1e-3)
    z = torch.zeros(1, 128)
    assert torch.equal(corrected.decode(corrected.encode(z)), z)


def test_mse_same_codes_for_every_input_dtype():
    x = torch.randn(64, 128).half()
    codec = kvlab.MSECodec(128, 3)
    assert torch.equal(codec.encode(x), codec.encode(x.float()))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis, group_size", [("token", 32), ("token", 128), ("channel", 32), ("channel", 64)])
def test_affine_error_bounded_by_half_step(bits, axis, group_size):
    torch.manual_seed(bits)
    x = torch.randn(2, 128, 128) * torch.rand(1, 1, 128) * 4  # channels of different ranges
    codec = kvlab.AffineCodec(bits, group_size, axis)
    codes = codec.encode(x)
    lead = (2, 128) if axis == "token" else (2, 128 // group_size)
    assert codes.shape == (*lead, codec.nbytes(128))
    x_hat = codec.decode(codes, 128)
    assert x_hat.shape == x.shape
    g = codec._grouped(x)
    step = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / (2**bits - 1)
    err = codec._grouped(x_hat - x).abs()
    # half a quantization step, plus fp16 rounding of scale and zero
    assert bool((err <= 0.5 * step * (1 + 2**bits * 2e-3) + 2e-3 * g.abs().amax(-1, keepdim=True)).all())


def test_affine_scales_are_per_group():
    """One group with a huge range must not coarsen the others (one scale per group)."""
    x = torch.randn(4, 128)
    y = x.clone()
    y[0, :32] *= 1000
    codec = kvlab.AffineCodec(4, 32, "token")
    dx, dy = codec.decode(codec.encode(x), 128), codec.decode(codec.encode(y), 128)
    assert torch.equal(dx[:, 32:], dy[:, 32:]) and torch.equal(dx[1:], dy[1:])


def test_affine_bits_per_element():
    assert kvlab.AffineCodec(4, 128).bits_per_element == 4.25
    assert kvlab.AffineCodec(2, 32, "channel").bits_per_element == 3.0
    codec = kvlab.AffineCodec(3, 64)
    assert codec.nbytes(128) * 8 / 128 == codec.bits_per_element


def test_affine_constant_group_is_exact():
    x = torch.full((3, 64), 1.25)
    codec = kvlab.AffineCodec(2, 32)
    assert torch.equal(codec.decode(codec.encode(x), 64), x)


@pytest.mark.parametrize("key_bits, value_bits", [(4, 4), (4, 3), (3, 2), (2, 4)])
def test_paged_write_read(key_bits, value_bits):
    torch.manual_seed(0)
    dim, heads, num_blocks, block_size, tokens = 64, 3, 5, 16, 37
    layout = kvlab.MSESlot(dim, key_bits, value_bits)
    kc, vc = kvlab.MSECodec(dim, key_bits), kvlab.MSECodec(dim, value_bits, seed=1)
    assert layout.slot_bytes == kc.nbytes + vc.nbytes
    k, v = torch.randn(tokens, heads, dim), torch.randn(tokens, heads, dim)
    cache = torch.full((num_blocks, block_size, heads, layout.slot_bytes), 0xAB, dtype=torch.uint8)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[[3, 20]] = -1
    kvlab.mse.reference.store_slots(cache, slots, kc.encode(k), vc.encode(v), layout)
    # the slot layout: key indices | key norm | value indices | value norm
    blk, off = divmod(int(slots[0]), block_size)
    slot = cache[blk, off, 1]
    assert torch.equal(slot[: layout.key_bytes], kc.encode(k[0, 1])[: layout.key_bytes])
    assert torch.equal(slot[layout.value_offset : layout.value_norm_offset], vc.encode(v[0, 1])[: layout.value_bytes])
    k_read, v_read = kvlab.mse.reference.load_slots(cache, slots, layout)
    keep = slots >= 0
    assert torch.equal(k_read[keep], kc.encode(k)[keep]) and torch.equal(v_read[keep], vc.encode(v)[keep])
    assert int((k_read[~keep]).sum()) == 0
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert bool((cache.view(-1, heads, layout.slot_bytes)[untouched] == 0xAB).all())
