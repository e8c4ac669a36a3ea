"""Triton kernels for the MSE codec in the paged KV cache: ``store_mse`` and ``load_mse``.

What
    ``store_mse`` encodes keys and values of a batch and writes their codes into the cache slots of
    ``slot_mapping``. The rotation ``y = x.float() @ R`` is one batched torch GEMM per tensor (exactly
    the reference's, so the bytes can match); then ONE Triton launch handles key and value: per
    ``(token, head)`` row it takes the norm (fp64 accumulation, cast to fp32), normalises with IEEE
    division, counts the Lloyd-Max boundaries strictly below each coordinate (``torch.bucketize``),
    packs the indices and writes them with the fp16 norm.

    ``load_mse`` reads the key or the value part of the slots back: unpack the indices, gather the
    centroids (a table of at most 16 floats), optionally renormalise the centroid vector (norm
    correction), multiply by the stored fp16 norm. ``space="rotated"`` returns that (what attention in
    rotated space consumes); ``space="model"`` follows it with one batched GEMM by ``R.T``.

    Each program handles a tile of ``BLOCK_ROWS`` rows of ``dim`` elements, viewed as
    ``[BLOCK_ROWS, BLOCK_G, 8]``: element ``d = 8 g + k``. Eight ``bits``-wide indices make exactly
    ``bits`` bytes, so packing is "sum the eight shifted indices of a group into one word, cut the word
    into ``bits`` bytes" for 2, 3 and 4 bits alike, and unpacking is its inverse. The bytes of a group
    are stored as a ``[BLOCK_ROWS, BLOCK_G, 4]`` tile with lane ``j < bits`` live; each output byte is
    built from its source fields, never scattered.

Layout (``kvlab.layout``)
    cache: uint8 ``[num_blocks, block_size, num_heads, slot_bytes]``, one slot of one head is
    ``key indices | key norm (fp16 LE) | value indices | value norm (fp16 LE)``. Token ``i`` goes to
    slot ``slot_mapping[i] = block * block_size + offset``; ``-1`` is padding (not written; read as
    zeros). Indices form a little-endian bit stream, element ``j`` at bit ``bits * j``.

Reference
    ``kvlab.reference.MSECodec.encode`` / ``decode`` with ``write_slots`` / ``read_slots``. This module
    does not import it; ``tests/test_mse_kernels.py`` compares the two (``torch.equal`` on the cache).

Checks
    With ``check=True`` (the default) the launchers also check values, which costs one host sync per
    call: slot numbers in range (before the launch) and, for ``store_mse``, NaN/Inf inputs and norms
    that overflow fp16 (flags the kernel raises in a one-word device tensor, read after the launch; the
    call's slots are then already written). ``check=False`` skips every value check and never syncs;
    the kernels still skip out-of-range slots instead of writing outside the cache.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch
import triton
import triton.language as tl

from . import _checks as C
from .layout import NORM_BYTES, MSESlot, packed_bytes

__all__ = ["load_mse", "store_mse", "unpack_values_model_space", "unpack_values_rotated"]

MSE_BITS = (2, 3, 4)
GROUP = 8  # indices per group: 8 indices of `bits` bits are exactly `bits` bytes
TILE_ELEMENTS = 2048  # default BLOCK_ROWS * BLOCK_D of one program (registers: an fp64 copy of the tile)

# error flags raised by the store kernel when CHECK is on
FLAG_KEY_NONFINITE, FLAG_KEY_OVERFLOW, FLAG_VALUE_NONFINITE, FLAG_VALUE_OVERFLOW = 1, 2, 4, 8


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _encode_part(
    # pointers
    y_ptr,  # fp32 [num_rows, D]: rotated vectors of this part (key or value)
    bnd_ptr,  # fp32 [NUM_BOUNDARIES]: Lloyd-Max boundaries, ascending
    cache_ptr,  # uint8: the cache, addressed by byte offsets
    status_ptr,  # int32 [1]: error flags, OR-ed in when CHECK
    # this tile's rows
    o_r,  # [BR] int64: row ids (token * num_heads + head)
    m_r,  # [BR] bool: rows to write (in range, slot valid)
    o_dst,  # [BR] int64: byte offset of this part's code in the row's slot
    # settings
    D: tl.constexpr,  # dim
    BLOCK_ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,  # groups of 8 elements per row (power of two, 8 * BLOCK_G >= D)
    BITS: tl.constexpr,
    NUM_BOUNDARIES: tl.constexpr,  # 2**BITS - 1
    INDEX_BYTES: tl.constexpr,  # ceil(D * BITS / 8)
    CHECK: tl.constexpr,
    FLAG_NONFINITE: tl.constexpr,
    FLAG_OVERFLOW: tl.constexpr,
):
    o_g = tl.arange(0, BLOCK_G)
    o_k = tl.arange(0, 8)
    o_j = tl.arange(0, 4)
    o_d = o_g[:, None] * 8 + o_k[None, :]  # [BG, 8] element index d = 8 g + k
    m_d = o_d < D
    m = m_r[:, None, None] & m_d[None, :, :]  # [BR, BG, 8]

    p_y = y_ptr + o_r[:, None, None] * D + o_d[None, :, :]
    b_y = tl.load(p_y, mask=m, other=0.0)  # [BR, BG, 8] fp32

    # norm as in the reference: fp64 sum of squares (each square exact), sqrt in fp64
    # (tl.sqrt lowers to the IEEE sqrt for fp64), rounded once to fp32
    b_y64 = b_y.to(tl.float64)
    b_norm = tl.sqrt(tl.sum(tl.sum(b_y64 * b_y64, axis=2), axis=1)).to(tl.float32)  # [BR]
    b_unit = tl.math.div_rn(b_y, tl.where(b_norm > 0, b_norm, 1.0)[:, None, None])  # [BR, BG, 8]

    # index = number of boundaries strictly below the coordinate (torch.bucketize, right=False)
    b_idx = tl.zeros([BLOCK_ROWS, BLOCK_G, 8], dtype=tl.uint32)
    for i in tl.static_range(NUM_BOUNDARIES):
        b_idx += (b_unit > tl.load(bnd_ptr + i)).to(tl.uint32)
    b_idx = tl.where(m_d[None, :, :], b_idx, 0)  # padding elements pack as zero bits

    # pack: index k of group g sits at bit BITS * k of the group's word, which is code bytes
    # [BITS * g, BITS * g + BITS), little-endian
    b_word = tl.sum(b_idx << (o_k * BITS).to(tl.uint32)[None, None, :], axis=2)  # [BR, BG] uint32
    b_bytes = ((b_word[:, :, None] >> (o_j * 8).to(tl.uint32)[None, None, :]) & 0xFF).to(tl.uint8)  # [BR, BG, 4]
    o_b = o_g[:, None] * BITS + o_j[None, :]  # [BG, 4] byte in the code
    m_b = (o_j[None, :] < BITS) & (o_b < INDEX_BYTES)
    p_b = cache_ptr + o_dst[:, None, None] + o_b[None, :, :]
    tl.store(p_b, b_bytes, mask=m_r[:, None, None] & m_b[None, :, :])

    # the fp16 norm, little-endian, right after the indices
    o_n = tl.arange(0, 2)
    b_n16 = b_norm.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)  # [BR]
    b_nbytes = ((b_n16[:, None] >> (o_n * 8).to(tl.uint32)[None, :]) & 0xFF).to(tl.uint8)  # [BR, 2]
    p_n = cache_ptr + o_dst[:, None] + INDEX_BYTES + o_n[None, :]
    tl.store(p_n, b_nbytes, mask=m_r[:, None])

    if CHECK:
        m_bad = m_r & ~(b_norm < float("inf"))  # NaN or Inf
        m_big = m_r & (b_norm > 65504.0) & (b_norm < float("inf"))
        b_flags = tl.max(m_bad.to(tl.int32), axis=0) * FLAG_NONFINITE | tl.max(m_big.to(tl.int32), axis=0) * FLAG_OVERFLOW
        tl.atomic_or(status_ptr, b_flags, mask=b_flags != 0)  # one atomic per program, only on error


@triton.jit
def _store_mse_kernel(
    # pointers
    key_ptr,  # fp32 [num_rows, D]: rotated keys, row = token * num_heads + head
    value_ptr,  # fp32 [num_rows, D]: rotated values
    slot_ptr,  # int32/int64 [num_tokens]
    cache_ptr,  # uint8 [num_blocks, block_size, num_heads, slot_bytes], last dim contiguous
    key_bnd_ptr,  # fp32 [2**KEY_BITS - 1]
    value_bnd_ptr,  # fp32 [2**VALUE_BITS - 1]
    status_ptr,  # int32 [1]: error flags (CHECK only)
    # sizes and strides
    num_rows,
    num_heads,
    num_slots,  # num_blocks * block_size
    block_size,
    stride_slot,
    stride_block,
    stride_pos,
    stride_head,
    # settings
    D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    KEY_BITS: tl.constexpr,
    KEY_BOUNDARIES: tl.constexpr,
    KEY_INDEX_BYTES: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    VALUE_BOUNDARIES: tl.constexpr,
    VALUE_INDEX_BYTES: tl.constexpr,
    VALUE_OFFSET: tl.constexpr,  # byte of the value code in a slot
    CHECK: tl.constexpr,
):
    i_p = tl.program_id(0).to(tl.int64)
    o_r = i_p * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BR] int64 rows
    m_r = o_r < num_rows
    o_t, o_h = o_r // num_heads, o_r % num_heads  # token, head
    b_slot = tl.load(slot_ptr + o_t * stride_slot, mask=m_r, other=-1).to(tl.int64)  # [BR]
    m_w = m_r & (b_slot >= 0) & (b_slot < num_slots)  # out-of-range slots are never written
    o_slot = (b_slot // block_size) * stride_block + (b_slot % block_size) * stride_pos + o_h * stride_head

    _encode_part(key_ptr, key_bnd_ptr, cache_ptr, status_ptr, o_r, m_w, o_slot,
                 D, BLOCK_ROWS, BLOCK_G, KEY_BITS, KEY_BOUNDARIES, KEY_INDEX_BYTES,
                 CHECK, 1, 2)  # FLAG_KEY_NONFINITE, FLAG_KEY_OVERFLOW
    _encode_part(value_ptr, value_bnd_ptr, cache_ptr, status_ptr, o_r, m_w, o_slot + VALUE_OFFSET,
                 D, BLOCK_ROWS, BLOCK_G, VALUE_BITS, VALUE_BOUNDARIES, VALUE_INDEX_BYTES,
                 CHECK, 4, 8)  # FLAG_VALUE_NONFINITE, FLAG_VALUE_OVERFLOW


@triton.jit
def _load_mse_kernel(
    # pointers
    cache_ptr,  # uint8 [num_blocks, block_size, num_heads, slot_bytes], last dim contiguous
    slot_ptr,  # int32/int64 [num_tokens]
    cent_ptr,  # fp32 [2**BITS]: centroids
    out_ptr,  # [num_rows, D] out dtype; row = token * num_heads + head
    # sizes and strides
    num_rows,
    num_heads,
    num_slots,
    block_size,
    stride_slot,
    stride_block,
    stride_pos,
    stride_head,
    # settings
    D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BITS: tl.constexpr,
    INDEX_BYTES: tl.constexpr,
    OFFSET: tl.constexpr,  # byte of this part's code (key or value) in a slot
    NORM_CORRECTION: tl.constexpr,
    BF16_BY_BITS: tl.constexpr,  # round fp32 -> bf16 with integer ops (interpreter only)
):
    i_p = tl.program_id(0).to(tl.int64)
    o_r = i_p * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BR] int64 rows
    m_r = o_r < num_rows
    o_t, o_h = o_r // num_heads, o_r % num_heads
    b_slot = tl.load(slot_ptr + o_t * stride_slot, mask=m_r, other=-1).to(tl.int64)  # [BR]
    m_s = m_r & (b_slot >= 0) & (b_slot < num_slots)  # rows read from the cache; the others are 0
    o_src = (b_slot // block_size) * stride_block + (b_slot % block_size) * stride_pos + o_h * stride_head + OFFSET

    o_g = tl.arange(0, BLOCK_G)
    o_k = tl.arange(0, 8)
    o_j = tl.arange(0, 4)
    o_d = o_g[:, None] * 8 + o_k[None, :]  # [BG, 8] element index d = 8 g + k
    m_d = o_d < D

    # bytes [BITS g, BITS g + BITS) of the code are the word of group g
    o_b = o_g[:, None] * BITS + o_j[None, :]  # [BG, 4]
    m_b = (o_j[None, :] < BITS) & (o_b < INDEX_BYTES)
    p_b = cache_ptr + o_src[:, None, None] + o_b[None, :, :]
    b_bytes = tl.load(p_b, mask=m_s[:, None, None] & m_b[None, :, :], other=0).to(tl.uint32)  # [BR, BG, 4]
    b_word = tl.sum(b_bytes << (o_j * 8).to(tl.uint32)[None, None, :], axis=2)  # [BR, BG]
    b_idx = (b_word[:, :, None] >> (o_k * BITS).to(tl.uint32)[None, None, :]) & ((1 << BITS) - 1)  # [BR, BG, 8]

    b_c = tl.load(cent_ptr + b_idx)  # [BR, BG, 8] fp32, gathered from a table of 2**BITS
    b_c = tl.where(m_d[None, :, :], b_c, 0.0)

    # the fp16 norm, little-endian (widen to uint16 before shifting)
    p_n = cache_ptr + o_src + INDEX_BYTES
    b_lo = tl.load(p_n, mask=m_s, other=0).to(tl.uint16)
    b_hi = tl.load(p_n + 1, mask=m_s, other=0).to(tl.uint16)
    b_norm = (b_lo | (b_hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)  # [BR]

    if NORM_CORRECTION:
        # renormalise the centroid vector; one scale per row instead of a division per element
        b_energy = tl.sum(tl.sum(b_c * b_c, axis=2), axis=1)  # [BR]
        b_scale = b_norm / tl.maximum(tl.sqrt_rn(b_energy), 1e-12)
    else:
        b_scale = b_norm
    b_out = tl.where(m_s[:, None, None], b_c * b_scale[:, None, None], 0.0)  # [BR, BG, 8]

    if BF16_BY_BITS:
        # round to nearest even by hand: Triton 3.6's interpreter truncates fp32 -> bf16 (the GPU
        # conversion already rounds to nearest even); finite values only
        b_bits = b_out.to(tl.uint32, bitcast=True)
        b_bits = (b_bits + 0x7FFF + ((b_bits >> 16) & 1)) >> 16
        b_out = b_bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    p_out = out_ptr + o_r[:, None, None] * D + o_d[None, :, :]
    tl.store(p_out, b_out.to(out_ptr.dtype.element_ty), mask=m_r[:, None, None] & m_d[None, :, :])


# ----------------------------------------------------------------------------- launchers


_TABLES = weakref.WeakKeyDictionary()  # codec -> {device: (sources, (R, boundaries, centroids))}


def _device_tables(codec, device: torch.device):
    """``(rotation, boundaries, centroids)`` of ``codec`` as fp32 on ``device``, copied once per device."""
    sources = (codec.rotation, codec.boundaries, codec.centroids)
    try:
        per_device = _TABLES.setdefault(codec, {})
    except TypeError:  # not weak-referenceable: copy every call
        per_device = {}
    hit = per_device.get(device)
    if hit is not None and all(a is b for a, b in zip(hit[0], sources)):
        return hit[1]
    tables = tuple(t.to(device=device, dtype=torch.float32).contiguous() for t in sources)
    per_device[device] = (sources, tables)
    return tables


def _check_codec(name: str, codec) -> None:
    for attr in ("dim", "bits", "rotation", "boundaries", "centroids", "norm_correction"):
        if not hasattr(codec, attr):
            raise TypeError(f"{name} must be an MSE codec (e.g. kvlab.MSECodec) with .{attr}, got {type(codec).__name__}")
    C.check_int(f"{name}.bits", codec.bits, MSE_BITS)
    C.check_int(f"{name}.dim", codec.dim, minimum=3)
    dim, levels = codec.dim, 1 << codec.bits
    for attr, shape in (("rotation", (dim, dim)), ("boundaries", (levels - 1,)), ("centroids", (levels,))):
        t = getattr(codec, attr)
        C.check_tensor(f"{name}.{attr}", t, C.FLOAT_DTYPES)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}.{attr} must have shape {shape} for dim={dim}, bits={codec.bits}, got {tuple(t.shape)}")


def _check_cache(cache) -> None:
    C.check_tensor("cache", cache, (torch.uint8,))
    if cache.dim() != 4:
        raise ValueError(f"cache must have shape [num_blocks, block_size, num_heads, slot_bytes], got {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError(f"cache must be contiguous in its last (byte) dimension, got strides {cache.stride()}")


def _check_slot_mapping(slot_mapping, num_tokens: int, num_slots: int, device, check: bool) -> None:
    if check:  # includes the value range: one host sync
        C.check_slot_mapping(slot_mapping, num_tokens, num_slots, device)
        return
    C.check_tensor("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must have shape ({num_tokens},) (one slot per token), got {tuple(slot_mapping.shape)}")
    if slot_mapping.device != device:
        raise ValueError(f"slot_mapping must be on {device}, got {slot_mapping.device}")


def _check_tiling(block_rows, num_warps) -> None:
    C.check_int("block_rows", block_rows, minimum=1)
    if block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    C.check_int("num_warps", num_warps, (1, 2, 4, 8, 16, 32))


def _block_g(dim: int) -> int:
    return triton.next_power_of_2(triton.cdiv(dim, GROUP))


def _default_block_rows(dim: int) -> int:
    return max(1, min(256, TILE_ELEMENTS // (GROUP * _block_g(dim))))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _on(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def store_mse(
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: torch.Tensor,
    key_codec,
    value_codec,
    *,
    check: bool = True,
    block_rows: int | None = None,
    num_warps: int = 4,
) -> None:
    """Encode ``key`` and ``value`` ``[num_tokens, num_heads, dim]`` into ``cache`` (in place).

    ``cache`` is uint8 ``[num_blocks, block_size, num_heads, MSESlot(dim, key_bits, value_bits).slot_bytes]``
    (contiguous in its last dimension; other strides are free); token ``i`` goes to slot
    ``slot_mapping[i]``, ``-1`` skips it. The bytes equal ``write_slots(cache, slot_mapping,
    key_codec.encode(key), value_codec.encode(value), layout)``.

    ``check=True`` (default) also checks values, with one host sync: slots in ``[-1, num_slots)``,
    and no NaN/Inf or norm above 65504 in the written rows of ``key``/``value`` (ValueError, raised
    after the launch: the call's slots are then written). Rows with slot -1 are not checked.
    ``check=False`` skips those checks and never syncs; out-of-range slots are then skipped silently.
    ``block_rows`` (a power of two; default ~2048 elements per tile) and ``num_warps`` tune the launch.
    """
    _check_codec("key_codec", key_codec)
    _check_codec("value_codec", value_codec)
    C.check_tensor("key", key, C.FLOAT_DTYPES)
    C.check_tensor("value", value, C.FLOAT_DTYPES)
    if key.dim() != 3:
        raise ValueError(f"key must have shape [num_tokens, num_heads, dim], got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value must have the shape of key {tuple(key.shape)}, got {tuple(value.shape)}")
    num_tokens, num_heads, dim = key.shape
    for name, codec in (("key_codec", key_codec), ("value_codec", value_codec)):
        if codec.dim != dim:
            raise ValueError(f"{name}.dim ({codec.dim}) must equal key's last dimension ({dim})")
    _check_cache(cache)
    layout = MSESlot(dim, key_codec.bits, value_codec.bits)
    num_blocks, block_size, cache_heads, slot_bytes = cache.shape
    if (cache_heads, slot_bytes) != (num_heads, layout.slot_bytes):
        raise ValueError(
            f"cache must have shape [num_blocks, block_size, {num_heads}, {layout.slot_bytes}] for {layout}, "
            f"got {tuple(cache.shape)}"
        )
    C.check_tensor("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    C.check_same_device(cache=cache, key=key, value=value, slot_mapping=slot_mapping)
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    num_slots = num_blocks * block_size
    _check_slot_mapping(slot_mapping, num_tokens, num_slots, cache.device, check)
    block_rows = _default_block_rows(dim) if block_rows is None else block_rows
    _check_tiling(block_rows, num_warps)
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return

    device = cache.device
    key_rot, key_bnd, _ = _device_tables(key_codec, device)
    value_rot, value_bnd, _ = _device_tables(value_codec, device)
    # the reference's rotation, as one GEMM per tensor: [num_rows, dim] fp32, contiguous
    y_key = key.reshape(num_rows, dim).float() @ key_rot
    y_value = value.reshape(num_rows, dim).float() @ value_rot
    status = torch.zeros(1, dtype=torch.int32, device=device) if check else y_key  # unused when not checking

    grid = (triton.cdiv(num_rows, block_rows),)
    with _on(device):
        _store_mse_kernel[grid](
            y_key, y_value, slot_mapping, cache, key_bnd, value_bnd, status,
            num_rows, num_heads, num_slots, block_size,
            slot_mapping.stride(0), cache.stride(0), cache.stride(1), cache.stride(2),
            D=dim,
            BLOCK_ROWS=block_rows,
            BLOCK_G=_block_g(dim),
            KEY_BITS=key_codec.bits,
            KEY_BOUNDARIES=(1 << key_codec.bits) - 1,
            KEY_INDEX_BYTES=layout.key_bytes,
            VALUE_BITS=value_codec.bits,
            VALUE_BOUNDARIES=(1 << value_codec.bits) - 1,
            VALUE_INDEX_BYTES=layout.value_bytes,
            VALUE_OFFSET=layout.value_offset,
            CHECK=check,
            num_warps=num_warps,
        )
    if check:
        flags = int(status.item())
        for name, nonfinite, overflow in (("key", FLAG_KEY_NONFINITE, FLAG_KEY_OVERFLOW),
                                          ("value", FLAG_VALUE_NONFINITE, FLAG_VALUE_OVERFLOW)):
            if flags & nonfinite:
                raise ValueError(f"{name} holds NaN or Inf values (or vectors whose norm overflows fp32); "
                                 "only finite values can be encoded")
            if flags & overflow:
                raise ValueError(f"{name} has vectors with norm above {C.FP16_MAX:g}; the norm is stored in fp16")


def _part_layout(codec, part: str, slot_bytes: int):
    """``(offset, index_bytes)`` of ``part``'s code in a slot; the other part's size comes from ``slot_bytes``."""
    code_bytes = packed_bytes(codec.dim, codec.bits) + NORM_BYTES
    other = slot_bytes - code_bytes
    if other not in {packed_bytes(codec.dim, b) + NORM_BYTES for b in MSE_BITS}:
        raise ValueError(
            f"cache's slot_bytes ({slot_bytes}) does not fit a {part} code of {code_bytes} bytes "
            f"(dim={codec.dim}, bits={codec.bits}) plus a code of 2, 3 or 4 bits"
        )
    offset = 0 if part == "key" else other
    return offset, code_bytes - NORM_BYTES


def load_mse(
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    codec,
    part: str = "key",
    space: str = "rotated",
    out_dtype: torch.dtype = torch.float16,
    *,
    check: bool = True,
    block_rows: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Decode the ``part`` ("key" or "value") codes of ``slot_mapping``'s slots: ``[num_tokens, num_heads, dim]``.

    Equals ``codec.decode(codes, space)`` of the codes ``read_slots`` returns, cast to ``out_dtype``
    (``space="rotated"``: ``y = x @ R`` coordinates, for attention in rotated space; ``"model"``:
    the rotated result, in fp32, times ``R.T`` in one batched GEMM, then cast). Rows whose slot is
    ``-1`` (or, with ``check=False``, out of range) come out as zeros. The other part's bit width is
    inferred from the cache's ``slot_bytes``. ``check=True`` (default) checks the slot range with
    one host sync; ``check=False`` does not sync.
    """
    _check_codec("codec", codec)
    C.check_choice("part", part, ("key", "value"))
    C.check_choice("space", space, ("rotated", "model"))
    if out_dtype not in C.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of (float16, bfloat16, float32), got {out_dtype}")
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    _check_cache(cache)
    num_blocks, block_size, num_heads, slot_bytes = cache.shape
    offset, index_bytes = _part_layout(codec, part, slot_bytes)
    C.check_tensor("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D [num_tokens], got shape {tuple(slot_mapping.shape)}")
    num_tokens = slot_mapping.shape[0]
    _check_slot_mapping(slot_mapping, num_tokens, num_blocks * block_size, cache.device, check)
    block_rows = _default_block_rows(codec.dim) if block_rows is None else block_rows
    _check_tiling(block_rows, num_warps)

    device, dim, num_rows = cache.device, codec.dim, num_tokens * num_heads
    rot, _, cent = _device_tables(codec, device)
    out = torch.empty(num_rows, dim, dtype=out_dtype if space == "rotated" else torch.float32, device=device)
    if num_rows:
        grid = (triton.cdiv(num_rows, block_rows),)
        with _on(device):
            _load_mse_kernel[grid](
                cache, slot_mapping, cent, out,
                num_rows, num_heads, num_blocks * block_size, block_size,
                slot_mapping.stride(0), cache.stride(0), cache.stride(1), cache.stride(2),
                D=dim,
                BLOCK_ROWS=block_rows,
                BLOCK_G=_block_g(dim),
                BITS=codec.bits,
                INDEX_BYTES=index_bytes,
                OFFSET=offset,
                NORM_CORRECTION=bool(codec.norm_correction),
                BF16_BY_BITS=out.dtype == torch.bfloat16 and _interpreted(),
                num_warps=num_warps,
            )
    if space == "model":
        out = (out @ rot.T).to(out_dtype)  # the reference's inverse rotation, one GEMM for all rows
    return out.view(num_tokens, num_heads, dim)


def unpack_values_rotated(cache, slot_mapping, value_codec, **kwargs) -> torch.Tensor:
    """Value vectors in rotated space, ``[num_tokens, num_heads, dim]`` (``load_mse(part="value")``)."""
    return load_mse(cache, slot_mapping, value_codec, part="value", space="rotated", **kwargs)


def unpack_values_model_space(cache, slot_mapping, value_codec, **kwargs) -> torch.Tensor:
    """Value vectors in model space: the rotated ones times ``R.T`` in one batched GEMM."""
    return load_mse(cache, slot_mapping, value_codec, part="value", space="model", **kwargs)
