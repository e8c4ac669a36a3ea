"""Attention over the paged quantized cache: ``decode_attention`` (one query token per sequence, the codes
dequantized inside the loop) and ``prefill_attention`` (many query tokens, over model-space K/V loaded from the
codes). The functions check their inputs (``checks``), then run the loop the support matrix picks: on a CUDA GPU
for MSE keys and values of 2 to 4 bits, the register-MMA loop of ``gluon``; elsewhere the split loop of
``triton`` (every device; on a CPU through Triton's interpreter). ``DecodeLaunch`` holds the launch choices a
caller may override. The oracle is ``kvlab.attention.reference.decode_attention_reference`` (not imported here).

What
    One new query token per sequence attends over its cached keys and values, read straight from the
    packed paged cache: ``out[b, i] = softmax(scale * q[b, i] . K[b, :seq_lens[b], h(i)]) @ V[...]``
    with ``h(i) = i // (num_q_heads / num_kv_heads)`` (grouped-query attention). Two codecs share the
    entry point, so that they can be timed side by side:

    * MSE (``kvlab.MSECodec`` keys and values, 2, 3 or 4 bits each): the cache of ``kvlab.layout``,
      exactly what ``store_mse`` writes. Attention runs in rotated space throughout. With ``y = x R``
      the rotation, a key decodes to ``k R = s_k c[i_k]`` (``c`` the Lloyd-Max centroids, ``s_k`` the
      stored fp16 scale, which holds the norm correction ``|y_k| / |c[i_k]|``), so

      .. math:: q \\cdot k = (q R_K) \\cdot (k R_K) = s_k \\sum_j (q R_K)_j\\, c[i_{k,j}],

      and ``sum_t p_t v_t = (sum_t p_t s_t c[i_t]) R_V^T``. The query is rotated once
      (one matrix product for the batch, ``rotate_rows``), every score is a dot of the rotated query with the *unscaled*
      centroids of a key times one per-token factor, every value enters with its scale folded
      into the attention weight, and the output is rotated back once at the end
      (``rotate_attention_output``). No cached vector is ever rotated.
    * Centred MSE keys (``kvlab.CenteredMSECodec``: ``k = scale * z + mean_n``, ``z`` stored with the MSE
      codec in the same slot) with MSE values: ``q . k = (q * scale) . z + q . mean_n``. The query is
      scaled before its rotation; with RoPE the second term turns with the position and is added per
      key from ``rope_mean_scores`` (one product per call against a per-position cos/sin table); without
      RoPE it is the same for every key and the softmax drops it.
    * Affine (``kvlab.AffineCodec(bits, group_size, axis="token")`` keys and values, 4 or 8 bits):
      the paged affine layout below. Dequantization ``x_j = n_j s_g + z_g`` is linear in the index
      ``n``; the kernel forms ``n s + z`` per group tile and runs the same loop (no rotation). By
      default in fp32; with ``fast=True`` in fp16 pairs (``_AFFINE4``, ``_AFFINE8``): ``0x6400 | n`` is the
      fp16 ``1024 + n``, so a subtraction and an fp16x2 multiply-add give ``n s + z``. At 4 bits that
      tile holds, at position ``2 j + h`` of each 8, coordinate ``j + 4 h`` (``_affine_tile_order``); the
      query is permuted to match and the output put back, as for the MSE tiles.

    Split-KV (flash-decoding): the keys of a sequence are cut into ``num_splits`` ranges; one program
    per (sequence, KV head, range) computes an unnormalised partial output with its running maximum and
    sum (base-2 online softmax), and a second kernel merges the ranges with a log-sum-exp reduction.
    Two loops compute the partial outputs: for MSE keys and values of 2, 3 or 4 bits on a GPU (dim 64 or
    128; 2-bit values and 3-bit keys or values at 128; at most 16 query heads per KV head) by default the one of ``kvlab.attention.gluon`` (Gluon: every tile is
    dequantized in the register layout of an ``mma.sync`` operand, none goes through shared memory),
    otherwise the split loop below (``_decode_split_kernel``); ``mma=`` chooses.

    ``prefill_attention`` is the continuation-prefill path (several new tokens per sequence whose keys
    and values are already in the cache): it materialises model-space K/V of the whole context, the
    inverse rotation as a batched matrix product (``load_mse(space="model")``), and runs torch SDPA.

Reference
    ``kvlab.attention.reference.decode_attention_reference`` / ``prefill_attention_reference``: fp32 attention
    over the cache dequantized by the reference codecs (this module does not import them);
    ``tests/ops/test_attention.py`` compares the two.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import _checks as C
from .._kernels import tables as T
from .._kernels.mma_tile import key_words_layout
from ..centered.api import load_centered_mse
from ..affine.api import decode_affine
from ..layout import HEAD_DIMS as DIMS, MSESlot
from ..mse.api import load_mse
from . import gluon
from .checks import check_codecs, check_paged_inputs, is_centered, is_mse, slot_layout, split_centered
from .triton import LOG2E, MIN_SPLIT_TOKENS, PROGRAMS_PER_SM, merge, merge_spec, on_device, partials, rope_mean_scores, rotate_rows, rotate_spec, split_spec, split_tables

__all__ = ["DecodeLaunch", "decode_attention", "launch_defaults", "prefill_attention", "rotate_attention_output"]


@dataclass(frozen=True)
class DecodeLaunch:
    """How ``decode_attention`` runs; every field left at None is the default measured fastest on an H200.

    ``num_splits`` (default: for the split loop about 16 programs per SM, splits of at least 256 keys; for
    the loop of ``kvlab.attention.gluon``, ``gluon.default_splits``), ``block_n`` (keys
    per step, a power of two 16..256), ``num_warps``, ``num_stages`` and ``max_registers`` (a cap on
    registers per thread, 32..255, so that more warps fit on an SM; ignored by the interpreter) tune
    the launch; ``fast`` picks, for MSE caches, the ``prmt`` lookup over the generic unpack, and for
    affine caches the dequantization in fp16 pairs (``_AFFINE4``, ``_AFFINE8``: no int-to-float
    conversion, no exchange of scales between threads) over the fp32 one. Every launch argument left
    at ``None`` comes from ``launch_defaults`` (the fastest configuration measured for the cache's
    kind and widest bit width; ``fast`` only when compiled for a GPU). ``prefetch`` (MSE caches) pipelines the split loop by hand: each step issues the
    next step's block-table, code and norm reads before its own arithmetic (more registers, more reads
    in flight). ``keys_as_rows`` computes the transposed products, ``K q^T`` and ``V^T P^T``: the keys (and
    the dims) are the rows of the matrix products, 64 or more, so that on Hopper Triton can issue them as
    warpgroup MMAs (``wgmma``, at least 64 rows) instead of padding the query group to 16-row ``mma``
    tiles; the result is the same up to float rounding.
    ``mma`` picks the loop: ``True`` the loop of ``kvlab.attention.gluon`` (MSE keys and values of 2, 3 or 4
    bits, dim 64 or 128 (2-bit values, 3-bit keys or values: 128), at most 16 query heads per KV head, a CUDA GPU of compute capability 8.0 or later; the
    tiles are dequantized in the tensor cores' register operands), ``False`` the split loop above
    (``_decode_split_kernel``). ``None`` (the default) takes the first wherever it applies and no
    launch argument of the split loop (``block_n``, ``num_warps``, ``num_stages``, ``max_registers``,
    ``fast``, ``prefetch``, ``keys_as_rows``) is given; ``num_splits`` applies to both.

    """

    mma: bool | None = None
    num_splits: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    max_registers: int | None = None
    fast: bool | None = None
    prefetch: bool | None = None
    keys_as_rows: bool | None = None


def rotate_attention_output(output: torch.Tensor, value_codec) -> torch.Tensor:
    """Rotated-space attention output ``[..., dim]`` -> model space: ``output @ R_V^T`` in fp32, one kernel.

    The only inverse rotation of the decode path; returns fp32 (cast as needed).
    """
    C.check_tensor("output", output, C.FLOAT_DTYPES, ndim_min=1)
    if not is_mse(value_codec):
        raise TypeError(f"value_codec must be a kvlab.MSECodec, got {type(value_codec).__name__}")
    if output.shape[-1] != value_codec.dim:
        raise ValueError(f"output's last dimension ({output.shape[-1]}) must equal value_codec.dim ({value_codec.dim})")
    return _to_model_space(output, value_codec)


def _to_model_space(output: torch.Tensor, value_codec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    rot_t = T.cached(value_codec, ("rotation_t", output.device), value_codec.rotation,
                    lambda r: r.to(device=output.device, dtype=torch.float32).T.contiguous())
    return rotate_rows(output, rot_t, dtype)


# The launch of the split loop when the caller leaves it to the library: the fastest configuration of
# ``benchmarks/bench_decode.py --sweep`` at batch 8, context 32k, 32 query and 8 KV heads, head dim 128,
# on an H200 (results/decode_attention_sweep.csv, timed before the value codes were read as aligned
# words), by cache kind and the wider of the key and value bit widths. Centred 2- and 3-bit keys use
# the MSE entry. Other shapes and GPUs may prefer others: each entry is a set of ``DecodeLaunch`` fields.
LAUNCH_DEFAULTS = {
    ("mse", 4): dict(block_n=64, num_warps=4, num_stages=1, prefetch=True, keys_as_rows=True, fast=True),
    ("mse", 3): dict(block_n=128, num_warps=4, num_stages=1, max_registers=168, keys_as_rows=True, fast=True),
    ("mse", 2): dict(block_n=128, num_warps=4, num_stages=1, keys_as_rows=True, fast=True),
    ("centered", 4): dict(block_n=64, num_warps=4, num_stages=1, fast=True),
    ("affine", 4): dict(block_n=128, num_warps=4, num_stages=1, fast=True),
    ("affine", 8): dict(block_n=64, num_warps=4, num_stages=2, fast=False),
}


def launch_defaults(kind: str, bits: int) -> dict:
    """The split loop's launch arguments for a cache ``kind`` (``"mse"``, ``"centered"``, ``"affine"``) whose
    wider codec has ``bits`` bits: a copy of the ``LAUNCH_DEFAULTS`` entry (``fast`` as measured, before
    the interpreter turns it off)."""
    entry = (kind, bits) if (kind, bits) in LAUNCH_DEFAULTS or kind != "centered" else ("mse", bits)
    if entry not in LAUNCH_DEFAULTS:
        raise ValueError(f"no launch defaults for a {kind!r} cache of {bits} bits; have {sorted(LAUNCH_DEFAULTS)}")
    return dict(LAUNCH_DEFAULTS[entry])


@functools.lru_cache(maxsize=None)
def _mma_splits(batch: int, num_kv_heads: int, capacity: int, device) -> int:
    """The default split count of the loop of ``kvlab.attention.gluon`` (``gluon.default_splits``)."""
    return gluon.default_splits(batch * num_kv_heads, capacity, T.sm_count(device))


@functools.lru_cache(maxsize=None)
def _default_splits(batch: int, num_kv_heads: int, capacity: int, block_n: int, device) -> int:
    """The split loop's default: about ``PROGRAMS_PER_SM`` programs an SM, each split at least
    ``MIN_SPLIT_TOKENS`` (and ``block_n``) keys."""
    want = C.cdiv(PROGRAMS_PER_SM * T.sm_count(device), max(1, batch * num_kv_heads))
    return max(1, min(want, C.cdiv(capacity, max(MIN_SPLIT_TOKENS, block_n))))


def _mma_unsupported(q, num_kv_heads, kind, centered, key_codec, value_codec) -> str | None:
    """Why the loop of ``kvlab.attention.gluon`` cannot run this call, or None."""
    if not T.compiled(q.device):
        return "a CUDA GPU (Triton's interpreter cannot run Gluon kernels)"
    if T.capability(q.device) < (8, 0):
        return "a GPU of compute capability 8.0 or later (mma.sync m16n8k16)"
    if kind != "mse" or centered is not None or key_codec.bits not in gluon.BITS or value_codec.bits not in gluon.BITS:
        widths = ", ".join(map(str, gluon.BITS[:-1])) + f" or {gluon.BITS[-1]}"
        return f"MSE key and value codecs of {widths} bits (not centred keys)"
    if q.shape[-1] not in gluon.DIMS:
        return f"a head dim in {gluon.DIMS}, got {q.shape[-1]}"
    if value_codec.bits * q.shape[-1] < 256:
        return f"a head dim of at least 128 for {value_codec.bits}-bit values, got {q.shape[-1]}"
    if key_codec.bits == 3 and q.shape[-1] != 128:
        return f"a head dim of 128 for 3-bit keys, got {q.shape[-1]}"
    if q.shape[-2] // num_kv_heads > gluon.MAX_GROUP:
        return f"at most {gluon.MAX_GROUP} query heads per KV head, got {q.shape[-2] // num_kv_heads}"
    if T.prmt_tables(key_codec) is None or T.prmt_tables(value_codec) is None:
        return "symmetric fp16 codebooks (the byte-permute lookup)"
    return None


def _takes_mma_loop(q, num_kv_heads, kind, centered, key_codec, value_codec, mma, given) -> bool:
    """Whether ``decode_attention`` runs the loop of ``kvlab.attention.gluon`` (``mma``: the caller's choice,
    ``given``: the names of the split loop's launch arguments set); ``mma=True`` that cannot run raises."""
    if mma is False:
        return False
    why_not = _mma_unsupported(q, num_kv_heads, kind, centered, key_codec, value_codec)
    if mma and why_not:
        raise ValueError(f"mma=True needs {why_not}")
    if mma and given:
        raise ValueError(f"mma=True takes none of the split loop's launch arguments, got {', '.join(given)}")
    return why_not is None and not given and (mma or (key_codec.bits, value_codec.bits) in gluon.DEFAULT_BITS)


def _decode_mma(q, cache, block_table, seq_lens, key_codec, value_codec, scale, num_splits, capacity, check=True):
    """``decode_attention`` through ``kvlab.attention.gluon.decode_mma_kernel`` (inputs checked), then the merge;
    None when ``check`` finds that the pre-scaled query overflows fp16 (the split loop handles it)."""
    batch, num_q_heads, dim = q.shape
    num_kv_heads = cache.shape[2]
    device = q.device
    assert MSESlot(dim, key_codec.bits, value_codec.bits).value_offset % 4 == 2
    rot_k, order_v = _mma_tables(key_codec, value_codec, dim, scale * LOG2E, device)
    q_in = rotate_rows(q, rot_k, torch.float16)
    if check and not bool(torch.isfinite(q_in).all()):
        return None
    if not check:  # unchecked tables and lengths: clamped, so that no read leaves the cache
        block_table = block_table.clamp(0, cache.shape[0] - 1)
        seq_lens = seq_lens.clamp(0, capacity)
    split_len, num_splits = _mma_split_len(batch, num_kv_heads, capacity, num_splits, device)
    o_part, ml_part, out = partials(batch, num_q_heads, num_splits, dim, device)
    if batch == 0:
        return out.to(q.dtype)
    grid, args, constants, options = _mma_launch(q_in, cache, block_table, seq_lens, o_part, ml_part, key_codec,
                                                 value_codec, split_len, num_splits)
    with on_device(device):
        gluon.launch(grid, args, constants, options)
        merge(o_part, ml_part, order_v, out)
    return _to_model_space(out, value_codec, q.dtype)


def _mma_tables(key_codec, value_codec, dim: int, q_scale: float, device):
    """``(rotation of the query times q_scale, its columns in the loop's order; output coordinate order)``."""
    rot_k = T.cached(key_codec, ("mma_query_rotation", device, q_scale), key_codec.rotation,
                    lambda r: (r.to(device=device, dtype=torch.float32)[:, gluon.query_order(dim, key_codec.bits).to(device)]
                               * q_scale).contiguous())
    order_v = T.cached(value_codec, ("mma_output_order", device), value_codec.centroids,
                      lambda _: gluon.output_order(dim).to(device=device, dtype=torch.int32))
    return rot_k, order_v


def _mma_split_len(batch: int, num_kv_heads: int, capacity: int, num_splits, device) -> tuple[int, int]:
    """``(keys per split, splits)`` of the loop of ``kvlab.attention.gluon`` (``num_splits`` None: the default)."""
    if num_splits is None:
        num_splits = _mma_splits(batch, num_kv_heads, capacity, device)
    split_len = C.cdiv(C.cdiv(capacity, num_splits), gluon.STEP) * gluon.STEP
    return split_len, C.cdiv(capacity, split_len)


def _mma_launch(q_in, cache, block_table, seq_lens, o_part, ml_part, key_codec, value_codec, split_len, num_splits):
    """``(grid, arguments, constants, options)`` of ``gluon.launch`` for the loop of ``_decode_mma``."""
    batch, num_q_heads, dim = q_in.shape
    num_kv_heads = cache.shape[2]
    layout = MSESlot(dim, key_codec.bits, value_codec.bits)
    group_rows = max(8, C.next_power_of_2(num_q_heads // num_kv_heads))
    max_registers = gluon.num_registers(group_rows)
    extra = {} if max_registers is None else dict(maxnreg=max_registers)
    args = (q_in, cache, block_table, seq_lens, o_part, ml_part, *T.prmt_tables(key_codec), *T.prmt_tables(value_codec),
            split_len, num_splits, block_table.stride(0), cache.stride(0), cache.stride(1), cache.stride(2))
    constants = dict(HQ=num_q_heads, HKV=num_kv_heads, BLOCK_SIZE=cache.shape[1], D=dim,
                     KEY_NORM_OFFSET=layout.key_norm_offset, VALUE_OFFSET=layout.value_offset,
                     VALUE_NORM_OFFSET=layout.value_norm_offset, BG=group_rows, BITS_K=key_codec.bits,
                     BITS_V=value_codec.bits, KEY_WORDS=key_words_layout(dim, key_codec.bits),
                     VALUE_WORDS=gluon.value_words_layout(dim, value_codec.bits))
    return (batch * num_kv_heads, num_splits), args, constants, dict(num_warps=1, **extra)


def decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    key_codec,
    value_codec,
    *,
    scale: float | None = None,
    position_offset: int = 0,
    check: bool = True,
    launch: DecodeLaunch | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged quantized cache: ``[batch, num_q_heads, dim]``.

    ``q``: fp16/bf16 ``[batch, num_q_heads, dim]`` (dim 64, 128 or 256), ``num_q_heads`` a multiple of
    the cache's ``num_kv_heads``. ``cache``: the paged MSE cache of ``kvlab.layout`` (``MSECodec``
    key and value codecs, 2/3/4 bits) or the paged affine cache of ``AffineSlot``
    (``AffineCodec`` key and value codecs, token axis, 4/8 bits). ``block_table`` int32 ``[batch,
    max_blocks]``, ``seq_lens`` int32/int64 ``[batch]`` (1 .. ``max_blocks * block_size``).
    ``scale``: softmax scale (default ``dim ** -0.5``). Returns ``q.dtype``.

    ``launch`` (a ``DecodeLaunch``; default: the measured fastest) picks the loop and its launch configuration.
    ``check=True`` also checks ``seq_lens`` and the used ``block_table`` entries (one host sync), that
    the codecs are those that wrote the cache (where a launcher recorded them), and whether the
    pre-scaled fp16 query overflows (a large ``scale`` or ``q``: it is then divided by a power of two
    and the scores multiplied back); ``check=False`` never syncs, clamps block-table entries into
    ``[0, num_blocks)`` and lengths into ``[0, max_blocks * block_size]`` so that no read leaves the
    cache (such inputs give unspecified numbers), and needs ``q * scale`` within fp16 after the rotation.

    Centred keys (``key_codec`` a ``kvlab.centered.reference.CenteredMSECodec`` with ``num_heads =
    num_kv_heads``, MSE values): the cache is the same MSE cache (``store_centered_mse`` writes it). The
    query is scaled by the key scale of its KV head before its rotation; with ``rope`` every score also
    gets ``q . RoPE_n(mean)`` (``rope_mean_scores``, one GEMM per call, read by the kernel per key),
    token ``t`` of a sequence being at position ``n = position_offset + t``; without ``rope`` the mean's
    term is the same for every key, and the softmax drops it.
    """
    if launch is None:
        launch = DecodeLaunch()
    elif not isinstance(launch, DecodeLaunch):
        raise TypeError(f"launch must be a kvlab.attention.DecodeLaunch or None, got {type(launch).__name__}")
    num_splits, block_n, num_warps, num_stages = launch.num_splits, launch.block_n, launch.num_warps, launch.num_stages
    max_registers, fast, prefetch, keys_as_rows, mma = (launch.max_registers, launch.fast, launch.prefetch, launch.keys_as_rows,
                                                        launch.mma)
    C.check_tensor("q", q, (torch.float16, torch.bfloat16))
    if q.dim() != 3:
        raise ValueError(f"q must have shape [batch, num_q_heads, dim], got {tuple(q.shape)}")
    batch, num_q_heads, dim = q.shape
    if dim not in DIMS:
        raise ValueError(f"q's last dimension (head dim) must be one of {DIMS}, got {dim}")
    kind = check_codecs(key_codec, value_codec, dim)
    centered, key_codec = split_centered(key_codec, position_offset)
    split_args = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages, max_registers=max_registers, fast=fast,
                      prefetch=prefetch, keys_as_rows=keys_as_rows)
    tuned = launch_defaults("centered" if centered is not None else kind, max(key_codec.bits, value_codec.bits))
    block_n = tuned["block_n"] if block_n is None else block_n
    num_warps = tuned["num_warps"] if num_warps is None else num_warps
    num_stages = tuned.get("num_stages") if num_stages is None else num_stages
    max_registers = tuned.get("max_registers") if max_registers is None else max_registers
    prefetch = tuned.get("prefetch", False) if prefetch is None else prefetch
    keys_as_rows = tuned.get("keys_as_rows", False) if keys_as_rows is None else keys_as_rows
    layout = slot_layout(kind, dim, key_codec, value_codec)
    C.check_bool("check", check)
    num_blocks, block_size, num_kv_heads, capacity = check_paged_inputs(q, cache, block_table, seq_lens, layout, check)
    if centered is not None and centered.num_heads != num_kv_heads:
        raise ValueError(f"key_codec.num_heads ({centered.num_heads}) must equal the cache's num_kv_heads ({num_kv_heads})")
    if check:
        C.check_reader(cache, key_codec, value_codec)
        C.check_finite("q", q)
    if scale is None:
        scale = dim**-0.5
    scale = C.check_scale("scale", scale)
    C.check_bool("mma", mma, optional=True)
    given = [k for k, v in split_args.items() if v is not None]
    if _takes_mma_loop(q, num_kv_heads, kind, centered, key_codec, value_codec, mma, given):
        if num_splits is not None:
            C.check_int("num_splits", num_splits, minimum=1)
        out = _decode_mma(q, cache, block_table, seq_lens, key_codec, value_codec, scale, num_splits, capacity, check)
        if out is not None:
            return out
    C.check_int("block_n", block_n, (16, 32, 64, 128, 256))
    C.check_int("num_warps", num_warps, (1, 2, 4, 8, 16))
    if num_stages is not None:
        C.check_int("num_stages", num_stages, minimum=1)
    if max_registers is not None:
        C.check_int("max_registers", max_registers, minimum=32)
        if max_registers > 255:
            raise ValueError(f"max_registers must be at most 255 (registers per thread), got {max_registers}")
    if num_splits is None:
        num_splits = _default_splits(batch, num_kv_heads, capacity, block_n, q.device)
    C.check_int("num_splits", num_splits, minimum=1)
    interpreted = not T.compiled(q.device)
    C.check_bool("fast", fast, optional=True)
    if fast is None:  # inline PTX: only when compiled for a GPU
        fast = not interpreted and tuned["fast"]
    C.check_bool("prefetch", prefetch)
    C.check_bool("keys_as_rows", keys_as_rows)
    if prefetch and kind != "mse":
        raise ValueError("prefetch=True applies to MSE caches (the affine path is not pipelined)")
    if fast and interpreted and not T.interpreter_runs_ptx():
        raise ValueError("fast=True needs a CUDA device (inline PTX); use fast=False or None on the CPU")

    device = q.device
    split_len = C.cdiv(C.cdiv(capacity, num_splits), block_n) * block_n
    num_splits = C.cdiv(capacity, split_len)  # no empty trailing splits
    q_scale = scale * LOG2E  # base-2 exponentials: log2(e) rides on the softmax scale
    q_unscale = 1.0
    t = split_tables(kind, key_codec, value_codec, dim, q_scale, fast, device, centered, num_q_heads // num_kv_heads)
    if kind == "mse":
        q_in = rotate_rows(q, t["rot_q"], torch.float16, t["key_scale"])
        if check and not bool(torch.isfinite(q_in).all()):  # q * scale beyond fp16: scaled down, scores scaled back
            q_in, q_unscale = C.fit_fp16(rotate_rows(q, t["rot_q"], torch.float32, t["key_scale"]))
    else:
        q_in = q.float()
        if fast:  # tiles in _affine_tile_order: the query's coordinates permuted to match, the output's put back
            q_in = q_in[..., t["order_q"]]
        q_in = q_in * q_scale
        q_in, q_unscale = C.fit_fp16(q_in) if check else (q_in.to(torch.float16).contiguous(), 1.0)
    bias = None
    if centered is not None and centered.rope is not None:
        bias = (rope_mean_scores(q, centered, capacity, position_offset) * q_scale).contiguous()

    o_part, ml_part, out = partials(batch, num_q_heads, num_splits, dim, device)
    if batch == 0:
        return out.to(q.dtype)
    fn, grid, args, options = split_spec(
        q_in, cache, block_table, seq_lens, o_part, ml_part, bias, t, key_codec, value_codec, split_len, num_blocks,
        capacity, q_unscale, kind=kind, block_n=block_n, fast=fast, prefetch=prefetch, keys_as_rows=keys_as_rows,
        interpreted=interpreted, num_warps=num_warps, num_stages=num_stages, max_registers=max_registers)
    with on_device(device):
        fn[grid](**args, **options)
        merge(o_part, ml_part, t["order_v"], out)
    if kind == "mse":
        return _to_model_space(out, value_codec, q.dtype)
    return out.to(q.dtype)


class DecodeStep:
    """``decode_attention(q, cache, block_table, seq_lens, key_codec, value_codec, scale=scale, check=False)``
    repeated on one cache, block table and lengths tensor (read in place at every call: their owner advances
    them and keeps them valid) for queries of one shape and dtype — one layer of a ``PagedKVCache`` in a decode
    step. The checks, device tables, buffers and launch arguments are prepared once; a call replays the
    launches (``kvlab._kernels.replay``): the query's rotation, the loop, the merge and the output's rotation. Returns
    the same output as ``decode_attention``, in a buffer that the next call overwrites. MSE and affine caches
    (not centred keys); the loop is ``decode_attention``'s default for the shape."""

    def __init__(self, q, cache, block_table, seq_lens, key_codec, value_codec, *, scale=None):
        from .._kernels.replay import Launch

        decode_attention(q, cache, block_table, seq_lens, key_codec, value_codec, scale=scale, check=False)  # checks
        batch, num_q_heads, dim = q.shape
        kind = check_codecs(key_codec, value_codec, dim)
        if is_centered(key_codec):
            raise ValueError("the decode step reads MSE and affine caches, not centred keys")
        device, self.shape, self.dtype = q.device, tuple(q.shape), q.dtype
        num_blocks, block_size, num_kv_heads, _ = cache.shape
        capacity = block_table.shape[1] * block_size
        q_scale = (dim**-0.5 if scale is None else scale) * LOG2E
        interpreted = not T.compiled(device)
        if _takes_mma_loop(q, num_kv_heads, kind, None, key_codec, value_codec, None, []):
            rot_q, order_v = _mma_tables(key_codec, value_codec, dim, q_scale, device)
            split_len, num_splits = _mma_split_len(batch, num_kv_heads, capacity, None, device)
            q_in = torch.empty(q.shape, dtype=torch.float16, device=device)
            o_part, ml_part, out = partials(batch, num_q_heads, num_splits, dim, device)
            loop = gluon.spec(*_mma_launch(q_in, cache, block_table, seq_lens, o_part, ml_part, key_codec,
                                                value_codec, split_len, num_splits))
        else:
            tuned = launch_defaults(kind, max(key_codec.bits, value_codec.bits))
            fast = not interpreted and tuned["fast"]
            num_splits = _default_splits(batch, num_kv_heads, capacity, tuned["block_n"], device)
            split_len = C.cdiv(C.cdiv(capacity, num_splits), tuned["block_n"]) * tuned["block_n"]
            num_splits = C.cdiv(capacity, split_len)
            t = split_tables(kind, key_codec, value_codec, dim, q_scale, fast, device)
            if kind == "mse":
                rot_q = t["rot_q"]
            else:  # the coordinate order times q_scale, as a matrix: one launch (the product is exact)
                eye = torch.eye(dim, dtype=torch.float32, device=device)
                rot_q = ((eye if t["order_q"] is None else eye[:, t["order_q"]]) * q_scale).contiguous()
            order_v = t["order_v"]
            q_in = torch.empty(q.shape, dtype=torch.float16, device=device)
            o_part, ml_part, out = partials(batch, num_q_heads, num_splits, dim, device)
            loop = split_spec(q_in, cache, block_table, seq_lens, o_part, ml_part, None, t, key_codec, value_codec,
                               split_len, num_blocks, capacity, 1.0, kind=kind, block_n=tuned["block_n"], fast=fast,
                               prefetch=tuned.get("prefetch", False), keys_as_rows=tuned.get("keys_as_rows", False),
                               interpreted=interpreted, num_warps=tuned["num_warps"],
                               num_stages=tuned.get("num_stages"), max_registers=tuned.get("max_registers"))
        self.device, self.out = device, out
        self.result = torch.empty(q.shape, dtype=q.dtype, device=device)
        self.rotate_q = Launch(*rotate_spec(q.contiguous(), rot_q, q_in), variable=("x_ptr",))
        self.loop = Launch(*loop)
        self.merge = Launch(*merge_spec(o_part, ml_part, order_v, out))
        self.rotate_out = None
        if kind == "mse":
            rot_t = T.cached(value_codec, ("rotation_t", device), value_codec.rotation,
                            lambda r: r.to(device=device, dtype=torch.float32).T.contiguous())
            self.rotate_out = Launch(*rotate_spec(out, rot_t, self.result))

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        if tuple(q.shape) != self.shape or q.dtype != self.dtype:
            raise ValueError(f"q must be {self.dtype} of shape {list(self.shape)}, got {q.dtype} {list(q.shape)}")
        q = q if q.is_contiguous() else q.contiguous()
        with on_device(self.device):
            self.rotate_q(x_ptr=q)
            self.loop()
            self.merge()
            if self.rotate_out is None:
                self.result.copy_(self.out)
            else:
                self.rotate_out()
        return self.result


def _slot_mapping(block_table, seq_lens, block_size: int, length: int) -> torch.Tensor:
    """``[batch, length]`` slots of positions ``0 .. length - 1`` (-1 past each sequence's end)."""
    t = torch.arange(length, device=block_table.device)
    blocks = block_table.long().gather(1, (t // block_size).expand(block_table.shape[0], -1))
    slots = blocks * block_size + t % block_size
    return torch.where(t[None, :] < seq_lens[:, None], slots, -1)


def prefill_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    key_codec,
    value_codec,
    *,
    scale: float | None = None,
    check: bool = True,
    position_offset: int = 0,
) -> torch.Tensor:
    """Continuation prefill: ``q`` ``[batch, q_len, num_q_heads, dim]`` are the last ``q_len`` tokens of
    each sequence (already in the cache); causal attention over the whole cached context.

    Materialises model-space K/V of all ``max(seq_lens)`` positions (MSE: ``load_mse(space="model")``,
    the inverse rotation as a batched matrix product, in the load kernel for 16-bit ``q``; centred
    keys: ``load_centered_mse``, token ``t`` at position ``position_offset + t``; affine:
    ``decode_affine``) and runs torch SDPA with a causal, length-masked boolean mask. Returns
    ``q.dtype`` ``[batch, q_len, num_q_heads, dim]``.
    """
    C.check_tensor("q", q, (torch.float16, torch.bfloat16))
    if q.dim() != 4:
        raise ValueError(f"q must have shape [batch, q_len, num_q_heads, dim], got {tuple(q.shape)}")
    batch, q_len, num_q_heads, dim = q.shape
    if dim not in DIMS:
        raise ValueError(f"q's last dimension (head dim) must be one of {DIMS}, got {dim}")
    kind = check_codecs(key_codec, value_codec, dim)
    centered, key_codec = split_centered(key_codec, position_offset)
    layout = slot_layout(kind, dim, key_codec, value_codec)
    C.check_bool("check", check)
    num_blocks, block_size, num_kv_heads, capacity = check_paged_inputs(q, cache, block_table, seq_lens, layout, True)
    if check:
        C.check_reader(cache, key_codec, value_codec)
        C.check_finite("q", q)
    if bool((seq_lens < q_len).any()):
        raise ValueError(f"seq_lens must be >= q_len ({q_len}): the new tokens are the last ones of each cached sequence")
    if scale is None:
        scale = dim**-0.5
    scale = C.check_scale("scale", scale)
    if batch == 0:
        return torch.zeros_like(q)
    length = int(seq_lens.max())
    slots = _slot_mapping(block_table, seq_lens, block_size, length).reshape(-1)
    if kind == "mse":
        if centered is not None:
            positions = torch.arange(length, device=q.device).repeat(batch) + position_offset if centered.rope is not None else None
            k = load_centered_mse(cache, slots, centered, space="model", out_dtype=q.dtype, positions=positions)
        else:
            k = load_mse(cache, slots, key_codec, part="key", space="model", out_dtype=q.dtype)
        v = load_mse(cache, slots, value_codec, part="value", space="model", out_dtype=q.dtype)
    else:
        flat = cache.view(num_blocks * block_size, num_kv_heads, layout.slot_bytes)[slots.clamp_min(0)]
        gs = key_codec.group_size
        k = decode_affine(flat[..., : layout.key_code_bytes].contiguous(), key_codec.bits, gs, "token", dim, q.dtype)
        v = decode_affine(flat[..., layout.key_code_bytes:].contiguous(), value_codec.bits, gs, "token", dim, q.dtype)
    k = k.view(batch, length, num_kv_heads, dim).transpose(1, 2)
    v = v.view(batch, length, num_kv_heads, dim).transpose(1, 2)
    t = torch.arange(length, device=q.device)
    pos = seq_lens[:, None].long() - q_len + torch.arange(q_len, device=q.device)[None, :]  # [batch, q_len]
    mask = (t[None, None, :] <= pos[:, :, None]) & (t[None, None, :] < seq_lens[:, None, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=float(scale), enable_gqa=num_q_heads != num_kv_heads)
    return out.transpose(1, 2)
