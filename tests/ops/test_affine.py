"""Affine kernels (kvlab.affine: api launchers, triton kernels) against the pure-torch AffineCodec: same bytes, same values."""

import ast
import functools
import pathlib

import pytest
import torch

import kvlab
import kvlab.affine.api as affine
import kvlab.affine.triton
import kvlab.affine.triton_bits
from kvlab import CodecLaunch
from kvlab.affine import MixedAffineLayout
from kvlab.affine.reference import AffineCodec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on_device(fn):
    """Run a launcher on DEVICE (compiled on a GPU, interpreted on a CPU); results come back to the CPU."""

    def move(a):
        return a.to(DEVICE) if isinstance(a, torch.Tensor) else a

    @functools.wraps(fn)
    def call(*args, **kwargs):
        out = fn(*map(move, args), **{k: move(v) for k, v in kwargs.items()})
        return out.cpu() if isinstance(out, torch.Tensor) else out

    return call


encode_affine = _on_device(affine.encode_affine)
decode_affine = _on_device(affine.decode_affine)
encode_affine_mixed = _on_device(affine.encode_affine_mixed)
decode_affine_mixed = _on_device(affine.decode_affine_mixed)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# (group_size, x shape): odd leading sizes, dims 64/128/256; channel axis: tokens a multiple of
# group_size, an odd number of heads/batches in front
TOKEN_SHAPES = [
    (32, (1, 64)),
    (32, (301, 128)),
    (64, (37, 256)),
    (64, (3, 37, 64)),
    (128, (301, 128)),
    (128, (5, 7, 256)),
]
CHANNEL_SHAPES = [
    (32, (1, 32, 64)),
    (32, (3, 96, 128)),
    (64, (5, 64, 256)),
    (64, (3, 1, 128, 64)),
    (128, (1, 128, 128)),
    (128, (3, 256, 64)),
]
CASES = [("token", gs, shape) for gs, shape in TOKEN_SHAPES] + [("channel", gs, shape) for gs, shape in CHANNEL_SHAPES]
CASE_IDS = [f"{a}-g{g}-{'x'.join(map(str, s))}" for a, g, s in CASES]
# group_size, number of groups or dim that the kernels pad to a power of two and mask
PADDED = [("token", 24, (45, 72)), ("token", 48, (9, 96)), ("token", 96, (7, 192)), ("channel", 48, (3, 96, 200)), ("channel", 32, (2, 64, 40))]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_codes_equal(codes, ref):
    assert codes.shape == ref.shape and codes.dtype == ref.dtype, (codes.shape, ref.shape)
    if not torch.equal(codes, ref):
        bad = (codes != ref).nonzero()
        raise AssertionError(f"{len(bad)} of {ref.numel()} bytes differ, first at {bad[0].tolist()}: "
                             f"{codes[tuple(bad[0])].item()} != {ref[tuple(bad[0])].item()}")


def assert_decoded(out, ref, dtype):
    """fp32: q * scale + zero up to a fused multiply-add (exact under the interpreter); else relative error."""
    assert out.dtype == dtype and out.shape == ref.shape
    assert not torch.isnan(out).any(), "NaN in the output: part of it was left unwritten"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    else:
        err = rel_err(out, ref)
        assert err <= 1e-3, f"relative error {err:.2e} > 1e-3 for out_dtype {dtype}"


