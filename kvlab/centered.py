"""Triton path of the centred MSE key codec in the paged KV cache: ``store_centered_mse``, ``load_centered_mse``.

What
    ``store_centered_mse`` writes keys with the centred MSE codec and values with the MSE codec into the
    slots of ``slot_mapping``. One kernel, launched once per part, does everything for a row: load it,
    normalise it (keys: ``z = (k - mean[h]) * inv_scale[h]``, the reference's two fp32 roundings; values
    as they are), rotate it (Hadamard codecs: ``fwht(z * signs) * scale`` with the reference's
    butterflies in the reference's order; Haar codecs: the launcher normalises and multiplies by ``R``
    with torch first, as the reference does, and the kernel starts from the rotated rows), take the norm
    (fp64 sum of exact squares, rounded to fp32), divide by it (correctly rounded), count the Lloyd-Max
    boundaries below each coordinate (``torch.bucketize``), pack the indices and write them with the
    fp16 norm into the slot. The bytes equal the reference's exactly.

    ``load_centered_mse`` decodes the key part with the MSE load kernel (``kvlab.mse.load_mse``) and maps
    it back: ``z_hat * scale[h]`` (space ``"centered"``, what attention needs: see below) plus
    ``mean[h]`` (space ``"model"``, the key).

Tiling
    A program stores ``BLOCK_ROWS`` rows (token, head) as one ``[BLOCK_ROWS, BLOCK_D]`` fp32 tile; the
    butterflies are those of ``kvlab.mse`` (``_fwht``), the packed code goes out byte by byte (``bits``
    byte stores of a group word per 8 indices, then the 2 norm bytes). Simpler than the MSE store
    kernel (one row per thread, 4-byte word stores) and not tuned: a store writes one token per
    sequence and step in decoding, which attention reading the whole cache dwarfs.

Layout (``kvlab.layout``)
    The slot of the MSE codec, unchanged: uint8 ``[num_blocks, block_size, num_heads, slot_bytes]``, one
    slot of one head ``key indices | key norm (fp16) | value indices | value norm (fp16)``; the key
    code is ``MSECodec.encode(z)``. The codec's ``mean``, ``scale`` and ``inv_scale`` (fp32 ``[num_heads,
    dim]``) are per-layer constants; with ``rope`` the launcher expands the mean to the tokens'
    positions (``codec.mean_rows``, float64 on the CPU) and the kernel reads one row per token.

Attention over the codes
    ``q . k_hat = q . (scale * z_hat) + q . m_n``, ``m_n`` the mean at the token's position ``n``. A
    decode kernel scores the query ``(q * scale[h]) @ R`` (per KV head, once per step) against the
    rotated codes, exactly as for the plain MSE codec. With a constant mean (no ``rope``) the second
    term is the same for every token, so the softmax drops it and the kernel never reads the mean (as
    long as every key it attends to is centred: tokens kept unquantized must be centred too, or get
    ``q . mean`` added back). With ``rope`` the mean is ``RoPE_n(mean)`` and the kernel adds
    ``q . RoPE_n(mean) = sum_j a_j cos(n w_j) + b_j sin(n w_j)`` per token, ``a_j, b_j`` from the query
    and the mean (once per step and head), ``cos``/``sin`` from a per-position table shared by all
    heads and layers: one more 64-term dot product per token.

Reference
    ``kvlab.centered_reference.CenteredMSECodec`` with ``kvlab.reference.write_slots`` / ``read_slots``;
    this module does not import it (``tests/test_centered.py`` compares the two: equal cache bytes,
    decoded keys to 1e-6 relative like ``load_mse``).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import _checks as C
from .layout import MSESlot
from .mse import _fwht, load_mse

__all__ = ["load_centered_mse", "store_centered_mse"]

MSE_BITS = (2, 3, 4)
FLAG_NONFINITE, FLAG_OVERFLOW = 1, 2  # error flags raised by the store kernel when CHECK is on


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _store_part_kernel(
    # pointers
    x_ptr,  # rows [num_rows, D]: the input (HADAMARD) or the rotated rows (fp32)
    mean_ptr,  # fp32 [NUM_HEADS, D], or [num_rows, D] (MEAN_PER_ROW): subtracted first (NORMALIZE)
    inv_scale_ptr,  # fp32 [NUM_HEADS, D]: then multiplied (NORMALIZE)
    sign_ptr,  # fp32 [D]: the Hadamard rotation's signs +-1 (HADAMARD)
    boundary_ptr,  # fp32 [2**BITS - 1]: Lloyd-Max boundaries, ascending
    slot_ptr,  # int32/int64 [num_tokens]
    cache_ptr,  # uint8 [num_blocks, BLOCK_SIZE, NUM_HEADS, slot_bytes], last dim contiguous
    status_ptr,  # int32 [1]: error flags (CHECK)
    # scalars, sizes and strides
    scale,  # fp32 1 / sqrt(D) (HADAMARD)
    stride_x,
    num_rows,
    num_slots,
    offset,  # byte of this part's code in a slot
    stride_slot,
    stride_block,
    stride_pos,
    stride_head,
    # settings
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,  # a power of two >= D (a multiple of 8)
    LOG_D: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BITS: tl.constexpr,
    INDEX_BYTES: tl.constexpr,
    NORMALIZE: tl.constexpr,
    MEAN_PER_ROW: tl.constexpr,  # the mean turns with the position (RoPE): one row of means per row
    HADAMARD: tl.constexpr,
    CHECK: tl.constexpr,
):
    i_p = tl.program_id(0).to(tl.int64)
    o_r = i_p * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BR] rows (token * NUM_HEADS + head)
    m_r = o_r < num_rows
    o_t, o_h = o_r // NUM_HEADS, o_r % NUM_HEADS
    b_slot = tl.load(slot_ptr + o_t * stride_slot, mask=m_r, other=-1).to(tl.int64)
    m_w = m_r & (b_slot >= 0) & (b_slot < num_slots)  # out-of-range slots are never written
    o_dst = (b_slot // BLOCK_SIZE) * stride_block + (b_slot % BLOCK_SIZE) * stride_pos + o_h * stride_head + offset

    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_x = m_w[:, None] & m_d[None, :]
    b_x = tl.load(x_ptr + o_r[:, None] * stride_x + o_d[None, :], mask=m_x, other=0.0).to(tl.float32)  # [BR, BD]
    if NORMALIZE:
        o_hd = o_h[:, None] * D + o_d[None, :]
        o_md = o_r[:, None] * D + o_d[None, :] if MEAN_PER_ROW else o_hd
        b_x = (b_x - tl.load(mean_ptr + o_md, mask=m_x, other=0.0)) * tl.load(inv_scale_ptr + o_hd, mask=m_x, other=0.0)
    if HADAMARD:  # x @ R = fwht(x * signs) * scale, the reference's butterflies
        b_x = b_x * tl.load(sign_ptr + o_d, mask=m_d, other=0.0)[None, :]
        b_x = tl.reshape(_fwht(tl.reshape(b_x, [1, BLOCK_ROWS, BLOCK_D]), 1, BLOCK_ROWS, BLOCK_D, LOG_D),
                         [BLOCK_ROWS, BLOCK_D]) * scale

    # norm: fp64 sum of exact squares, sqrt in fp64, rounded once to fp32 (as the reference)
    b_x64 = b_x.to(tl.float64)
    b_norm = tl.sqrt(tl.sum(b_x64 * b_x64, axis=1)).to(tl.float32)  # [BR]
    b_unit = tl.math.div_rn(b_x, tl.where(b_norm > 0, b_norm, 1.0)[:, None])

    # index = number of boundaries strictly below the coordinate (torch.bucketize); padding: 0
    b_idx = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.uint32)
    for i in tl.static_range((1 << BITS) - 1):
        b_idx += (b_unit > tl.load(boundary_ptr + i)).to(tl.uint32)
    b_idx = tl.where(m_d[None, :], b_idx, 0)

    # pack: the 8 indices of group g (BITS bytes) form one word, index k at bit BITS * k
    G: tl.constexpr = BLOCK_D // 8
    o_k = tl.arange(0, 8)
    b_word = tl.sum(tl.reshape(b_idx, [BLOCK_ROWS, G, 8]) << (o_k * BITS).to(tl.uint32)[None, None, :], axis=2)  # [BR, G]
    o_g = tl.arange(0, G)
    for j in tl.static_range(BITS):
        o_byte = o_g * BITS + j
        tl.store(cache_ptr + o_dst[:, None] + o_byte[None, :], ((b_word >> (8 * j)) & 0xFF).to(tl.uint8),
                 mask=m_w[:, None] & (o_byte < INDEX_BYTES)[None, :])
    b_n16 = b_norm.to(tl.float16).to(tl.uint16, bitcast=True)  # little-endian fp16 after the indices
    tl.store(cache_ptr + o_dst + INDEX_BYTES, (b_n16 & 0xFF).to(tl.uint8), mask=m_w)
    tl.store(cache_ptr + o_dst + INDEX_BYTES + 1, (b_n16 >> 8).to(tl.uint8), mask=m_w)

    if CHECK:
        m_bad = m_w & ~(b_norm < float("inf"))  # NaN or Inf
        m_big = m_w & (b_norm > 65504.0) & (b_norm < float("inf"))
        b_flags = tl.max(m_bad.to(tl.int32), axis=0) * 1 | tl.max(m_big.to(tl.int32), axis=0) * 2
        tl.atomic_or(status_ptr, b_flags, mask=b_flags != 0)


# ----------------------------------------------------------------------------- launchers


def _check_centered_codec(name: str, codec) -> None:
    for attr in ("mse", "mean", "scale", "inv_scale", "num_heads", "dim", "rope", "mean_rows"):
        if not hasattr(codec, attr):
            raise TypeError(f"{name} must be a centred MSE codec (kvlab.centered_reference.CenteredMSECodec) with .{attr}, "
                            f"got {type(codec).__name__}")
    shape = (codec.num_heads, codec.dim)
    for attr in ("mean", "scale", "inv_scale"):
        t = getattr(codec, attr)
        C.check_tensor(f"{name}.{attr}", t, (torch.float32,))
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}.{attr} must have shape {shape}, got {tuple(t.shape)}")


def _table(codec, attr: str, device) -> torch.Tensor:
    return getattr(codec, attr).to(device)


def _check_mse_codec(name: str, codec) -> None:
    for attr in ("dim", "bits", "rotation", "boundaries", "hadamard_signs", "hadamard_scale"):
        if not hasattr(codec, attr):
            raise TypeError(f"{name} must be an MSE codec (kvlab.MSECodec) with .{attr}, got {type(codec).__name__}")
    C.check_int(f"{name}.bits", codec.bits, MSE_BITS)
    levels = 1 << codec.bits
    C.check_tensor(f"{name}.boundaries", codec.boundaries, C.FLOAT_DTYPES)
    if tuple(codec.boundaries.shape) != (levels - 1,):
        raise ValueError(f"{name}.boundaries must have shape ({levels - 1},), got {tuple(codec.boundaries.shape)}")


def _on(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _mean_rows(codec, positions, num_tokens: int, device) -> torch.Tensor:
    """The codec's mean: ``[num_heads, dim]``, or ``[num_tokens, num_heads, dim]`` at ``positions`` (``rope``)."""
    if codec.rope is None:
        return _table(codec, "mean", device)
    C.check_tensor("positions", positions, (torch.int32, torch.int64))
    if tuple(positions.shape) != (num_tokens,):
        raise ValueError(f"positions must have shape ({num_tokens},) (one position per token), got {tuple(positions.shape)}")
    return codec.mean_rows(positions.cpu(), (num_tokens,)).to(device).contiguous()


