"""One decode step of attention over paged transform-codec caches, in Triton: ``decode_attention``.

What
    ``q [B, Hq, D]`` attends over ``seq_lens[b]`` tokens of sequence ``b``, whose keys and values are rows of
    ``k_cache`` / ``v_cache`` (``[num_blocks, block_size, row_bytes]``, ``kvlab.transform.codec``) found through
    ``block_table``. The oracle is ``kvlab.transform.reference.decode_attention``.

How
    A row holds the codes of a layer's ``H`` heads (``y``, ``W = groups * dim`` numbers). Each program takes one
    sequence, one KV head ``h`` with its group of query heads, and one split of the sequence's tokens. Head ``h``
    reads only the components its keys and values depend on: those of its own groups (a transform per head or
    per several heads) or all ``W`` (one joint transform). For every tile of ``BT`` tokens it unpacks them (per
    component: two bytes, a shift, a mask, a centroid, the group's gain).

    * Keys coded after RoPE: the score needs no decoded key. ``q . k = q . (mean + y inverse) = (q inverse^T) . y
      + q . mean``: the launcher turns each query into the transformed space once (``qt``), the kernel scores
      ``qt . y``.
    * Keys coded before RoPE: the kernel decodes ``k_h = y inverse[:, h] + mean_h`` (one matrix product per
      tile), applies RoPE at the tokens' positions (with the product by the rotate-half permuted columns), and
      scores the group's queries.
    * Values are never decoded per token: ``o' = sum_t p_t y_t`` accumulates in the transformed space, and the
      launcher maps ``o'`` back once (``o = o' inverse[:, h] + mean_h``, the softmax weights summing to one).

    Splits of the context run in parallel and are combined with their log-sum-exp. Matrix products take fp16
    operands (the gains are fp16 numbers; the decoded values are within fp16's range) and accumulate in fp32.
    Compiled for sm_90 (tiles of 16 tokens, 8 warps, one stage), a program of SmolLM2's layer (3 heads of 64, one
    joint transform) or of a Llama-3-8B layer (8 heads of 128, a transform per head) needs 12 to 84 KB of shared
    memory, keys before or after RoPE (one program for all heads needed 156 KB to 1.2 MB, past the H200's 227 KB).
    Registers still spill (up to 712 bytes of stack a thread at SmolLM2's shape): the unpack's gathers are wide. A
    joint transform of 1024 components with keys before RoPE needs 594 KB and does not launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _checks as C
from . import fused
from .codec import TransformCodec

__all__ = ["decode_attention"]

BLOCK_TOKENS = 32
MIN_DOT = 16


def _unpack_tables(codec: TransformCodec, width: int, device) -> dict:
    """Per component ``c`` of the row (padded to ``width``): its first byte, shift, mask, gain byte, codebook offset."""
    cache = codec.__dict__.setdefault("_attention_tables", {})
    key = (str(device), width)
    if key in cache:
        return cache[key]
    g, d, levels = codec.groups, codec.dim, codec.codebooks.shape[-1]
    goff = torch.tensor(codec.group_offsets)
    code_bytes = torch.tensor([C.cdiv(b, 8) for b in codec.group_bits])
    offsets, bits = codec.offsets.cpu(), codec.bits.long().cpu()
    byte = torch.zeros(width, dtype=torch.int32)
    shift, mask, gain, book = (torch.zeros(width, dtype=torch.int32) for _ in range(4))
    comp = torch.arange(g * d)
    gi, ci = comp // d, comp % d
    byte[: g * d] = (goff[gi] + offsets[gi, ci] // 8).int()
    shift[: g * d] = (offsets[gi, ci] % 8).int()
    mask[: g * d] = ((1 << bits[gi, ci]) - 1).int()
    gain[: g * d] = (goff[gi] + code_bytes[gi]).int() if codec.gain else -1
    book[: g * d] = (comp * levels).int()
    t = {name: v.to(device) for name, v in (("byte", byte), ("shift", shift), ("mask", mask), ("gain", gain),
                                            ("book", book))}
    t["books"] = codec.codebooks.reshape(-1).to(device, torch.float32).contiguous()
    cache[key] = t
    return t


_ROPE_TABLES: dict = {}


def _rope_tables(rope, length: int, first_position: int, device):
    """``(cos, sin)`` float32 ``[length, D]`` at positions ``first_position ..``, kept per RoPE, length and device (no
    copy to the device on later calls, so that a call can be captured in a CUDA graph)."""
    key = (id(rope), length, first_position, str(device))
    if key not in _ROPE_TABLES:
        cos, sin = rope.tables(torch.arange(length) + first_position)  # float64 on the CPU
        _ROPE_TABLES[key] = (rope, cos.float().to(device), sin.float().to(device))
    return _ROPE_TABLES[key][1:]


@triton.jit
def _unpack_tile(cache_ptr, b_slot, m_t, ROW, byte_ptr, shift_ptr, mask_ptr, gain_ptr, book_ptr, books_ptr,
                 o_w, m_w, GAIN: tl.constexpr):
    # [BT, WP] float32: the decoded transformed vectors of a tile of rows
    b_byte = tl.load(byte_ptr + o_w, mask=m_w, other=0)
    b_shift = tl.load(shift_ptr + o_w, mask=m_w, other=0)
    b_mask = tl.load(mask_ptr + o_w, mask=m_w, other=0)
    b_book = tl.load(book_ptr + o_w, mask=m_w, other=0)
    m = m_t[:, None] & m_w[None, :]
    p_row = cache_ptr + b_slot[:, None] * ROW
    b_lo = tl.load(p_row + b_byte[None, :], mask=m & (b_byte < ROW)[None, :], other=0).to(tl.int32)
    b_hi = tl.load(p_row + b_byte[None, :] + 1, mask=m & (b_byte + 1 < ROW)[None, :], other=0).to(tl.int32)
    b_code = ((b_lo | (b_hi << 8)) >> b_shift[None, :]) & b_mask[None, :]
    b_y = tl.load(books_ptr + b_book[None, :] + b_code, mask=m, other=0.0)
    if GAIN:
        b_gpos = tl.load(gain_ptr + o_w, mask=m_w, other=0)
        b_h = tl.load(p_row + b_gpos[None, :], mask=m, other=0).to(tl.int32) | \
            (tl.load(p_row + b_gpos[None, :] + 1, mask=m, other=0).to(tl.int32) << 8)
        b_y = b_y * b_h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return b_y


@triton.jit
def _transform_decode_kernel(
    # caches and tables
    kc_ptr, vc_ptr, table_ptr, lens_ptr,
    kbyte_ptr, kshift_ptr, kmask_ptr, kgain_ptr, kbook_ptr, kbooks_ptr,  # [W] int32 per key component; centroids
    vbyte_ptr, vshift_ptr, vmask_ptr, vgain_ptr, vbook_ptr, vbooks_ptr,
    klo_ptr, vlo_ptr,  # [H] int32: the first key / value component each KV head depends on
    # queries: after RoPE, qt [B, H, GP, KWP] fp16 and qm [B, H, GP] (scaled); before RoPE, q [B, H, GP, D] fp16
    qt_ptr, qm_ptr, q_ptr,
    # keys before RoPE: inverse rows per head [H, KWP, D] fp16 (and rotate-half permuted), mean [H, D] (and permuted)
    inv_ptr, invr_ptr, mean_ptr, meanr_ptr, cos_ptr, sin_ptr,  # cos, sin [max_len, D] float32
    # outputs per split: acc [B, S, H, GP, VWP], row max and sum [B, S, H, GP]
    acc_ptr, m_ptr, l_ptr,
    # sizes
    KROW, VROW, MAX_BLOCKS, NUM_BLOCKS, NSPLIT, SPLIT, scale,
    # settings
    H: tl.constexpr, D: tl.constexpr, GP: tl.constexpr, KW: tl.constexpr, KWP: tl.constexpr, VW: tl.constexpr,
    VWP: tl.constexpr, BT: tl.constexpr, PAGE: tl.constexpr, PRE_ROPE: tl.constexpr, KGAIN: tl.constexpr,
    VGAIN: tl.constexpr, STEPS: tl.constexpr,
):
    i_b, i_h, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    o_g = tl.arange(0, GP)  # [GP]: the query heads of KV head h (padded)
    o_d = tl.arange(0, D)  # [D]
    o_kw = tl.arange(0, KWP)  # [KWP]: the key components head h depends on
    o_vw = tl.arange(0, VWP)  # [VWP]: the value components
    b_kc = tl.load(klo_ptr + i_h) + o_kw  # component indices in the key row
    b_vc = tl.load(vlo_ptr + i_h) + o_vw
    m_kw, m_vw = o_kw < KW, o_vw < VW
    n = tl.minimum(tl.load(lens_ptr + i_b), MAX_BLOCKS * PAGE)  # unchecked lengths stay within the table
    start = i_s * SPLIT
    stop = tl.minimum(start + SPLIT, n)
    i_bh = i_b * H + i_h
    b_m = tl.full([GP], float("-inf"), tl.float32)
    b_l = tl.zeros([GP], tl.float32)
    b_acc = tl.zeros([GP, VWP], tl.float32)
    if PRE_ROPE:
        b_q = tl.load(q_ptr + (i_bh * GP + o_g[:, None]) * D + o_d[None, :])  # [GP, D] fp16
        p_inv = inv_ptr + (i_h * KWP + o_kw[:, None]) * D + o_d[None, :]  # [KWP, D]: read per tile (cached), not held
        p_invr = invr_ptr + (i_h * KWP + o_kw[:, None]) * D + o_d[None, :]
        b_mean = tl.load(mean_ptr + i_h * D + o_d)[None, :]  # [1, D]
        b_meanr = tl.load(meanr_ptr + i_h * D + o_d)[None, :]
    else:
        b_qt = tl.load(qt_ptr + (i_bh * GP + o_g[:, None]) * KWP + o_kw[None, :])  # [GP, KWP] fp16
        b_qm = tl.load(qm_ptr + i_bh * GP + o_g)  # [GP]
    for it in range(0, STEPS):  # a constant trip count: tiles past `stop` are masked
        o_t = start + it * BT + tl.arange(0, BT)  # [BT]
        m_t = o_t < stop
        b_blk = tl.load(table_ptr + i_b * MAX_BLOCKS + o_t // PAGE, mask=m_t, other=0).to(tl.int64)
        b_blk = tl.minimum(tl.maximum(b_blk, 0), NUM_BLOCKS - 1)  # unchecked entries stay within the caches
        b_slot = b_blk * PAGE + o_t % PAGE
        b_yk = _unpack_tile(kc_ptr, b_slot, m_t, KROW, kbyte_ptr, kshift_ptr, kmask_ptr, kgain_ptr, kbook_ptr,
                            kbooks_ptr, b_kc, m_kw, KGAIN).to(tl.float16)  # [BT, KWP]
        if PRE_ROPE:
            b_cos = tl.load(cos_ptr + o_t[:, None] * D + o_d[None, :], mask=m_t[:, None], other=0.0)  # [BT, D]
            b_sin = tl.load(sin_ptr + o_t[:, None] * D + o_d[None, :], mask=m_t[:, None], other=0.0)
            b_k = tl.dot(b_yk, tl.load(p_inv)) + b_mean  # [BT, D]: the decoded keys of head h
            b_kr = tl.dot(b_yk, tl.load(p_invr)) + b_meanr  # their rotate-half
            b_k = b_k * b_cos + b_kr * b_sin  # RoPE at the tokens' positions
            b_s = tl.dot(b_q, tl.trans(b_k.to(tl.float16))) * scale  # [GP, BT]
        else:
            b_s = tl.dot(b_qt, tl.trans(b_yk)) * scale + b_qm[:, None]  # [GP, BT]; scale: qt's fp16 unscale
        b_s = tl.where(m_t[None, :], b_s, float("-inf"))
        b_mn = tl.maximum(b_m, tl.max(b_s, 1))
        b_ref = tl.where(b_mn == float("-inf"), 0.0, b_mn)  # a tile with no token yet: nothing to weigh
        b_p = tl.exp(b_s - b_ref[:, None])
        b_alpha = tl.exp(b_m - b_ref)
        b_yv = _unpack_tile(vc_ptr, b_slot, m_t, VROW, vbyte_ptr, vshift_ptr, vmask_ptr, vgain_ptr, vbook_ptr,
                            vbooks_ptr, b_vc, m_vw, VGAIN).to(tl.float16)  # [BT, VWP]
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(tl.float16), b_yv)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_m = b_mn
    o_out = ((i_b * NSPLIT + i_s) * H + i_h) * GP + o_g  # [GP]
    tl.store(acc_ptr + o_out[:, None] * VWP + o_vw[None, :], b_acc)
    tl.store(m_ptr + o_out, b_m)
    tl.store(l_ptr + o_out, b_l)


def _head_span(codec: TransformCodec, heads: int, dim: int) -> tuple[int, torch.Tensor]:
    """``(width, first)``: the components head ``h`` depends on are ``first[h] + [0, width)`` of the row: its
    groups' when groups hold whole heads or heads whole groups, else all of them."""
    if codec.dim % dim == 0:  # a group holds one or more whole heads
        return codec.dim, torch.tensor([h * dim // codec.dim * codec.dim for h in range(heads)], dtype=torch.int32)
    if dim % codec.dim == 0:  # a head holds whole groups
        return dim, torch.tensor([h * dim for h in range(heads)], dtype=torch.int32)
    return codec.groups * codec.dim, torch.zeros(heads, dtype=torch.int32)


def _head_tables(codec: TransformCodec, heads: int, dim: int, device) -> dict:
    """Per KV head: its span of components, the inverse's rows of that span and columns of the head, its mean."""
    cache = codec.__dict__.setdefault("_head_tables", {})
    key = (str(device), heads, dim)
    if key in cache:
        return cache[key]
    width, first = _head_span(codec, heads, dim)
    padded = max(MIN_DOT, triton.next_power_of_2(width))
    full = torch.block_diag(*codec.inverse.float().cpu())  # [W, W]: y -> x, every head
    inv = torch.zeros(heads, padded, dim)  # [H, WP, D]
    for h in range(heads):
        lo = int(first[h])
        inv[h, :width] = full[lo : lo + width, h * dim : (h + 1) * dim]
    mean = codec.mean.float().cpu().reshape(heads, dim)
    t = {"width": width, "padded": padded, "first": first.to(device), "inverse": inv.to(device), "mean": mean.to(device)}
    cache[key] = t
    return t


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, key_codec: TransformCodec, value_codec: TransformCodec, *,
                     scale: float, rope=None, first_position: int = 0, splits: int | None = None,
                     check: bool = True, first: int = 0, return_lse: bool = False):
    """One decode step (module docstring): ``q [B, Hq, D]`` -> ``[B, Hq, D]`` float32.

    ``rope``: a ``kvlab.RoPE`` when the keys were coded before RoPE (token ``t`` at position ``first_position +
    t``). ``splits``: parallel splits of the context (default: enough to fill a GPU). ``check`` (one host sync):
    ``q`` finite, every ``seq_lens`` in ``[1, max_blocks * block_size]`` and the block-table entries it uses
    blocks of the caches, and ``q`` scaled by a power of two where its fp16 copy would overflow. Without it, lengths
    and entries outside the table and the caches are clamped into them: wrong input gives wrong numbers, never a
    read outside the tensors.

    Codecs in the fused layout (``kvlab.transform.fused``: ``calibrate(..., layout="fused")``) with keys after RoPE
    take that module's kernel, which also reads from token ``first`` on (tokens before it are left out) and, with
    ``return_lse``, returns the log-sum-exp of each query head's scores ``[B, Hq]`` beside the output (to merge with
    attention over tokens held elsewhere)."""
    for name, codec in (("key_codec", key_codec), ("value_codec", value_codec)):
        if not isinstance(codec, TransformCodec):
            raise TypeError(f"{name} must be a kvlab.transform.TransformCodec, got {type(codec).__name__}")
    C.check_tensor("q", q, C.FLOAT_DTYPES)
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, query heads, head_dim], got shape {tuple(q.shape)}")
    batch, q_heads, dim = q.shape
    width = key_codec.groups * key_codec.dim
    if value_codec.groups * value_codec.dim != width or width % dim:
        raise ValueError(f"the codecs code {width} and {value_codec.groups * value_codec.dim} numbers per token; "
                         f"both must be KV heads x head_dim ({dim})")
    heads = width // dim
    if q_heads % heads:
        raise ValueError(f"q has {q_heads} heads, not a multiple of the cache's {heads} KV heads")
    C.check_tensor("k_cache", k_cache, (torch.uint8,), last_dim=key_codec.row_bytes)
    C.check_tensor("v_cache", v_cache, (torch.uint8,), last_dim=value_codec.row_bytes)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 3 or not cache.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [num_blocks, block_size, row_bytes], got shape "
                             f"{tuple(cache.shape)}")
    if k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(f"k_cache and v_cache must have the same [num_blocks, block_size], got "
                         f"{list(k_cache.shape[:2])} and {list(v_cache.shape[:2])}")
    C.check_tensor("block_table", block_table, (torch.int32, torch.int64))
    C.check_tensor("seq_lens", seq_lens, (torch.int32, torch.int64))
    if block_table.dim() != 2 or block_table.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(f"block_table must be [batch, max_blocks] and seq_lens [batch] with batch = {batch}, got "
                         f"shapes {tuple(block_table.shape)} and {tuple(seq_lens.shape)}")
    C.check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens)
    C.check_kernel_device("q", q)
    scale = C.check_scale("scale", scale)
    C.check_int("first_position", first_position, minimum=0)
    if splits is not None:
        C.check_int("splits", splits, minimum=1)
    if rope is not None:
        from ..calibration import RoPE  # a small dataclass, no kernel

        if not isinstance(rope, RoPE):
            raise TypeError(f"rope must be None or a kvlab.RoPE, got {type(rope).__name__}")
        if rope.dim != dim:
            raise ValueError(f"rope rotates {rope.dim} channels, the heads have {dim}")
    C.check_bool("check", check)
    C.check_int("first", first, minimum=0)
    C.check_bool("return_lse", return_lse)
    device, page = q.device, k_cache.shape[1]
    if check and batch:
        C.check_finite("q", q)
        capacity = block_table.shape[1] * page
        if bool((seq_lens < 1).any()) or bool((seq_lens > capacity).any()):
            raise ValueError(f"seq_lens must be in [1, {capacity}] (max_blocks * block_size), got values from "
                             f"{int(seq_lens.min())} to {int(seq_lens.max())}")
        used = torch.arange(block_table.shape[1], device=device)[None, :] * page < seq_lens[:, None]
        entries = block_table[used]
        if bool((entries < 0).any()) or bool((entries >= k_cache.shape[0]).any()):
            raise ValueError(f"block_table's entries for the first seq_lens tokens must be blocks in "
                             f"[0, {k_cache.shape[0]}), got values from {int(entries.min())} to {int(entries.max())}")
    group = q_heads // heads
    is_fused = rope is None and fused.in_layout((key_codec, value_codec), heads)
    if (first or return_lse) and not is_fused:
        raise ValueError("first and return_lse are for codecs in the fused layout (calibrate(..., layout='fused')), "
                         "keys after RoPE")
    if batch == 0:
        out = torch.zeros(0, q_heads, dim, dtype=torch.float32, device=device)
        return (out, torch.zeros(0, q_heads, device=device)) if return_lse else out
    if is_fused:
        return fused.decode_attention(q, k_cache, v_cache, block_table, seq_lens, key_codec, value_codec, scale=scale,
                                      splits=splits, check=check, first=first, return_lse=return_lse)
    gp = max(MIN_DOT, triton.next_power_of_2(group))
    kt, vt = _unpack_tables(key_codec, width, device), _unpack_tables(value_codec, width, device)
    kh, vh = _head_tables(key_codec, heads, dim, device), _head_tables(value_codec, heads, dim, device)
    kwp, vwp = kh["padded"], vh["padded"]
    max_len = block_table.shape[1] * page
    block = BLOCK_TOKENS if max(kwp, vwp) < 128 else MIN_DOT  # smaller tiles of wide rows
    if splits is None:
        splits = max(1, min(C.cdiv(max_len, 256), C.cdiv(264, batch * heads)))  # ~2 programs per SM of an H200
    split_len = C.cdiv(C.cdiv(max_len, splits), block) * block
    splits = C.cdiv(max_len, split_len)
    qf = q.float().view(batch, heads, group, dim)
    dummy = torch.zeros(1, device=device)
    if rope is None:  # scores in the transformed space: qt = q inverse_h^T (scaled), qm = q . mean_h
        qt = torch.zeros(batch, heads, gp, kwp, device=device, dtype=torch.float16)
        qt32 = torch.einsum("bhgd,hwd->bhgw", qf, kh["inverse"]) * scale
        qt[:, :, :group], unscale = C.fit_fp16(qt32) if check else (qt32.half(), 1.0)  # fp16 scores stay finite
        qm = torch.zeros(batch, heads, gp, device=device)
        qm[:, :, :group] = torch.einsum("bhgd,hd->bhg", qf, kh["mean"]) * scale
        qh = inv = invr = mean = meanr = cos = sin = dummy
    else:
        qt = qm = dummy
        qh = torch.zeros(batch, heads, gp, dim, device=device, dtype=torch.float16)
        qh[:, :, :group], unscale = C.fit_fp16(qf) if check else (qf.half(), 1.0)
        unscale *= scale
        rot = lambda x: torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), -1)  # rotate-half of the head's columns
        inv, invr = kh["inverse"].half(), rot(kh["inverse"]).half()
        mean, meanr = kh["mean"], rot(kh["mean"]).contiguous()
        cos, sin = _rope_tables(rope, max_len, first_position, device)
    acc = torch.empty(batch, splits, heads, gp, vwp, device=device)
    m = torch.empty(batch, splits, heads, gp, device=device)
    lsum = torch.empty(batch, splits, heads, gp, device=device)
    _transform_decode_kernel[(batch, heads, splits)](
        k_cache, v_cache, block_table.contiguous(), seq_lens.contiguous(),
        kt["byte"], kt["shift"], kt["mask"], kt["gain"], kt["book"], kt["books"],
        vt["byte"], vt["shift"], vt["mask"], vt["gain"], vt["book"], vt["books"],
        kh["first"], vh["first"], qt, qm, qh, inv, invr, mean, meanr, cos, sin, acc, m, lsum,
        key_codec.row_bytes, value_codec.row_bytes, block_table.shape[1], k_cache.shape[0], splits, split_len, unscale,
        H=heads, D=dim, GP=gp, KW=kh["width"], KWP=kwp, VW=vh["width"], VWP=vwp, BT=block, PAGE=page,
        PRE_ROPE=rope is not None, KGAIN=key_codec.gain, VGAIN=value_codec.gain, STEPS=split_len // block,
        num_warps=8 if max(kwp, vwp) >= 128 else 4, num_stages=1)
    # combine the splits, then map the accumulated transformed values back once
    top = m.amax(1, keepdim=True)
    w = torch.where(torch.isfinite(m), torch.exp(m - top), torch.zeros_like(m))  # [B, S, H, GP]
    o = (acc * w[..., None]).sum(1) / (lsum * w).sum(1)[..., None]  # [B, H, GP, VWP]
    x = torch.einsum("bhgw,hwd->bhgd", o[:, :, :group], vh["inverse"]) + vh["mean"][:, None]  # [B, H, G, D]
    return x.reshape(batch, q_heads, dim)