def make_x(shape, axis, group_size, seed):
    """Gaussian data with channels of different ranges, outlier channels and constant groups."""
    g = torch.Generator().manual_seed(seed)
    dim = shape[-1]
    x = torch.randn(shape, generator=g) * (0.1 + 4 * torch.rand(dim, generator=g))
    x[..., torch.randperm(dim, generator=g)[: max(1, dim // 32)]] *= 50  # outlier channels
    if axis == "token":
        x[..., ::5, :group_size] = 0.75  # constant groups: scale 0
        x[..., 1::7, -group_size:] = 0.0
    else:
        x[..., :group_size, 3] = -1.5  # a constant channel in the first token group
        x[..., 7] = 0.0
    return x


# ----------------------------------------------------------------------------- bit-exact codes


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis, group_size, shape", CASES, ids=CASE_IDS)
def test_pack_matches_reference(bits, axis, group_size, shape):
    x = make_x(shape, axis, group_size, seed=bits * 1000 + group_size)
    codec = AffineCodec(bits, group_size, axis)
    for dtype in DTYPES:
        xd = x.to(dtype)
        assert_codes_equal(encode_affine(xd, bits, group_size, axis), codec.encode(xd))
    # decode the fp32 codes to every output dtype
    codes = codec.encode(x)
    ref = codec.decode(codes, shape[-1])
    for dtype in (torch.float32, torch.float16):
        assert_decoded(decode_affine(codes, bits, group_size, axis, shape[-1], dtype), ref, dtype)


@pytest.mark.parametrize("axis, group_size, shape", PADDED)
@pytest.mark.parametrize("bits", [3, 4])
def test_sizes_that_are_not_powers_of_two(bits, axis, group_size, shape):
    """group_size, number of groups or dim padded to a power of two inside the kernel, masked."""
    x = make_x(shape, axis, group_size, seed=7).half()
    codec = AffineCodec(bits, group_size, axis)
    codes = encode_affine(x, bits, group_size, axis)
    assert_codes_equal(codes, codec.encode(x))
    out = decode_affine(codes, bits, group_size, axis, shape[-1], torch.float32)
    assert_decoded(out, codec.decode(codes, shape[-1]), torch.float32)


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_tunables_do_not_change_codes(axis):
    x = make_x((3, 32, 128), axis, 32, seed=3).half()
    ref = AffineCodec(4, 32, axis).encode(x)
    largest = 256 if axis == "token" else 16  # a channel-axis "row" is a code of 32 x 128 elements
    for block_rows, num_warps in [(1, 1), (2, 2), (8, 8), (largest, 4)]:
        codes = encode_affine(x, 4, 32, axis, launch=CodecLaunch(block_rows=block_rows, num_warps=num_warps))
        assert_codes_equal(codes, ref)
        out = decode_affine(codes, 4, 32, axis, 128, launch=CodecLaunch(block_rows=block_rows, num_warps=num_warps))
        assert torch.equal(out, decode_affine(ref, 4, 32, axis, 128))


def test_non_contiguous_input_and_one_code():
    x = make_x((128, 3, 64), "token", 32, seed=5).transpose(0, 1)  # [3, 128, 64], not contiguous
    for axis in ("token", "channel"):
        assert_codes_equal(encode_affine(x, 2, 32, axis), AffineCodec(2, 32, axis).encode(x))
    codes = encode_affine(x[0, :32], 8, 32, "channel")[0]  # one code, 1-d, decodes to [group_size, dim]
    ref = AffineCodec(8, 32, "channel").decode(codes, 64)
    assert ref.shape == (32, 64)
    assert_decoded(decode_affine(codes, 8, 32, "channel", 64, torch.float32), ref, torch.float32)


def test_constant_groups_and_per_group_scales():
    """Constant groups decode exactly (scale 0); an outlier group leaves the other groups' codes alone."""
    x = torch.full((3, 64), 1.25, dtype=torch.float16)
    assert torch.equal(decode_affine(encode_affine(x, 2, 32), 2, 32, "token", 64), x)
    y = torch.randn(4, 128)
    z = y.clone()
    z[0, :32] *= 1000
    cy, cz = encode_affine(y, 4, 32), encode_affine(z, 4, 32)
    assert torch.equal(cy[1:], cz[1:]) and torch.equal(cy[0, 16:64], cz[0, 16:64])  # indices of groups 1-3
    assert torch.equal(cy[0, 66:72], cz[0, 66:72]) and torch.equal(cy[0, 74:], cz[0, 74:])  # their scales, zeros


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_rounding_boundaries_and_tiny_ranges(bits):
    """Values on and one ulp around the k + 1/2 decision points (where an approximate division could
    pick the other code), for steps from fp16-subnormal (1e-6) to large. Group: [0, top, 30 points]."""
    levels = 2**bits - 1
    groups = []
    for s in (1e-6, 3e-5, 0.1, 0.37, 3.0, 200.0):
        step = torch.tensor(s).half().float()  # levels * step is exact in fp32, so scale == step
        mids = (torch.arange(levels, dtype=torch.float32) + 0.5) * step
        pts = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
        pts = torch.nn.functional.pad(pts, (0, -pts.numel() % 30)).reshape(-1, 30)
        ends = torch.tensor([0.0, levels * step.item()]).expand(len(pts), 2)
        groups.append(torch.cat([ends, pts.clamp(0, levels * step.item())], 1))
    x = torch.cat(groups)  # [n, 32]
    codec = AffineCodec(bits, 32)
    assert_codes_equal(encode_affine(x, bits, 32), codec.encode(x))


def _rn32(fraction):
    """The fp32 nearest to a Fraction (ties to even), as a Python float."""
    import fractions

    import numpy as np

    c = np.float32(float(fraction))
    near = [np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))]
    return float(min(near, key=lambda v: (abs(fractions.Fraction(float(v)) - fraction), int(v.view(np.uint32)) & 1)))


@pytest.mark.parametrize("levels", [3, 7, 15, 255])
def test_division_by_levels_is_correctly_rounded(levels):
    """The kernels' range / levels, RN(r ZH + RN(r ZL)) with the sum in fp64 (as ``divide_by_levels``
    computes it), equals the IEEE fp32 quotient for every significand (r in [1, 2)), and at other
    exponents, down to where only the quotient's fp16 (0) has to agree."""
    import fractions

    import numpy as np

    zh, zl = kvlab.affine.triton_bits.RECIPROCAL_SPLIT[levels]
    assert zh == _rn32(fractions.Fraction(1, levels)) and zl == _rn32(fractions.Fraction(1, levels) - fractions.Fraction(zh))

    def kernel(r):
        return (r.astype(np.float64) * zh + (r * np.float32(zl)).astype(np.float64)).astype(np.float32)

    r = (np.arange(2**23, 2**24, dtype=np.float64) / 2**23).astype(np.float32)  # every significand
    assert np.array_equal(kernel(r).view(np.uint32), (r / np.float32(levels)).view(np.uint32))
    rng = np.random.default_rng(levels)
    sample = r[rng.integers(0, r.size, 1 << 16)]
    for e in (-90, -40, -1, 20, 100, 127):
        x = np.ldexp(sample, e).astype(np.float32)
        assert np.array_equal(kernel(x).view(np.uint32), (x / np.float32(levels)).view(np.uint32)), e
    tiny = np.ldexp(sample, -120).astype(np.float32)  # below 2**-93 the product r ZL underflows
    assert np.array_equal(kernel(tiny).astype(np.float16), (tiny / np.float32(levels)).astype(np.float16))
    assert not np.any(kernel(tiny).astype(np.float16))


def test_inverse_of_every_fp16_scale():
    """The kernels' 1 / scale, one fp64 Newton step from any fp32 reciprocal within 2 ulp (what the GPU's
    fast division gives), is the IEEE fp32 quotient for every positive finite fp16 scale."""
    import numpy as np

    s = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)  # 2**-24 .. 65504
    exact = np.float32(1) / s
    for k in (-2, -1, 0, 1, 2):
        r0 = exact.copy()
        for _ in range(abs(k)):
            r0 = np.nextafter(r0, np.float32(np.inf if k > 0 else -np.inf))
        r0 = r0.astype(np.float64)
        r = (r0 * (2.0 - s.astype(np.float64) * r0)).astype(np.float32)
        assert np.array_equal(r.view(np.uint32), exact.view(np.uint32)), k


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_scales_on_fp16_ties(bits):
    """Group ranges whose quotient by the top level is exactly halfway between two fp16 scales (ties go
    to the even one), and one fp32 ulp either side of it; every fp16 exponent of the scale."""
    levels = 2**bits - 1
    g = torch.Generator().manual_seed(bits)
    m = torch.randint(1024, 2048, (24 * 8,), generator=g).double()
    e = torch.arange(-14, 10).double().repeat_interleave(8)
    tie = (m + 0.5) * 2.0 ** (e - 10)  # 12 significant bits: levels * tie is exact in fp32
    r = (levels * tie).float()
    r = torch.cat([r, torch.nextafter(r, r + 1), torch.nextafter(r, r - 1)])
    x = torch.rand(r.numel(), 32, generator=g) * r[:, None]
    x[:, 0], x[:, 1] = 0.0, r
    codec = AffineCodec(bits, 32)
    assert_codes_equal(encode_affine(x, bits, 32), codec.encode(x))
    xc = x.reshape(-1, 32, 1).expand(-1, 32, 32).contiguous()  # the same ranges along the token axis
    assert_codes_equal(encode_affine(xc, bits, 32, "channel"), AffineCodec(bits, 32, "channel").encode(xc))


