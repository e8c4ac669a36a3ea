"""MSE kernels (kvlab.mse: triton_store, triton_load, gluon_store, gluon_load) against the pure-torch reference (kvlab.mse.reference).

``store_mse`` must produce the reference's cache bytes exactly (the whole cache is compared, so
untouched and skipped slots are checked too), for Haar codecs (torch GEMM, then the kernel) and for
Hadamard codecs (rotation fused into the kernel: the same butterflies as ``kvlab.rotation.fwht``);
``load_mse`` must match ``MSECodec.decode`` to fp16 precision (exactly where no summation is
involved).

Under ``TRITON_INTERPRET`` a program costs about the same whatever its size, so there the tests use
large tiles (``STORE_ROWS``, ``LOAD_ROWS``); on a GPU they use the default store tile (one row per
thread: larger tiles put several rows in a thread's registers and compile slowly). The tunables test
covers other tiles.
"""

import functools

import pytest
import torch

import kvlab
from kvlab import CodecLaunch
from kvlab._kernels.tables import capability, compiled, interpreted
from kvlab.layout import code_order
from kvlab.mse import load_mse, store_mse
from kvlab.rotation import fwht, hadamard, hadamard_signs

SENTINEL = 0xAB
STORE_ROWS = 512 if interpreted() else None  # block_rows of the store tests
LOAD_ROWS = 256 if interpreted() else 64  # and of the load tests

# tokens, heads, dim, key_bits, value_bits, rotation, input dtype, block_size
CASES = [
    (1, 1, 64, 4, 4, "hadamard", torch.float16, 16),
    (37, 3, 128, 4, 3, "haar", torch.bfloat16, 16),
    (301, 8, 128, 3, 2, "hadamard", torch.float16, 16),
    (37, 8, 256, 2, 4, "hadamard", torch.float32, 8),
    (64, 3, 96, 3, 3, "haar", torch.float32, 16),
    (37, 1, 80, 2, 2, "haar", torch.float16, 5),
    (13, 2, 100, 4, 2, "haar", torch.bfloat16, 7),
    (301, 3, 64, 2, 3, "haar", torch.bfloat16, 32),
    (37, 3, 75, 3, 4, "haar", torch.float32, 16),  # odd dim: the last byte is partly padding
    (21, 2, 200, 4, 3, "haar", torch.float16, 16),  # rows in two pieces, the second partly padding
]
IDS = [f"t{c[0]}-h{c[1]}-d{c[2]}-k{c[3]}v{c[4]}-{c[5]}-{str(c[6])[6:]}" for c in CASES]

# The fused Hadamard store: every (key bits, value bits) for dims 64, 128 and 256 (one input dtype
# per dim, so that a GPU run compiles few kernels), then the other dtypes at dim 128; odd token
# counts throughout.
HADAMARD_CASES = [
    (tokens, heads, dim, kb, vb, "hadamard", dtype, 16)
    for dim, tokens, heads, dtype in [(64, 61, 2, torch.float32), (128, 37, 3, torch.float16), (256, 19, 2, torch.bfloat16)]
    for kb in (2, 3, 4)
    for vb in (2, 3, 4)
] + [(45, 2, 128, 4, 2, "hadamard", torch.bfloat16, 16), (23, 3, 128, 3, 4, "hadamard", torch.float32, 16)]
HADAMARD_IDS = [f"t{c[0]}-h{c[1]}-d{c[2]}-k{c[3]}v{c[4]}-{str(c[6])[6:]}" for c in HADAMARD_CASES]


def rel_err(a, b):
    err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
    if err > 1e-3:
        print(f"rel_err {err:.3e}, max abs diff {(a.double() - b.double()).abs().max().item():.3e}")
    return err


@functools.lru_cache(maxsize=None)
def codecs(dim, key_bits, value_bits, rotation, norm_correction=True):
    return (
        kvlab.MSECodec(dim, key_bits, rotation=rotation, seed=1, norm_correction=norm_correction),
        kvlab.MSECodec(dim, value_bits, rotation=rotation, seed=2, norm_correction=norm_correction),
    )


