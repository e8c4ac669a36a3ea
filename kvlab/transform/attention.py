"""One decode step of attention over paged transform-codec caches, in Triton: ``decode_attention``.

What
    ``q [B, Hq, D]`` attends over ``seq_lens[b]`` tokens of sequence ``b``, whose keys and values are rows of
    ``k_cache`` / ``v_cache`` (``[num_blocks, block_size, row_bytes]``, ``kvlab.transform.codec``) found through
    ``block_table``. The oracle is ``kvlab.transform.reference.decode_attention``.

How
    A row holds the codes of a layer's ``H`` heads jointly (``y``, ``W = groups * dim`` numbers). Each program
    takes one sequence and one split of its tokens, and for every tile of ``BT`` tokens unpacks ``y`` (per
    component: two bytes, a shift, a mask, a centroid, the group's gain).

    * Keys coded after RoPE: the score needs no decoded key. ``q . k = q . (mean + y inverse) = (q inverse^T) . y
      + q . mean``: the launcher turns each query into the transformed space once (``qt [Hq, W]``), the kernel
      scores ``qt . y``.
    * Keys coded before RoPE: per head ``h`` the kernel decodes ``k_h = y inverse[:, h] + mean_h`` (one matrix
      product per tile), applies RoPE at the tokens' positions (with the product by the rotate-half
      permuted columns), and scores the group's queries.
    * Values are never decoded per token: ``o' = sum_t p_t y_t`` accumulates in the transformed space, and the
      launcher maps ``o'`` back once (``o = o' inverse + mean``, the softmax weights summing to one).

    Splits of the context run in parallel and are combined with their log-sum-exp. Matrix products take fp16
    operands (the gains are fp16 numbers; the decoded values are within fp16's range) and accumulate in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _checks as C
from .codec import TransformCodec

__all__ = ["decode_attention"]

BLOCK_TOKENS = 32
MIN_DOT = 16
MAX_WIDTH = 256  # numbers per token: one tile of the row fits the shared memory of an H200


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
    t["inverse"] = torch.block_diag(*codec.inverse).to(device, torch.float32)  # [W, W]: y -> x, every head
    t["mean"] = codec.mean.reshape(-1).to(device, torch.float32)
    cache[key] = t
    return t


def _rope_columns(kt: dict, width: int, heads: int, dim: int, wp: int, device):
    """Once per codec: each head's columns of the inverse transform [H, WP, D] (fp16), the same with RoPE's
    rotate-half applied, and the mean per head with and without it."""
    if "rope_columns" not in kt:
        cols = kt["inverse"].view(width, heads, dim).permute(1, 0, 2)  # [H, W, D]
        rot = lambda x: torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), -1)
        inv_h = torch.zeros(heads, wp, dim, device=device, dtype=torch.float16)
        invr_h = torch.zeros_like(inv_h)
        inv_h[:, :width], invr_h[:, :width] = cols.half(), rot(cols).half()
        mean_h = kt["mean"].view(heads, dim).contiguous()
        kt["rope_columns"] = (inv_h, invr_h, mean_h, rot(mean_h).contiguous())
    return kt["rope_columns"]


_ROPE_TABLES: dict = {}


def _rope_tables(rope, length: int, first_position: int, device):
    """``(cos, sin)`` float32 ``[length, D]`` at positions ``first_position ..``, kept per RoPE, length and device (no
    copy to the device on later calls, so that a call can be captured in a CUDA graph)."""
    key = (id(rope), length, first_position, str(device))
    if key not in _ROPE_TABLES:
        positions = torch.arange(length, dtype=torch.float64) + first_position
        angle = positions[:, None] * rope.inv_freq.double().cpu()
        angle = torch.cat([angle, angle], -1)
        _ROPE_TABLES[key] = (rope, (rope.scaling * angle.cos()).float().to(device),
                             (rope.scaling * angle.sin()).float().to(device))
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
    kbyte_ptr, kshift_ptr, kmask_ptr, kgain_ptr, kbook_ptr, kbooks_ptr,
    vbyte_ptr, vshift_ptr, vmask_ptr, vgain_ptr, vbook_ptr, vbooks_ptr,
    # queries: after RoPE, qt [B, HQP, WP] and qm [B, HQP] (scaled); before RoPE, qpad [B, H, HQP, D] fp16
    qt_ptr, qm_ptr, qpad_ptr,
    # keys before RoPE: inverse columns per head [H, WP, D] fp16 (and rotate-half permuted), mean [H, D] (and permuted)
    inv_ptr, invr_ptr, mean_ptr, meanr_ptr, cos_ptr, sin_ptr,
    # outputs per split: acc [B, S, HQP, WP], row max and sum [B, S, HQP]
    acc_ptr, m_ptr, l_ptr,
    # sizes
    KROW, VROW, MAX_BLOCKS, NSPLIT, SPLIT, W, scale,
    # settings
    H: tl.constexpr, D: tl.constexpr, HQP: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, PAGE: tl.constexpr,
    PRE_ROPE: tl.constexpr, KGAIN: tl.constexpr, VGAIN: tl.constexpr, STEPS: tl.constexpr, PER_HEAD: tl.constexpr,
):
    i_b, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_w = tl.arange(0, WP)
    m_w = o_w < W
    o_q = tl.arange(0, HQP)
    o_d = tl.arange(0, D)
    n = tl.load(lens_ptr + i_b)
    start = i_s * SPLIT
    stop = tl.minimum(start + SPLIT, n)
    b_m = tl.full([HQP], float("-inf"), tl.float32)
    b_l = tl.zeros([HQP], tl.float32)
    b_acc = tl.zeros([HQP, WP], tl.float32)
    if not PRE_ROPE:
        b_qt = tl.load(qt_ptr + (i_b * HQP + o_q[:, None]) * WP + o_w[None, :]).to(tl.float16)  # [HQP, WP]
        b_qm = tl.load(qm_ptr + i_b * HQP + o_q)  # [HQP]
    for it in range(0, STEPS):  # a constant trip count (the interpreter needs one): tiles past `stop` are masked
        t0 = start + it * BT
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < stop
        b_blk = tl.load(table_ptr + i_b * MAX_BLOCKS + o_t // PAGE, mask=m_t, other=0).to(tl.int64)
        b_slot = b_blk * PAGE + o_t % PAGE
        if PRE_ROPE:
            b_cos = tl.load(cos_ptr + o_t[:, None] * D + o_d[None, :], mask=m_t[:, None], other=0.0)  # [BT, D]
            b_sin = tl.load(sin_ptr + o_t[:, None] * D + o_d[None, :], mask=m_t[:, None], other=0.0)
            b_s = tl.zeros([HQP, BT], tl.float32)
            if not PER_HEAD:
                b_yk = _unpack_tile(kc_ptr, b_slot, m_t, KROW, kbyte_ptr, kshift_ptr, kmask_ptr, kgain_ptr, kbook_ptr,
                                    kbooks_ptr, o_w, m_w, KGAIN).to(tl.float16)  # [BT, WP]
            for h in tl.static_range(H):
                if PER_HEAD:  # a transform per head: only the head's own components decode its keys
                    o_wh = h * D + o_d
                    b_yh = _unpack_tile(kc_ptr, b_slot, m_t, KROW, kbyte_ptr, kshift_ptr, kmask_ptr, kgain_ptr,
                                        kbook_ptr, kbooks_ptr, o_wh, o_wh < W, KGAIN).to(tl.float16)  # [BT, D]
                    b_inv = tl.load(inv_ptr + (h * WP + o_wh[:, None]) * D + o_d[None, :])  # [D, D] fp16
                    b_invr = tl.load(invr_ptr + (h * WP + o_wh[:, None]) * D + o_d[None, :])
                    b_k = tl.dot(b_yh, b_inv) + tl.load(mean_ptr + h * D + o_d)[None, :]  # [BT, D]
                    b_kr = tl.dot(b_yh, b_invr) + tl.load(meanr_ptr + h * D + o_d)[None, :]
                else:
                    b_inv = tl.load(inv_ptr + (h * WP + o_w[:, None]) * D + o_d[None, :])  # [WP, D] fp16
                    b_invr = tl.load(invr_ptr + (h * WP + o_w[:, None]) * D + o_d[None, :])
                    b_k = tl.dot(b_yk, b_inv) + tl.load(mean_ptr + h * D + o_d)[None, :]  # [BT, D]
                    b_kr = tl.dot(b_yk, b_invr) + tl.load(meanr_ptr + h * D + o_d)[None, :]
                b_k = b_k * b_cos + b_kr * b_sin  # RoPE at the tokens' positions
                b_q = tl.load(qpad_ptr + ((i_b * H + h) * HQP + o_q[:, None]) * D + o_d[None, :])  # [HQP, D] fp16
                b_s += tl.dot(b_q, tl.trans(b_k.to(tl.float16)))
            b_s = b_s * scale
        else:
            b_yk = _unpack_tile(kc_ptr, b_slot, m_t, KROW, kbyte_ptr, kshift_ptr, kmask_ptr, kgain_ptr, kbook_ptr,
                                kbooks_ptr, o_w, m_w, KGAIN).to(tl.float16)  # [BT, WP]
            b_s = tl.dot(b_qt, tl.trans(b_yk)) + b_qm[:, None]  # [HQP, BT], scale folded in
        b_s = tl.where(m_t[None, :], b_s, float("-inf"))
        b_mn = tl.maximum(b_m, tl.max(b_s, 1))
        b_ref = tl.where(b_mn == float("-inf"), 0.0, b_mn)  # a tile with no token yet: nothing to weigh
        b_p = tl.exp(b_s - b_ref[:, None])
        b_alpha = tl.exp(b_m - b_ref)
        b_yv = _unpack_tile(vc_ptr, b_slot, m_t, VROW, vbyte_ptr, vshift_ptr, vmask_ptr, vgain_ptr, vbook_ptr,
                            vbooks_ptr, o_w, m_w, VGAIN).to(tl.float16)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(tl.float16), b_yv)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_m = b_mn
    o_out = (i_b * NSPLIT + i_s) * HQP + o_q
    tl.store(acc_ptr + o_out[:, None] * WP + o_w[None, :], b_acc)
    tl.store(m_ptr + o_out, b_m)
    tl.store(l_ptr + o_out, b_l)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, key_codec: TransformCodec, value_codec: TransformCodec, *,
                     scale: float, rope=None, first_position: int = 0, splits: int | None = None,
                     check: bool = True) -> torch.Tensor:
    """One decode step (module docstring): ``q [B, Hq, D]`` -> ``[B, Hq, D]`` float32.

    ``rope``: a ``kvlab.RoPE`` when the keys were coded before RoPE (token ``t`` at position ``first_position +
    t``). ``splits``: parallel splits of the context (default: enough to fill a GPU). ``check`` (one host sync):
    ``q`` finite, every ``seq_lens`` in ``[1, max_blocks * block_size]`` and the block-table entries it uses
    blocks of the caches."""
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
    if width > MAX_WIDTH:
        raise ValueError(f"the codecs code {width} numbers per token (KV heads x head_dim); this kernel keeps a token's "
                         f"transformed row in one tile and reads rows of at most {MAX_WIDTH} (SmolLM2: 3 x 64 = 192)")
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
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    C.check_int("first_position", first_position, minimum=0)
    if splits is not None:
        C.check_int("splits", splits, minimum=1)
    if rope is not None:
        from ..calibration import RoPE  # a small dataclass, no kernel

        if not isinstance(rope, RoPE):
            raise TypeError(f"rope must be None or a kvlab.RoPE, got {type(rope).__name__}")
        if rope.dim != dim:
            raise ValueError(f"rope rotates {rope.dim} channels, the heads have {dim}")
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
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
    hqp = max(MIN_DOT, triton.next_power_of_2(q_heads))
    wp = max(MIN_DOT, triton.next_power_of_2(width))
    kt, vt = _unpack_tables(key_codec, wp, device), _unpack_tables(value_codec, wp, device)
    max_len = block_table.shape[1] * page
    if splits is None:
        splits = max(1, min(C.cdiv(max_len, 256), C.cdiv(264, batch)))  # ~2 programs per SM of an H200
    bt = BLOCK_TOKENS if wp < 256 else MIN_DOT  # smaller tiles for wide rows (shared memory)
    split_len = C.cdiv(C.cdiv(max_len, splits), bt) * bt
    splits = C.cdiv(max_len, split_len)
    qf = q.float()
    head_of = torch.arange(q_heads, device=device) // group  # [Hq]
    dummy = torch.zeros(1, device=device)
    if rope is None:  # scores in the transformed space: qt = q inverse_h^T, qm = q . mean_h
        inv = kt["inverse"].view(width, heads, dim)  # [W, H, D]
        qt = torch.zeros(batch, hqp, wp, device=device)
        qt[:, :q_heads, :width] = torch.einsum("bjd,wjd->bjw", qf, inv[:, head_of]) * scale
        qm = torch.zeros(batch, hqp, device=device)
        qm[:, :q_heads] = (qf * kt["mean"].view(heads, dim)[head_of]).sum(-1) * scale
        qpad = inv_h = invr_h = mean_h = meanr_h = cos = sin = dummy
    else:
        qt = qm = dummy
        qpad = torch.zeros(batch, heads, hqp, dim, device=device, dtype=torch.float16)
        for h in range(heads):
            qpad[:, h, h * group : (h + 1) * group] = qf[:, h * group : (h + 1) * group].half()
        inv_h, invr_h, mean_h, meanr_h = _rope_columns(kt, width, heads, dim, wp, device)
        cos, sin = _rope_tables(rope, max_len, first_position, device)
    acc = torch.empty(batch, splits, hqp, wp, device=device)
    m = torch.empty(batch, splits, hqp, device=device)
    lsum = torch.empty(batch, splits, hqp, device=device)
    _transform_decode_kernel[(batch, splits)](
        k_cache, v_cache, block_table.contiguous(), seq_lens.contiguous(),
        kt["byte"], kt["shift"], kt["mask"], kt["gain"], kt["book"], kt["books"],
        vt["byte"], vt["shift"], vt["mask"], vt["gain"], vt["book"], vt["books"],
        qt, qm, qpad, inv_h, invr_h, mean_h, meanr_h, cos, sin, acc, m, lsum,
        key_codec.row_bytes, value_codec.row_bytes, block_table.shape[1], splits, split_len, width, float(scale),
        H=heads, D=dim, HQP=hqp, WP=wp, BT=bt, PAGE=page, PRE_ROPE=rope is not None,
        KGAIN=key_codec.gain, VGAIN=value_codec.gain, STEPS=split_len // bt,
        PER_HEAD=key_codec.groups == heads and max(MIN_DOT, dim) == dim, num_warps=8 if wp >= 512 else 4, num_stages=1)
    # combine the splits, then map the accumulated transformed values back once
    top = m.amax(1, keepdim=True)
    w = torch.where(torch.isfinite(m), torch.exp(m - top), torch.zeros_like(m))  # [B, S, HQP]
    o = (acc * w[..., None]).sum(1) / (lsum * w).sum(1)[..., None]  # [B, HQP, WP]
    x = o[:, :q_heads, :width] @ vt["inverse"] + vt["mean"]  # [B, Hq, W]: every head's values
    rows = torch.arange(batch, device=device)[:, None]
    return x.view(batch, q_heads, heads, dim)[rows, torch.arange(q_heads, device=device)[None], head_of[None]]