def store_centered_mse(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor,
                       key_codec, value_codec, *, positions: torch.Tensor | None = None, check: bool = True,
                       block_rows: int | None = None, num_warps: int = 4) -> None:
    """Encode ``key`` (centred MSE) and ``value`` (MSE) ``[num_tokens, num_heads, dim]`` into ``cache`` (in place).

    ``cache`` is uint8 ``[num_blocks, block_size, num_heads, MSESlot(dim, key_bits, value_bits).slot_bytes]``,
    contiguous in its last dimension; token ``i`` goes to slot ``slot_mapping[i]``, ``-1`` skips it. The
    bytes equal ``write_slots(cache, slot_mapping, key_codec.encode(key, positions),
    value_codec.encode(value), layout)``; ``positions`` (int ``[num_tokens]``) is needed when the codec's
    mean turns with the position (``key_codec.rope``). ``check=True`` (default) checks the slot range
    and, after the launch, raises ValueError for NaN/Inf inputs or norms above 65504 (one host sync;
    the call's slots are then written).
    ``block_rows`` (a power of two, default 16) and ``num_warps`` tune the launch.
    """
    _check_centered_codec("key_codec", key_codec)
    _check_mse_codec("key_codec.mse", key_codec.mse)
    _check_mse_codec("value_codec", value_codec)
    C.check_tensor("key", key, C.FLOAT_DTYPES)
    C.check_tensor("value", value, C.FLOAT_DTYPES)
    if key.dim() != 3 or tuple(key.shape[1:]) != (key_codec.num_heads, key_codec.dim):
        raise ValueError(f"key must have shape [num_tokens, {key_codec.num_heads}, {key_codec.dim}] for key_codec, "
                         f"got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value must have the shape of key {tuple(key.shape)}, got {tuple(value.shape)}")
    num_tokens, num_heads, dim = key.shape
    if value_codec.dim != dim:
        raise ValueError(f"value_codec.dim ({value_codec.dim}) must equal key's last dimension ({dim})")
    C.check_tensor("cache", cache, (torch.uint8,))
    layout = MSESlot(dim, key_codec.bits, value_codec.bits)
    if cache.dim() != 4 or tuple(cache.shape[2:]) != (num_heads, layout.slot_bytes) or cache.stride(-1) != 1:
        raise ValueError(f"cache must be [num_blocks, block_size, {num_heads}, {layout.slot_bytes}] for {layout}, "
                         f"contiguous in its last dimension, got shape {tuple(cache.shape)}")
    C.check_same_device(cache=cache, key=key, value=value, slot_mapping=slot_mapping)
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    num_blocks, block_size = cache.shape[:2]
    num_slots = num_blocks * block_size
    C.check_slot_mapping(slot_mapping, num_tokens, num_slots, cache.device, values=check)
    block_rows = 16 if block_rows is None else block_rows
    C.check_int("block_rows", block_rows, minimum=1)
    if block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    C.check_int("num_warps", num_warps, (1, 2, 4, 8, 16, 32))
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return

    device = cache.device
    key_mean = _mean_rows(key_codec, positions, num_tokens, device)
    block_d = max(8, triton.next_power_of_2(dim))
    status = torch.zeros(2, dtype=torch.int32, device=device)  # error flags of the key and the value launch
    parts = ((key, key_codec.mse, key_codec, 0, layout.key_bytes),
             (value, value_codec, None, layout.value_offset, layout.value_bytes))
    with _on(device):
        for part, (x, mse, centered, offset, index_bytes) in enumerate(parts):
            hadamard = mse.hadamard_signs is not None
            if centered is not None:
                mean, inv_scale = key_mean, _table(centered, "inv_scale", device)
            else:
                mean = inv_scale = status  # unused
            if hadamard:  # fused: the kernel normalises and rotates the input rows
                rows = x.reshape(num_rows, dim)
                rows = rows if rows.stride(1) == 1 else rows.contiguous()
                signs = mse.hadamard_signs.to(device=device, dtype=torch.float32)
                scale = float(mse.hadamard_scale)
            else:  # the reference's normalisation and rotation (one torch GEMM), then the kernel
                z = x.float() if centered is None else (x.float() - mean) * inv_scale
                rows = z.reshape(num_rows, dim) @ mse.rotation.to(device=device, dtype=torch.float32)
                signs, scale = status, 1.0  # unused
            _store_part_kernel[(triton.cdiv(num_rows, block_rows),)](
                rows, mean, inv_scale, signs, mse.boundaries.to(device=device, dtype=torch.float32),
                slot_mapping, cache, status[part:],
                scale, rows.stride(0), num_rows, num_slots, offset,
                slot_mapping.stride(0), cache.stride(0), cache.stride(1), cache.stride(2),
                D=dim,
                BLOCK_D=block_d,
                LOG_D=dim.bit_length() - 1,
                NUM_HEADS=num_heads,
                BLOCK_SIZE=block_size,
                BLOCK_ROWS=block_rows,
                BITS=mse.bits,
                INDEX_BYTES=index_bytes,
                NORMALIZE=hadamard and centered is not None,
                MEAN_PER_ROW=centered is not None and centered.rope is not None,
                HADAMARD=hadamard,
                CHECK=check,
                num_warps=num_warps,
                enable_fp_fusion=False,
            )
    if check:
        for name, flags in zip(("key", "value"), status.tolist()):
            if flags & FLAG_NONFINITE:
                raise ValueError(f"{name} holds NaN or Inf values; only finite values can be encoded")
            if flags & FLAG_OVERFLOW:
                raise ValueError(f"{name} has (normalised) vectors with norm above 65504; the norm is stored in fp16")