def test_empty_input():
    x = torch.randn(0, 128, dtype=torch.float16)
    codes = encode_affine(x, 4, 32)
    assert codes.shape == (0, 80)
    assert decode_affine(codes, 4, 32, "token", 128).shape == (0, 128)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN
def test_unchecked_encode_does_not_raise():
    x = torch.full((2, 64), float("nan"))
    assert encode_affine(x, 4, 32, check=False).shape == (2, 40)  # no host sync, codes undefined


def test_kernel_module_does_not_import_the_reference():
    tree = ast.parse(pathlib.Path(affine.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [f"{n.module}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not any("reference" in n for n in names), names


# ----------------------------------------------------------------------------- mixed bits per head


def mixed_reference(x, layout):
    """Per-head AffineCodec codes concatenated in head order, per token."""
    heads = [AffineCodec(b, layout.group_size).encode(x[..., h, :]) for h, b in enumerate(layout.bit_alloc)]
    return torch.cat(heads, -1)


def mixed_decoded(codes, layout):
    heads = [
        AffineCodec(b, layout.group_size).decode(codes[..., o : o + n], layout.dim)
        for b, o, n in zip(layout.bit_alloc, layout.head_offsets, layout.head_bytes)
    ]
    return torch.stack(heads, -2)


class CountingKernel:
    """Stands in for a kernel and counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def test_mixed_bytes_shrink():
    layout = MixedAffineLayout([4, 8, 4, 8], 128, 32)
    per_head = [AffineCodec(b, 32).nbytes(128) for b in layout.bit_alloc]
    assert layout.head_bytes == (80, 144, 80, 144) and layout.head_offsets == (0, 80, 224, 304)
    assert layout.bytes_per_token == sum(per_head) == 448  # no head padded to the widest
    assert layout.fp16_bytes_per_token == 1024 and layout.padded_bytes_per_token == 576
    assert layout.bytes_per_token / layout.fp16_bytes_per_token == 0.4375  # 2.29x smaller than fp16
    assert layout.bytes_per_token / layout.padded_bytes_per_token == pytest.approx(0.7778, abs=1e-4)
    x = torch.randn(37, 4, 128, dtype=torch.float16)
    codes = encode_affine_mixed(x, layout)
    assert codes.shape == (37, 448) and codes.numel() == 37 * sum(per_head)


@pytest.mark.parametrize(
    "bit_alloc, dim, group_size, lead, dtype",
    [
        ([4, 8, 4, 8], 128, 32, (301,), torch.float16),
        ([2, 3, 4, 8, 4], 64, 32, (3, 37), torch.bfloat16),
        ([8, 2, 2], 256, 128, (1,), torch.float32),
        ([3], 128, 64, (45,), torch.float16),
        ([3, 4, 8, 2], 8, 8, (29,), torch.float16),  # odd head offsets (7, 15, 27)
    ],
)
def test_mixed_matches_per_head_reference(bit_alloc, dim, group_size, lead, dtype, monkeypatch):
    layout = MixedAffineLayout(bit_alloc, dim, group_size)
    x = make_x((*lead, len(bit_alloc), dim), "token", group_size, seed=len(bit_alloc)).to(dtype)
    pack = CountingKernel(affine.affine_pack_mixed_kernel)
    unpack = CountingKernel(affine.affine_unpack_mixed_kernel)
    monkeypatch.setattr(affine, "affine_pack_mixed_kernel", pack)
    monkeypatch.setattr(affine, "affine_unpack_mixed_kernel", unpack)
    codes = encode_affine_mixed(x, layout, launch=CodecLaunch(block_rows=64))
    ref = mixed_reference(x, layout)
    assert_codes_equal(codes, ref)
    ref_x = mixed_decoded(ref, layout)
    assert_decoded(decode_affine_mixed(codes, layout, torch.float32, launch=CodecLaunch(block_rows=64)), ref_x, torch.float32)
    assert_decoded(decode_affine_mixed(codes, layout), ref_x, torch.float16)
    assert pack.launches == 1 and unpack.launches == 2  # one launch per layer, all heads


def test_mixed_strided_heads_and_default_blocks():
    """Heads taken with a stride from a larger tensor (no copy); default block_rows."""
    layout = MixedAffineLayout([2, 4, 8], 64, 32)
    full = make_x((37, 6, 64), "token", 32, seed=11).half()
    x = full[:, ::2]
    assert not x.is_contiguous()
    codes = encode_affine_mixed(x, layout)
    assert_codes_equal(codes, mixed_reference(x, layout))
    assert_decoded(decode_affine_mixed(codes, layout, torch.float32), mixed_decoded(codes, layout), torch.float32)


# ----------------------------------------------------------------------------- bad input


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


LAYOUT = MixedAffineLayout([4, 8], 64, 32)

BAD = [
    ("bits unsupported", lambda: encode_affine(_x(2, 64), 5, 32), ValueError, "bits must be one of"),
    ("bits not int", lambda: encode_affine(_x(2, 64), 4.0, 32), TypeError, "bits must be an int"),
    ("group_size not multiple of 8", lambda: encode_affine(_x(2, 64), 4, 12), ValueError, "group_size must be a multiple of 8"),
    ("group_size too small", lambda: encode_affine(_x(2, 64), 4, 4), ValueError, "group_size must be >= 8"),
    ("axis unknown", lambda: encode_affine(_x(2, 64), 4, 32, "head"), ValueError, "axis must be one of"),
    ("dim vs group_size", lambda: encode_affine(_x(2, 48), 4, 32), ValueError, r"last dimension \(48\) must be a multiple of group_size"),
    ("channel tokens vs group_size", lambda: encode_affine(_x(40, 64), 4, 32, "channel"), ValueError, "token dimension"),
    ("channel dim not multiple of 8", lambda: encode_affine(_x(32, 60), 4, 32, "channel"), ValueError, "multiple of 8"),
    ("channel x 1-d", lambda: encode_affine(_x(64), 4, 32, "channel"), ValueError, "x must have at least 2 dimensions"),
    ("x integer", lambda: encode_affine(torch.ones(2, 64, dtype=torch.int32), 4, 32), TypeError, "x must have dtype"),
    ("x not a tensor", lambda: encode_affine([0.0] * 64, 4, 32), TypeError, "x must be a torch.Tensor"),
    ("x NaN", lambda: encode_affine(torch.full((3, 64), float("nan")), 4, 32), ValueError, "x holds NaN or Inf"),
    ("x Inf channel axis", lambda: encode_affine(torch.full((32, 64), float("-inf")), 4, 32, "channel"), ValueError, "x holds NaN or Inf"),
    ("zero overflows fp16", lambda: encode_affine(torch.tensor([[-7e4] + [7e4] * 31]), 4, 32), ValueError, "overflows fp16"),
    ("range overflows fp16", lambda: encode_affine(torch.tensor([[-3e38] + [3e38] * 31]), 2, 32), ValueError, "overflows fp16"),
    ("codes wrong dtype", lambda: decode_affine(torch.zeros(2, 40), 4, 32, "token", 64), TypeError, "codes must have dtype"),
    ("codes wrong width", lambda: decode_affine(torch.zeros(2, 39, dtype=torch.uint8), 4, 32, "token", 64), ValueError, "codes must have last dimension 40"),
    ("unpack dim vs group_size", lambda: decode_affine(torch.zeros(2, 40, dtype=torch.uint8), 4, 32, "token", 48), ValueError, r"dim \(48\)"),
    ("out_dtype", lambda: decode_affine(torch.zeros(2, 40, dtype=torch.uint8), 4, 32, "token", 64, torch.int8), TypeError, "out_dtype"),
    ("block_rows not a power of two", lambda: encode_affine(_x(2, 64), 4, 32, launch=CodecLaunch(block_rows=3)), ValueError, "block_rows must be a power of two"),
    ("num_warps", lambda: encode_affine(_x(2, 64), 4, 32, launch=CodecLaunch(num_warps=3)), ValueError, "num_warps"),
    ("launch not a CodecLaunch", lambda: encode_affine(_x(2, 64), 4, 32, launch=4), TypeError, "launch must be a kvlab.CodecLaunch"),
    ("launch.piece", lambda: decode_affine(torch.zeros(2, 40, dtype=torch.uint8), 4, 32, "token", 64, launch=CodecLaunch(piece=32)),
     ValueError, "launch.piece does not apply to decode_affine"),
    ("tile too large", lambda: encode_affine(_x(64, 128), 4, 32, "channel", launch=CodecLaunch(block_rows=32)), ValueError, "block_rows=32 gives 131072 elements"),
    ("unpack tile too large", lambda: decode_affine(torch.zeros(2, 80, dtype=torch.uint8), 4, 32, "token", 128, launch=CodecLaunch(block_rows=1024)),
     ValueError, "more than 65536"),
    ("bit_alloc entry", lambda: MixedAffineLayout([4, 5], 64, 32), ValueError, r"bit_alloc entries must be in .* bit_alloc\[1\] = 5"),
    ("bit_alloc entry type", lambda: MixedAffineLayout([4, "8"], 64, 32), TypeError, r"bit_alloc\[1\] must be an int"),
    ("bit_alloc empty", lambda: MixedAffineLayout([], 64, 32), ValueError, "bit_alloc must have one entry per head"),
    ("bit_alloc not a list", lambda: MixedAffineLayout(4, 64, 32), TypeError, "bit_alloc must be a list"),
    ("layout dim vs group_size", lambda: MixedAffineLayout([4], 48, 32), ValueError, r"dim \(48\) must be a multiple of group_size"),
    ("bit_alloc vs heads", lambda: encode_affine_mixed(_x(5, 3, 64), LAYOUT), ValueError, "bit_alloc has 2 entries but x has 3 heads"),
    ("mixed x dim", lambda: encode_affine_mixed(_x(5, 2, 128), LAYOUT), ValueError, "x must have last dimension 64"),
    ("mixed x NaN", lambda: encode_affine_mixed(torch.full((5, 2, 64), float("nan")), LAYOUT), ValueError, "NaN"),
    ("mixed codes width", lambda: decode_affine_mixed(torch.zeros(5, LAYOUT.bytes_per_token + 1, dtype=torch.uint8), LAYOUT), ValueError, f"codes must have last dimension {LAYOUT.bytes_per_token}"),
    ("layout type", lambda: encode_affine_mixed(_x(5, 2, 64), [4, 8]), TypeError, "layout must be a MixedAffineLayout"),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN/Inf input
@pytest.mark.parametrize("name, call, error, match", BAD, ids=[c[0] for c in BAD])
def test_bad_input(name, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_exports():
    for name in ("encode_affine", "decode_affine"):
        assert getattr(kvlab, name) is getattr(affine, name)
    for name in ("MixedAffineLayout", "encode_affine", "encode_affine_mixed", "decode_affine", "decode_affine_mixed", "store_affine"):
        assert getattr(kvlab.affine, name) is getattr(affine if name != "store_affine" else kvlab.affine.paged, name)


def test_signed_zeros_give_the_reference_bytes(device):
    """A group of +0.0 and -0.0 stores the zero point +0.0 in the kernel and the reference alike."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 0  # signed zeros
    x[0] = -0.0
    for axis in ("token", "channel"):
        assert torch.equal(kvlab.encode_affine(x.to(device), 4, 32, axis).cpu(), kvlab.AffineCodec(4, 32, axis).encode(x))