def make_batch(case, device, seed=0, norm_correction=True):
    """Inputs, a sentinel-filled cache, slots (some -1) and the reference cache."""
    tokens, heads, dim, kb, vb, rotation, dtype, block_size = case
    g = torch.Generator().manual_seed(seed)
    kc, vc = codecs(dim, kb, vb, rotation, norm_correction)
    layout = kvlab.MSESlot(dim, kb, vb)
    scale = torch.rand(tokens, heads, 1, generator=g) * 20 + 0.01  # norms from ~0.1 to ~2000
    key = (torch.randn(tokens, heads, dim, generator=g) * scale).to(dtype)
    value = (torch.randn(tokens, heads, dim, generator=g) * scale.flip(0)).to(dtype)
    key[tokens // 2, 0] = 0  # a zero vector: norm 0
    num_blocks = (tokens + 2 * block_size) // block_size + 1
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    if tokens > 2:
        slots[[1, tokens - 2]] = -1
    cache = torch.full((num_blocks, block_size, heads, layout.slot_bytes), SENTINEL, dtype=torch.uint8)
    key, value, slots, cache = (t.to(device) for t in (key, value, slots, cache))
    ref = cache.clone()
    kvlab.mse.reference.store_slots(ref, slots, kc.encode(key), vc.encode(value), layout)
    return key, value, slots, cache, ref, kc, vc, layout


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_store_matches_reference_bytes(case, device):
    key, value, slots, cache, ref, kc, vc, _ = make_batch(case, device)
    store_mse(key, value, slots, cache, kc, vc, launch=CodecLaunch(block_rows=STORE_ROWS))
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("case", HADAMARD_CASES, ids=HADAMARD_IDS)
def test_fused_hadamard_store_matches_reference_bytes(case, device):
    key, value, slots, cache, ref, kc, vc, _ = make_batch(case, device)
    store_mse(key, value, slots, cache, kc, vc, launch=CodecLaunch(block_rows=STORE_ROWS))
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_fwht_is_the_sylvester_product_and_the_codec_rotation(dim):
    """fwht(x) == x @ H exactly (small integers); the codec's fused rotation is x @ R."""
    g = torch.Generator().manual_seed(dim)
    x = torch.randint(-64, 64, (5, dim), generator=g).float()
    h = hadamard(dim, seed=0) / hadamard_signs(dim, seed=0).unsqueeze(1) * dim**0.5  # Sylvester H
    assert torch.equal(fwht(x).double(), x.double() @ h)
    codec = kvlab.MSECodec(dim, 3, rotation="hadamard", seed=5)
    assert torch.equal(codec.hadamard_signs.double(), hadamard_signs(dim, seed=5))
    assert codec.hadamard_scale == float(torch.tensor(dim**-0.5).float())
    x = torch.randn(7, dim, generator=g)
    torch.testing.assert_close(codec.rotate(x).double(), x.double() @ codec.rotation.double(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool])
def test_fwht_refuses_what_is_not_real_numbers(dtype):
    with pytest.raises(TypeError, match=r"x must hold real numbers .* got torch\.(complex64|bool)"):
        fwht(torch.ones(2, 8, dtype=dtype))


def _identity_codec(dim, bits):
    """A reference codec whose rotation is the identity: the store then quantizes ``x`` itself."""
    codec = kvlab.MSECodec(dim, bits, rotation="haar")
    codec.rotation = torch.eye(dim)
    return codec


def _adversarial_rows(codec, dim, rows=24, seed=0):
    """Rows whose coordinates sit on and around the rounding edges of ``y / norm`` at each boundary.

    Each row has a large anchor coordinate that fixes its norm, then probes ``y`` close to
    ``boundary * norm`` (within a few float32 steps), zeros, signed zeros and subnormals (which give
    exact ties at the zero boundary: ``2**-149 / 2`` rounds to 0).
    """
    g = torch.Generator().manual_seed(seed)
    b = codec.boundaries.double()
    out = torch.zeros(rows, dim)
    for r in range(rows):
        anchor = float(2.0 ** torch.randint(-8, 9, (1,), generator=g).item() * (1 + torch.rand(1, generator=g).item()))
        y = torch.zeros(dim)
        y[0] = anchor
        probes = []
        for _ in range(3):  # the norm depends on the probes: settle it
            y64 = y.double()
            n = float(y64.square().sum().sqrt().float())
            probes = []
            for i, k in enumerate(torch.randint(-3, 4, (dim - 1,), generator=g).tolist()):
                t = torch.tensor(float(b[i % len(b)]) * n, dtype=torch.float32)
                for _ in range(abs(k)):
                    t = torch.nextafter(t, torch.tensor(float("inf") if k > 0 else float("-inf")))
                probes.append(float(t))
            y[1:] = torch.tensor(probes, dtype=torch.float32)
        if r % 4 == 1:  # zeros of both signs, subnormals next to a norm of 2 (ties at the zero boundary)
            y[:] = 0.0
            y[0] = 2.0
            y[1:6] = torch.tensor([2**-149, -(2**-149), 3 * 2**-149, -0.0, 2**-148])
        if r % 4 == 2:
            y[:] = 0.0  # a zero vector
        out[r] = y
    return out


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_store_exact_at_rounding_edges(bits, device):
    """Coordinates on the edges of fl(y / norm) > boundary: the division-free compare agrees."""
    dim, heads = 32, 2
    kc, vc = _identity_codec(dim, bits), _identity_codec(dim, 6 - bits if bits != 3 else 3)
    layout = kvlab.MSESlot(dim, kc.bits, vc.bits)
    key = _adversarial_rows(kc, dim, seed=bits).view(-1, heads, dim)
    value = _adversarial_rows(vc, dim, seed=10 + bits).view(-1, heads, dim)
    slots = torch.arange(key.shape[0])
    cache = torch.full((key.shape[0], 1, heads, layout.slot_bytes), SENTINEL, dtype=torch.uint8)
    key, value, slots, cache = (t.to(device) for t in (key, value, slots, cache))
    ref = cache.clone()
    kvlab.mse.reference.store_slots(ref, slots, kc.encode(key), vc.encode(value), layout)
    store_mse(key, value, slots, cache, kc, vc, launch=CodecLaunch(block_rows=STORE_ROWS))
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("space", ["rotated", "model"])
def test_load_matches_reference_decode(case, space, device):
    key, value, slots, _, ref, kc, vc, layout = make_batch(case, device)
    k_codes, v_codes = kvlab.mse.reference.load_slots(ref, slots, layout)
    keep = (slots >= 0).view(-1, 1, 1)
    for part, codec, codes in (("key", kc, k_codes), ("value", vc, v_codes)):
        out = load_mse(ref, slots, codec, part=part, space=space, launch=CodecLaunch(block_rows=LOAD_ROWS))
        assert out.dtype == torch.float16 and out.shape == key.shape
        expected = torch.where(keep, codec.decode(codes, space), 0.0)
        assert not out.isnan().any()
        assert rel_err(out, expected) <= 1e-3
        assert torch.equal(out[~keep.view(-1)], torch.zeros_like(out[~keep.view(-1)]))


def _fast_possible(cache, codec, part, layout) -> bool:
    """Whether the model-space load can take the prmt lookup (``fast=True``) for this cache and part."""
    return kvlab.mse.api._model_lookup_tables(cache, codec, 0 if part == "key" else layout.value_offset) is not None


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES[::2], ids=IDS[::2])
def test_model_space_load_is_within_output_rounding(case, out_dtype, fast, device):
    """16-bit model-space loads rotate back in the kernel (an fp16 product by R^T): their error against the
    reference stays within a small multiple of rounding the exact result to the output dtype, with the
    centroids gathered index by index or looked up by byte permutes (``fast``; where the cache or the
    codebook rules that out, ``fast=True`` is refused)."""
    key, value, slots, _, ref, kc, vc, layout = make_batch(case, device)
    keep = (slots >= 0).view(-1, 1, 1)
    for part, codec, codes in zip(("key", "value"), (kc, vc), kvlab.mse.reference.load_slots(ref, slots, layout)):
        if fast and not _fast_possible(ref, codec, part, layout):
            with pytest.raises(ValueError, match="fast=True needs"):
                load_mse(ref, slots, codec, part=part, space="model", out_dtype=out_dtype, launch=CodecLaunch(fast=True))
            continue
        exact = torch.where(keep, codec.decode(codes, "model"), 0.0)
        out = load_mse(ref, slots, codec, part=part, space="model", out_dtype=out_dtype, launch=CodecLaunch(block_rows=LOAD_ROWS, fast=fast))
        assert out.dtype == out_dtype
        rounding = rel_err(exact.to(out_dtype), exact)
        assert rel_err(out, exact) <= 3 * rounding + 1e-6, (rel_err(out, exact), rounding)
        assert torch.equal(out[~keep.view(-1)], torch.zeros_like(out[~keep.view(-1)]))


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_model_space_load_loops_over_tiles(bits, fast, device, monkeypatch):
    """The model-space load is persistent: each program loops over every num_programs-th tile (and, fast,
    prefetches the next one). More tiles than programs, the last one partly past the rows, a value code
    2 bytes past a word boundary: every row comes out as the reference decodes it. (Interpreted: the
    programs of one SM, so fewer tiles make the same loop.)"""
    if device == "cpu":
        monkeypatch.setattr(kvlab._kernels.tables, "sm_count", lambda device: 1)
    dim, heads, block_size, block_rows = 64, 3, 16, 16
    programs = kvlab.mse.api.MODEL_PROGRAMS_PER_SM * kvlab._kernels.tables.sm_count(torch.device(device))
    tokens = 2 * programs * block_rows // heads + 51  # three tiles or more a program, the last tile partial
    kc, vc = codecs(dim, bits, bits, "hadamard")
    layout = kvlab.MSESlot(dim, bits, bits)
    g = torch.Generator().manual_seed(bits)
    key, value = (torch.randn(tokens, heads, dim, generator=g).half() for _ in range(2))
    cache = torch.zeros(tokens // block_size + 2, block_size, heads, layout.slot_bytes, dtype=torch.uint8)
    slots = torch.randperm(cache.shape[0] * block_size, generator=g)[:tokens]
    slots[7] = -1
    key, value, slots, cache = (t.to(device) for t in (key, value, slots, cache))
    store_mse(key, value, slots, cache, kc, vc)
    assert kvlab.mse.api._word_phase(cache, layout.value_offset) == 2
    keep = (slots >= 0).view(-1, 1, 1)
    for part, codec, codes in zip(("key", "value"), (kc, vc), kvlab.mse.reference.load_slots(cache, slots, layout)):
        exact = torch.where(keep, codec.decode(codes, "model"), 0.0)
        out = load_mse(cache, slots, codec, part=part, space="model", launch=CodecLaunch(block_rows=block_rows, fast=fast))
        rounding = rel_err(exact.half(), exact)
        assert rel_err(out, exact) <= 3 * rounding + 1e-6
        assert torch.equal(out[7], torch.zeros_like(out[7]))


def written_cache(dim, bits, heads, tokens, seed, padding, device, block_size=16):
    """Hadamard codecs and a cache holding the reference's codes of random fp16 keys and values in shuffled
    slots (two spare blocks), token ``padding``'s slot -1: ``(kc, vc, layout, slots, cache)``."""
    kc, vc = codecs(dim, bits, bits, "hadamard")
    layout = kvlab.MSESlot(dim, bits, bits)
    g = torch.Generator().manual_seed(seed)
    key, value = (torch.randn(tokens, heads, dim, generator=g).half() for _ in range(2))
    cache = torch.zeros(tokens // block_size + 2, block_size, heads, layout.slot_bytes, dtype=torch.uint8)
    slots = torch.randperm(cache.shape[0] * block_size, generator=g)[:tokens]
    slots[padding] = -1
    key, value, slots, cache = (t.to(device) for t in (key, value, slots, cache))
    kvlab.mse.reference.store_slots(cache, slots, kc.encode(key), vc.encode(value), layout)
    return kc, vc, layout, slots, cache


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_model_space_bulk_store_equals_row_stores(bits, device, monkeypatch):
    """The model-space load writes its tiles by bulk stores through a tensor descriptor of the output
    (tiles of at most 256 rows, sm_90 or later): the same values as its 16-byte row stores, in every row, the last
    tile partial. Compiled, both run the same tiles (an sm_80 launch stores by rows), so the products agree bit for
    bit; interpreted, the row stores come from tiles too large for a descriptor (512 rows)."""
    if compiled(device) and capability(device)[0] < 9:
        pytest.skip("bulk tensor stores need sm_90 or later")
    dim, heads, block_rows = 128, 3, 16
    tokens = 5 * block_rows + 7  # 261 rows: 17 tiles, the last one 5 rows
    kc, vc, layout, slots, cache = written_cache(dim, bits, heads, tokens, 10 + bits, 3, device)
    row_tiles = block_rows if compiled(device) else 512
    for part, codec in (("key", kc), ("value", vc)):
        with monkeypatch.context() as m:
            if compiled(device):
                m.setattr(kvlab.mse.api.T, "capability", lambda d: (8, 0))  # an sm_80 launch: row stores
            rows = load_mse(cache, slots, codec, part=part, space="model", launch=CodecLaunch(block_rows=row_tiles))
        bulk = load_mse(cache, slots, codec, part=part, space="model", launch=CodecLaunch(block_rows=block_rows))
        assert not bulk.isnan().any()
        assert torch.equal(rows, bulk)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim,bits", [(64, 2), (64, 4), (128, 2), (128, 3), (128, 4)])
def test_model_space_mma_load(dim, bits, out_dtype, device, monkeypatch):
    """On Hopper the model-space load runs the Gluon kernel of ``kvlab.mse.gluon_load`` (centroid tiles made in the
    registers of the MMA's operand, stores from the accumulator): every row within a small multiple of the
    output's rounding of the reference, and close to the Triton kernel's, over more tiles than programs,
    the last tile partial, keys (4-byte aligned) and values (2 bytes past a word boundary), a padding slot."""
    if not compiled(device) or capability(device)[0] != 9:
        pytest.skip("the Gluon model-space load needs a Hopper GPU (warpgroup MMA)")
    from kvlab.mse import gluon_load

    heads = 3
    programs = gluon_load.PROGRAMS_PER_SM * kvlab._kernels.tables.sm_count(torch.device(device))
    tokens = 2 * programs * gluon_load.TILE_ROWS // heads + 29  # more than two tiles a program, the last tile partial
    kc, vc, layout, slots, cache = written_cache(dim, bits, heads, tokens, 20 + bits, 5, device)
    keep = (slots >= 0).view(-1, 1, 1)
    calls = []
    monkeypatch.setattr(gluon_load, "launch", lambda *a, _launch=gluon_load.launch: calls.append(1) or _launch(*a))
    for part, codec, codes in zip(("key", "value"), (kc, vc), kvlab.mse.reference.load_slots(cache, slots, layout)):
        exact = torch.where(keep, codec.decode(codes, "model"), 0.0)
        out = load_mse(cache, slots, codec, part=part, space="model", out_dtype=out_dtype)
        assert len(calls) == 1 + (part == "value"), "the Gluon kernel did not run"
        assert out.dtype == out_dtype and not out.isnan().any()
        rounding = rel_err(exact.to(out_dtype), exact)
        assert rel_err(out, exact) <= 3 * rounding + 1e-6, (rel_err(out, exact), rounding)
        assert torch.equal(out[5], torch.zeros_like(out[5]))
        triton_out = load_mse(cache, slots, codec, part=part, space="model", out_dtype=out_dtype, launch=CodecLaunch(num_warps=8))  # the Triton kernel
        assert rel_err(out, triton_out) <= 2 * rounding


@pytest.mark.parametrize("dim,bits", [(64, 2), (64, 4), (128, 2), (128, 3), (128, 4)])
def test_model_space_mma_operands(dim, bits):
    """The host side of the Gluon model-space load, on any machine: with the centroid tile's columns in
    ``query_order`` and B = ``operand_b``, accumulator column ``n`` is output column ``column_order[n]``,
    and the 16 column pairs a thread holds of a row (columns ``8 j + 2 t + e``) are four runs of 8
    consecutive output columns (one 16-byte store each)."""
    from kvlab.mse import gluon_load
    from kvlab.attention.gluon import query_order

    codec = codecs(dim, bits, bits, "haar")[0]
    order = gluon_load.column_order(dim)
    assert torch.equal(order.sort().values, torch.arange(dim))
    for t in range(4):
        held = torch.tensor([8 * j + 2 * t + e for j in range(dim // 8) for e in range(2)])
        runs = order[held].view(-1, 8)
        assert torch.equal(runs - runs[:, :1], torch.arange(8).expand_as(runs)) and bool((runs[:, 0] % 8 == 0).all())
    g = torch.Generator().manual_seed(bits)
    c = codec.centroids[torch.randint(0, 2**bits, (37, dim), generator=g)].half().float()
    b = gluon_load.operand_b(codec.rotation, bits).float()
    acc = torch.full((37, dim), float("nan"))
    acc.copy_(c[:, query_order(dim, bits)] @ b)
    out = torch.full_like(acc, float("nan"))
    out[:, order] = acc
    expected = c @ codec.rotation.T.half().float()
    assert rel_err(out, expected) < 1e-6
    assert gluon_load.supports(dim, bits) and not gluon_load.supports(64, 3) and not gluon_load.supports(256, 4)


@pytest.mark.parametrize("lanes,rows_per_thread,warps", [(4, 1, 4), (8, 2, 4), (4, 2, 8)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shift", [0, 2])
def test_gluon_store(lanes, rows_per_thread, warps, dtype, shift, device, monkeypatch):
    """On a GPU the Hadamard store at dim 128 runs the Gluon kernel of ``kvlab.mse.gluon_store``: the reference's bytes
    (and the Triton kernel's) for every key/value width, keys and values at both word phases (a cache 2 bytes past
    an aligned address swaps them), rows past the last tile, padding slots, each tiling of 4 or 8 threads a row."""
    if not compiled(device):
        pytest.skip("the Gluon store runs on CUDA GPUs (Triton's interpreter cannot run Gluon)")
    from kvlab.mse import gluon_store

    monkeypatch.setattr(gluon_store, "LANES", lanes)
    monkeypatch.setattr(gluon_store, "ROWS_PER_THREAD", rows_per_thread)
    monkeypatch.setattr(gluon_store, "WARPS", warps)
    calls = []
    monkeypatch.setattr(gluon_store, "spec", lambda *a, _spec=gluon_store.spec: calls.append(1) or _spec(*a))
    for kb, vb in [(2, 3), (3, 4), (4, 2), (4, 4)]:
        key, value, slots, _, ref, kc, vc, layout = make_batch((157, 3, 128, kb, vb, "hadamard", dtype, 16), device)
        flat = torch.full((ref.numel() + 16,), SENTINEL, dtype=torch.uint8, device=device)
        cache = flat[shift : shift + ref.numel()].view(ref.shape)
        store_mse(key, value, slots, cache, kc, vc)
        assert len(calls) == 2, "the Gluon store did not run for keys and values"
        calls.clear()
        assert torch.equal(cache, ref)
        assert bool((flat[:shift] == SENTINEL).all()) and bool((flat[shift + ref.numel() :] == SENTINEL).all())
        triton_cache = torch.full_like(cache, SENTINEL)
        store_mse(key, value, slots, triton_cache, kc, vc, launch=CodecLaunch(num_warps=8))  # not the default tiling: the Triton kernel
        assert not calls and torch.equal(triton_cache, cache)


def test_gluon_store_reach():
    """Which stores the Gluon kernel takes: dim 128, codes word-aligned or 2 bytes past a boundary."""
    from kvlab.mse import gluon_store

    assert gluon_store.supports(128, 0) and gluon_store.supports(128, 2)
    assert not gluon_store.supports(64, 0) and not gluon_store.supports(128, 1) and not gluon_store.supports(128, -1)


_COMPILE_STORE = """
import subprocess, sys, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kvlab.mse import gluon_store
from kvlab.mse.api import _square_tuple

signature = dict(x_ptr="*fp16", sign_ptr="*i16", mid_ptr="*fp64", tie_ptr="*i32", sq_ptr="*fp64", slot_ptr="*i32",
                 cache_ptr="*u8", norm_ptr="*fp32", scale="fp32", stride_x="i32", num_rows="i32", num_slots="i32",
                 stride_slot="i32", stride_block="i32", stride_pos="i32", stride_head="i32")
for arg in sys.argv[1:]:
    bits, head = map(int, arg.split(","))
    constants = dict(D=128, NUM_HEADS=8, BLOCK_SIZE=16, BITS=bits, TUPLE=_square_tuple(bits), OFFSET=head,
                     INDEX_BYTES=16 * bits, HEAD=head, NORM_CORRECTION=True, CHECK=True, ROWS=gluon_store.rows(),
                     **gluon_store.layout_constants(128, bits))
    source = GluonASTSource(gluon_store.store_kernel, dict(signature, **dict.fromkeys(constants, "constexpr")), constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=gluon_store.options(bits))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
    print(f"== {bits},{head}\\n{usage}")
"""


def test_gluon_store_compiles_for_hopper():
    """The Gluon store compiles for sm_90 on any machine (Triton's own ptxas, outside the interpreter), at its
    default tiling and register cap, for 2-, 3- and 4-bit codes at both word phases: at most 64 registers a
    thread (8 programs of 4 warps an SM), no stack but the 8 bytes the 4-bit kernel spills under its cap
    (``MAXNREG``: faster than 77 registers uncapped, results/codec_ab_store_gluon.json). One process compiles
    the six kernels (Triton's cache keeps them for the next run)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from kvlab.mse import gluon_store

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    cases = [(bits, head) for bits in (2, 3, 4) for head in (0, 2)]
    out = subprocess.run([sys.executable, "-c", _COMPILE_STORE, *(f"{b},{h}" for b, h in cases)], capture_output=True,
                         text=True, env=env, check=True).stdout
    usages = dict(part.split("\n", 1) for part in out.split("== ")[1:])
    assert sorted(usages) == sorted(f"{b},{h}" for b, h in cases), out
    for bits, head in cases:
        usage = usages[f"{bits},{head}"]
        assert "LOCAL:0" in usage and int(re.search(r"STACK:(\d+)", usage).group(1)) <= (8 if bits in gluon_store.MAXNREG else 0), (bits, head, usage)
        assert int(re.search(r"REG:(\d+)", usage).group(1)) <= 64, (bits, head, usage)


@pytest.mark.parametrize("case", CASES[1::3], ids=IDS[1::3])
def test_load_exact_without_norm_correction(case, device):
    """Without renormalisation decoding is centroid * fp16 norm: no sum, so the result is exact."""
    key, value, slots, _, ref, kc, vc, layout = make_batch(case, device, norm_correction=False)
    k_codes, v_codes = kvlab.mse.reference.load_slots(ref, slots, layout)
    keep = (slots >= 0).view(-1, 1, 1)
    for part, codec, codes in (("key", kc, k_codes), ("value", vc, v_codes)):
        expected = torch.where(keep, codec.decode(codes, "rotated"), 0.0)
        for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
            out = load_mse(ref, slots, codec, part=part, out_dtype=out_dtype, launch=CodecLaunch(block_rows=LOAD_ROWS))
            assert torch.equal(out, expected.to(out_dtype))


def test_roundtrip_store_then_load(device):
    """What the store writes, the load reads back: same result as decoding the reference codes."""
    case = CASES[1]
    key, value, slots, cache, ref, kc, vc, layout = make_batch(case, device, seed=3)
    store_mse(key, value, slots, cache, kc, vc)
    k_codes, v_codes = kvlab.mse.reference.load_slots(ref, slots, layout)
    keep = (slots >= 0).view(-1, 1, 1)
    out = load_mse(cache, slots, vc, part="value", space="model", out_dtype=torch.float32)
    assert rel_err(out, torch.where(keep, vc.decode(v_codes), 0.0)) <= 1e-5
    out = load_mse(cache, slots, vc, part="value", space="rotated")
    assert torch.equal(out, load_mse(cache, slots, vc, part="value"))
    # and the round trip is close to the input: 4-bit keys
    rel = rel_err(load_mse(cache, slots, kc, space="model", out_dtype=torch.float32)[keep.view(-1)], key[keep.view(-1)].float())
    assert rel < 0.15


def test_store_ties_round_half_to_even(device):
    """y / norm exactly halfway between a boundary and the next float32 (only reachable with tiny
    values): it rounds to the even neighbour, up past some boundaries and down onto others, on both
    sides of zero; and a coordinate exactly on a negative boundary goes to the centroid of smaller
    magnitude, as on the positive side (the odd quantizer of ``MSECodec.encode``)."""
    s = 2.0**-149
    dim, heads = 16, 1
    kc = _identity_codec(dim, 3)
    kc.boundaries = torch.tensor([-9 * s, -6 * s, -3 * s, 0.0, 3 * s, 6 * s, 9 * s])  # halfway: up, down, up; 0: down
    vc = _identity_codec(dim, 3)
    layout = kvlab.MSESlot(dim, 3, 3)
    centers = [-18, -12, -6, 0, 6, 12, 18]  # y = (center + k) s, so y / 2 is on or halfway past a boundary
    rows = torch.zeros(len(centers), dim)
    rows[:, 0] = 2.0  # norm 2: y / norm = y / 2 is exactly representable halfway between floats
    for r, center in enumerate(centers):
        rows[r, 1:8] = torch.tensor([(center + k) * s for k in (-3, -2, -1, 0, 1, 2, 3)])
    rows[3, 8:10] = torch.tensor([-0.0, 0.0])
    key = rows.view(-1, heads, dim)
    slots = torch.arange(key.shape[0])
    cache = torch.full((key.shape[0], 1, heads, layout.slot_bytes), SENTINEL, dtype=torch.uint8)
    key, slots, cache = (t.to(device) for t in (key, slots, cache))
    ref = cache.clone()
    codes = kc.encode(key)
    # the centroid (ascending index) of each stored sign-magnitude code
    idx = code_order(3)[kvlab.packing.unpack_indices(codes[..., : kc.index_bytes], 3, dim).view(len(centers), dim).cpu()]
    assert idx[2, 1:8].tolist() == [2, 2, 2, 3, 3, 3, 3]  # -4.5s -> -4s, -4s, -3.5s -> -4s: past -3s; -3s on it: 3
    assert idx[4, 1:8].tolist() == [4, 4, 4, 4, 5, 5, 5]  # 1.5s -> 2s, 2s, 2.5s -> 2s, 3s (not above 3s), 3.5s -> 4s, ...
    assert idx[3, 4].item() == 3 and idx[3, 5].item() == 3 and idx[3, 8:10].tolist() == [3, 3]  # 0.5s -> 0, zeros: u > 0 fails
    kvlab.mse.reference.store_slots(ref, slots, codes, vc.encode(key), layout)
    store_mse(key, key, slots, cache, kc, vc, launch=CodecLaunch(block_rows=STORE_ROWS))
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("piece", [16, 32, 64])
@pytest.mark.parametrize("case", [CASES[2], CASES[3], CASES[8], CASES[9]], ids=[IDS[2], IDS[3], IDS[8], IDS[9]])
def test_store_pieces_do_not_change_bytes(case, piece, device):
    """Rows cut into pieces of 16-64 columns on neighbouring lanes (the cross-lane butterfly stages and the
    norm's sum over pieces) store the reference's bytes."""
    key, value, slots, cache, ref, kc, vc, _ = make_batch(case, device)
    store_mse(key, value, slots, cache, kc, vc, launch=CodecLaunch(block_rows=STORE_ROWS, piece=piece))
    assert torch.equal(cache, ref)


def test_store_register_cap_where_measured():
    """Compiled, the 3- and 4-bit stores are capped at 168 registers a thread at their default launch
    (4 warps, a row of 65-128 columns in one thread); the 2-bit store, other warps, longer rows and
    pieces are not (results/codec_ab_store_maxnreg.json)."""
    from kvlab.mse.api import _store_compiled_options as options

    assert options(3, 4, 128) == options(4, 4, 128) == options(4, 4, 96) == {"maxnreg": 168}
    assert options(2, 4, 128) == options(4, 1, 128) == options(4, 8, 128) == {}
    assert options(4, 4, 256) == options(4, 4, 64) == options(3, 4, 128, piece=64) == {}


@pytest.mark.parametrize("block_rows, num_warps", [(4, 1), (16, 2), (128, 4), (256, 8)])
def test_tunables_do_not_change_results(block_rows, num_warps, device):
    key, value, slots, cache, ref, kc, vc, _ = make_batch(CASES[6], device)
    store_mse(key, value, slots, cache, kc, vc, launch=CodecLaunch(block_rows=block_rows, num_warps=num_warps))
    assert torch.equal(cache, ref)
    out = load_mse(cache, slots, vc, part="value", launch=CodecLaunch(block_rows=block_rows, num_warps=num_warps))
    assert torch.equal(out, load_mse(cache, slots, vc, part="value"))


@pytest.mark.parametrize("shift", [1, 2, 3])
def test_cache_at_odd_addresses(shift, device):
    """A cache that starts 1, 2 or 3 bytes past an aligned address: narrower loads and stores."""
    tokens, heads, dim, kb, vb, rotation, dtype, block_size = case = CASES[1]
    key, value, slots, _, ref, kc, vc, layout = make_batch(case, device)
    flat = torch.full((ref.numel() + 16,), SENTINEL, dtype=torch.uint8, device=device)
    cache = flat[shift : shift + ref.numel()].view(ref.shape)
    assert cache.data_ptr() % 4 == shift % 4
    store_mse(key, value, slots, cache, kc, vc, launch=CodecLaunch(block_rows=STORE_ROWS))
    assert torch.equal(cache, ref)
    assert bool((flat[:shift] == SENTINEL).all()) and bool((flat[shift + ref.numel() :] == SENTINEL).all())
    for part, codec in (("key", kc), ("value", vc)):
        assert torch.equal(load_mse(cache, slots, codec, part=part), load_mse(ref, slots, codec, part=part))


def test_int32_slot_mapping(device):
    key, value, slots, cache, ref, kc, vc, _ = make_batch(CASES[1], device)
    store_mse(key, value, slots.int(), cache, kc, vc)
    assert torch.equal(cache, ref)
    assert torch.equal(load_mse(cache, slots.int(), kc), load_mse(cache, slots, kc))


def test_strided_cache_view(device):
    """A cache that is a view (one layer of a bigger tensor, some heads of it) uses its strides."""
    tokens, heads, dim, kb, vb, rotation, dtype, block_size = case = CASES[1]
    key, value, slots, _, ref, kc, vc, layout = make_batch(case, device)
    num_blocks = ref.shape[0]
    buf = torch.full((2, num_blocks, block_size, heads + 2, layout.slot_bytes), SENTINEL, dtype=torch.uint8, device=device)
    cache = buf[1, :, :, 1 : heads + 1]
    assert not cache.is_contiguous()
    store_mse(key, value, slots, cache, kc, vc)
    assert torch.equal(cache, ref)
    untouched = torch.ones_like(buf, dtype=torch.bool)
    untouched[1, :, :, 1 : heads + 1] = False
    assert bool((buf[untouched] == SENTINEL).all())
    assert torch.equal(load_mse(cache, slots, vc, part="value"), load_mse(ref, slots, vc, part="value"))


def test_addresses_beyond_int32(device):
    """Slots at the end of a cache of more than 2**31 bytes: every offset needs int64 arithmetic.

    ``torch.empty_strided`` (not poisoned by conftest) leaves the pages untouched, so on the CPU only
    the written pages are ever backed by memory.
    """
    tokens, heads, dim, block_size = 9, 2, 64, 16
    kc, vc = codecs(dim, 4, 3, "hadamard")
    layout = kvlab.MSESlot(dim, 4, 3)
    block_bytes = block_size * heads * layout.slot_bytes
    num_blocks = 2**31 // block_bytes + 2
    cache = torch.empty_strided(
        (num_blocks, block_size, heads, layout.slot_bytes),
        (block_bytes, heads * layout.slot_bytes, layout.slot_bytes, 1),
        dtype=torch.uint8,
        device=device,
    )
    assert cache.numel() > 2**31
    g = torch.Generator().manual_seed(0)
    key, value = (torch.randn(tokens, heads, dim, generator=g).to(device) for _ in range(2))
    slots = torch.arange(num_blocks * block_size - tokens, num_blocks * block_size, device=device)
    slots[4] = -1
    store_mse(key, value, slots, cache, kc, vc)
    keep = slots >= 0
    written = cache.view(-1, heads, layout.slot_bytes)[slots[keep]]
    assert torch.equal(written, torch.cat([kc.encode(key), vc.encode(value)], -1)[keep])
    out = load_mse(cache, slots, vc, part="value", space="rotated", out_dtype=torch.float32)
    assert rel_err(out[keep], vc.decode(vc.encode(value), "rotated")[keep]) <= 1e-5
    # the model-space load (persistent, its product and bulk stores in the kernel) at the same addresses
    exact = vc.decode(vc.encode(value), "model")[keep]
    out = load_mse(cache, slots, vc, part="value", space="model")
    assert rel_err(out[keep], exact) <= 3 * rel_err(exact.half(), exact) + 1e-6
    # and the keys (on Hopper: the Gluon kernel of kvlab.mse.gluon_load)
    exact = kc.decode(kc.encode(key), "model")[keep]
    out = load_mse(cache, slots, kc, part="key", space="model")
    assert rel_err(out[keep], exact) <= 3 * rel_err(exact.half(), exact) + 1e-6


def test_padding_rows_are_not_checked_or_written(device):
    key, value, slots, cache, ref, kc, vc, _ = make_batch(CASES[1], device)
    key[1] = float("nan")  # token 1 has slot -1
    value[1] = float("inf")
    store_mse(key, value, slots, cache, kc, vc)
    assert torch.equal(cache, ref)


def test_check_false_skips_out_of_range_slots(device):
    key, value, slots, cache, ref, kc, vc, _ = make_batch(CASES[1], device)
    num_slots = cache.shape[0] * cache.shape[1]
    bad = slots.clone()
    bad[1], bad[-2] = num_slots, num_slots + 1000  # the padding tokens now point outside the cache
    store_mse(key, value, bad, cache, kc, vc, check=False)
    assert torch.equal(cache, ref)
    out = load_mse(cache, bad, kc, check=False)
    assert torch.equal(out, load_mse(cache, slots, kc))  # out-of-range rows read as zeros


def test_empty_batch(device):
    key, value, slots, cache, ref, kc, vc, _ = make_batch(CASES[1], device)
    store_mse(key[:0], value[:0], slots[:0], cache, kc, vc)
    assert bool((cache == SENTINEL).all())
    assert load_mse(cache, slots[:0], kc).shape == (0, key.shape[1], key.shape[2])


# ----------------------------------------------------------------------------- bad input

LAYOUT = kvlab.MSESlot(64, 4, 3)
KC, VC = codecs(64, 4, 3, "haar")


class _FakeCodec(kvlab.params.MSEParams):
    def __init__(self, **changes):
        for attr in ("dim", "bits", "rotation", "boundaries", "centroids", "norm_correction"):
            setattr(self, attr, changes.get(attr, getattr(KC, attr)))


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the kernels run (compiled, or interpreted)


def _args(**changes):
    args = dict(
        key=torch.randn(3, 2, 64),
        value=torch.randn(3, 2, 64),
        slot_mapping=torch.tensor([0, 5, -1]),
        cache=torch.zeros(2, 4, 2, LAYOUT.slot_bytes, dtype=torch.uint8),
        key_codec=KC,
        value_codec=VC,
    )
    args.update(changes)
    # on the device the kernels run on: the value checks (NaN, norms) happen in the kernel launch
    return {k: v.to(DEV) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v for k, v in args.items()}


def _store(**changes):
    store_mse(**_args(**changes))


def _load(**changes):
    args = dict(cache=_args()["cache"], slot_mapping=torch.tensor([0, 5, -1], device=DEV), codec=VC, part="value")
    args.update({k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in changes.items()})
    return load_mse(**args)


def _big_norm():
    key = torch.randn(3, 2, 64)
    key[0, 1] = 1e4  # norm 8e4 > 65504
    return key


def _nan_value():
    value = torch.randn(3, 2, 64)
    value[1, 0, 7] = float("nan")
    return value


BAD = [
    ("key_codec bits", lambda: _store(key_codec=_FakeCodec(bits=5)), ValueError, "key_codec.bits"),
    ("key_codec not a codec", lambda: _store(key_codec="mse"), TypeError, "key_codec"),
    ("value_codec boundaries not antisymmetric", lambda: _store(value_codec=_FakeCodec(bits=3, centroids=VC.centroids, boundaries=VC.boundaries + 1e-3)),
     ValueError, r"value_codec.boundaries must be 2\*\*bits - 1 = 7 values, antisymmetric"),
    ("value_codec dim", lambda: _store(value_codec=codecs(128, 3, 3, "haar")[0]), ValueError, "value_codec.dim"),
    ("key int dtype", lambda: _store(key=torch.ones(3, 2, 64, dtype=torch.int32)), TypeError, "key must have dtype"),
    ("key 2-D", lambda: _store(key=torch.ones(6, 64)), ValueError, "key must have shape"),
    ("value shape", lambda: _store(value=torch.ones(3, 1, 64)), ValueError, "value must have the shape"),
    ("cache dtype", lambda: _store(cache=torch.zeros(2, 4, 2, LAYOUT.slot_bytes)), TypeError, "cache must have dtype"),
    ("cache slot_bytes", lambda: _store(cache=torch.zeros(2, 4, 2, LAYOUT.slot_bytes + 1, dtype=torch.uint8)), ValueError, "cache must have shape"),
    ("cache heads", lambda: _store(cache=torch.zeros(2, 4, 3, LAYOUT.slot_bytes, dtype=torch.uint8)), ValueError, "cache must have shape"),
    (
        "cache bytes not contiguous",
        lambda: _store(cache=torch.zeros(2, 4, LAYOUT.slot_bytes, 2, dtype=torch.uint8).transpose(2, 3)),
        ValueError,
        "cache must be contiguous",
    ),
    ("key on another device", lambda: _store(key=torch.randn(3, 2, 64, device="meta")), ValueError, "key is on the meta device"),
    ("slot_mapping on another device", lambda: _store(slot_mapping=torch.zeros(3, dtype=torch.int64, device="meta")), ValueError, "slot_mapping is on the meta device"),
    ("slot_mapping float", lambda: _store(slot_mapping=torch.zeros(3)), TypeError, "slot_mapping"),
    ("slot_mapping length", lambda: _store(slot_mapping=torch.tensor([0, 1])), ValueError, "slot_mapping must have shape"),
    ("slot out of range", lambda: _store(slot_mapping=torch.tensor([0, 8, -1])), ValueError, "slot_mapping values"),
    ("slot below -1", lambda: _store(slot_mapping=torch.tensor([0, -2, 1])), ValueError, "slot_mapping values"),
    ("key NaN", lambda: _store(key=torch.full((3, 2, 64), float("nan"))), ValueError, "key holds NaN or Inf"),
    ("value NaN", lambda: _store(value=_nan_value()), ValueError, "value holds NaN or Inf"),
    ("key Inf", lambda: _store(key=torch.full((3, 2, 64), float("-inf"))), ValueError, "key holds NaN or Inf"),
    ("key norm overflows fp16", lambda: _store(key=_big_norm()), ValueError, "key has vectors with norm above"),
    ("block_rows not a power of two", lambda: _store(launch=CodecLaunch(block_rows=24)), ValueError, "launch.block_rows must be a power of two"),
    ("check not a bool", lambda: _store(check=1), TypeError, "check"),
    ("load part", lambda: _load(part="query"), ValueError, "part"),
    ("load space", lambda: _load(space="world"), ValueError, "space"),
    ("load out_dtype", lambda: _load(out_dtype=torch.int8), TypeError, "out_dtype"),
    ("load codec does not fit cache", lambda: _load(codec=codecs(128, 3, 3, "haar")[0]), ValueError, "slot_bytes"),
    ("load slot out of range", lambda: _load(slot_mapping=torch.tensor([0, 8])), ValueError, "slot_mapping values"),
    ("load slot_mapping 2-D", lambda: _load(slot_mapping=torch.zeros(2, 2, dtype=torch.int64)), ValueError, "slot_mapping"),
    ("load num_warps", lambda: _load(launch=CodecLaunch(num_warps=3)), ValueError, "launch.num_warps must be one of"),
    ("store piece", lambda: _store(launch=CodecLaunch(piece=8)), ValueError, r"launch.piece must be one of \(16, 32, 64, 128\)"),
    ("load model-space tile", lambda: _load(space="model", launch=CodecLaunch(block_rows=8)), ValueError, "block_rows must be >= 16"),
    ("load fast type", lambda: _load(space="model", launch=CodecLaunch(fast=1)), TypeError, "fast must be a bool or None"),
    ("load fast, rotated space", lambda: _load(launch=CodecLaunch(fast=True)), ValueError, "fast=True needs space='model'"),
    ("load fast, fp32 output", lambda: _load(space="model", out_dtype=torch.float32, launch=CodecLaunch(fast=True)), ValueError,
     "fast=True needs space='model' with a 16-bit out_dtype"),
    ("launch not a CodecLaunch", lambda: _store(launch=dict(num_warps=4)), TypeError, "launch must be a kvlab.CodecLaunch or None"),
    ("store launch.fast", lambda: _store(launch=CodecLaunch(fast=True)), ValueError, "launch.fast does not apply to store_mse"),
    ("load launch.piece", lambda: _load(launch=CodecLaunch(piece=64)), ValueError, "launch.piece does not apply to load_mse"),
]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's fp16 cast of a too-large norm
@pytest.mark.parametrize("name, call, error, match", BAD, ids=[b[0] for b in BAD])
def test_bad_input(name, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_reference_raises_the_same_errors():
    """The kernel's value errors are the reference's (same type, same argument named)."""
    with pytest.raises(ValueError, match="norm above"):
        KC.encode(_big_norm())
    with pytest.raises(ValueError, match="NaN or Inf"):
        VC.encode(_nan_value())