def load_centered_mse(cache: torch.Tensor, slot_mapping: torch.Tensor, codec, space: str = "model",
                      out_dtype: torch.dtype = torch.float16, *, positions: torch.Tensor | None = None,
                      **kwargs) -> torch.Tensor:
    """Decode the key codes of ``slot_mapping``'s slots: ``[num_tokens, num_heads, dim]`` in ``out_dtype``.

    ``space="model"``: the keys (``codec.decode(codes)``); ``"centered"``: the keys without their mean
    (what attention needs); ``"rotated"``: the MSE codec's rotated, normalised vectors (``load_mse``).
    Rows whose slot is -1 decode as ``0`` (``"rotated"``, ``"centered"``) or as the mean (``"model"``).
    ``positions`` (int ``[num_tokens]``): needed for ``"model"`` when the mean turns with the position
    (``codec.rope``). Other arguments as ``kvlab.mse.load_mse``.
    """
    _check_centered_codec("codec", codec)
    C.check_choice("space", space, ("model", "centered", "rotated"))
    if out_dtype not in C.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of (float16, bfloat16, float32), got {out_dtype}")
    C.check_tensor("cache", cache, (torch.uint8,))
    if cache.dim() == 4 and cache.shape[2] != codec.num_heads:
        raise ValueError(f"cache has {cache.shape[2]} heads, codec has {codec.num_heads}")
    if space == "rotated":
        return load_mse(cache, slot_mapping, codec.mse, part="key", space="rotated", out_dtype=out_dtype, **kwargs)
    z = load_mse(cache, slot_mapping, codec.mse, part="key", space="model", out_dtype=torch.float32, **kwargs)
    centered = z * _table(codec, "scale", cache.device)
    if space == "centered":
        return centered.to(out_dtype)
    return (centered + _mean_rows(codec, positions, slot_mapping.shape[0], cache.device)).to(out_dtype)
