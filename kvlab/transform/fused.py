"""Decode attention over transform codes in the fused layout: scores and values in the codes' space, no lookup.

What
    ``calibrate(..., layout="fused")`` codes KV head ``h``'s keys (after RoPE) and values as ``y = (x - mean_h)
    forward_h``, component ``c`` on ``2**bits[c]`` uniform levels ``lo_c + j step_c``, widest components first,
    widths of 8, 4, 2 or 0 bits in runs of whole 32-bit words, no gain (``fused_layout``). A key's score is

        q . k = q . mean_h + sum_c (q inverse_h^T)_c (lo_c + step_c code_c) = const(q) + sum_c qs_c code_c,

    ``qs = (q inverse_h^T) * step``; the constant is the same for every token and drops out of the softmax. The
    attention output is ``mean_h + (lo + step * sum_t p_t code_t) inverse_h`` (the weights ``p_t`` summing to one).

How
    One program per sequence, KV head and split of the context. For a tile of ``BT`` tokens and each width: the
    run's 32-bit words (coalesced), each pair of codes put into the mantissas of the fp16 pair ``1024 + code``
    by a shift, a mask and an or (compiled: two codes a 32-bit operation), and
    one tensor-core product with the group's scaled queries (keys) or its weights (values); one ``sub.f16x2`` per
    pair takes the 1024 off first, so that the products sum the codes themselves. Within a
    word the tile holds the codes in the order ``j, j + J`` of each fp16 pair ``j`` (``J`` pairs a word);
    the launcher puts the queries in that order and the sums back. Splits are combined by their log-sum-exp.

The oracle is ``kvlab.transform.reference.decode_attention`` (decoding every token); the layout is
``kvlab.transform.codec``'s.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import _checks as C
from .._kernels.mse_tile import join_all
from .._kernels.tables import compiled, interpreted
from .codec import TransformCodec

__all__ = ["WIDTHS", "decode_attention", "fused_layout", "in_layout"]

WIDTHS = (8, 4, 2)  # the runs of a fused row, in order; 0-bit components are not stored
_CODES = tl.constexpr("{.reg .b32 m, t; mov.b32 m, 0x64006400; sub.f16x2 t, $2, m; mov.b32 {$0, $1}, t;}")
GRID_TOLERANCE = 1e-4  # levels lo + j step to this fraction of the largest level of a component (float32)
BLOCK_TOKENS = 64
MIN_DOT = 16
# launch defaults (not tuned): programs per SM the context's splits aim at (each program a run of tiles of at least
# 8 tiles), warps and pipeline stages of a program
_LAUNCH = {"programs_per_sm": 2, "warps": 4, "stages": 2}


def fused_layout(codec: TransformCodec) -> dict | None:
    """The fused layout of ``codec`` (``None`` if it is not in it): ``counts`` (components per width of
    ``WIDTHS``), ``lo`` and ``step`` ``[groups, dim]`` float32 (0-bit components: their one level, step 0),
    ``slot_words`` (32-bit words of a group's slot)."""
    cache = codec.__dict__.setdefault("_fused_layout", {})
    if "layout" in cache:
        return cache["layout"]
    cache["layout"] = None
    bits = codec.bits.long().cpu()
    row = bits[0]
    if codec.gain or not bool((bits == row).all()) or bool((row[1:] > row[:-1]).any()):
        return None
    if not all(int(b) in WIDTHS + (0,) for b in row.unique()):
        return None
    counts = [int((row == w).sum()) for w in WIDTHS]
    if any(n * w % 32 for n, w in zip(counts, WIDTHS)):
        return None
    book = codec.codebooks.double().cpu()  # [G, D, levels]
    lo = book[..., 0]
    step = torch.where(row > 0, book[..., 1 % book.shape[-1]] - lo, torch.zeros_like(lo))
    j = torch.arange(book.shape[-1], dtype=torch.float64)
    used = j < (1 << row)[:, None]  # [D, levels]
    grid = lo[..., None] + step[..., None] * j
    span = book.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    if bool(((grid - book).abs() > GRID_TOLERANCE * span)[:, used].any()) or bool((step[:, row > 0] <= 0).any()):
        return None
    cache["layout"] = {"counts": counts, "lo": lo.float(), "step": step.float(),
                       "slot_words": sum(n * w for n, w in zip(counts, WIDTHS)) // 32}
    return cache["layout"]


def in_layout(codecs, heads: int) -> bool:
    """Whether every codec of ``codecs`` is in the fused layout with a group per KV head (of ``heads``)."""
    return all(c.groups == heads and fused_layout(c) is not None for c in codecs)


def _tile_order(count: int, width: int, words_padded: int) -> torch.Tensor:
    """Component (within its run) of each tile position of a run of ``count`` codes of ``width`` bits read as
    ``words_padded`` words; ``count`` (no component) past the run's words."""
    per_word = 32 // width
    pairs = per_word // 2
    p = torch.arange(words_padded * per_word)
    within = p % per_word
    comp = p // per_word * per_word + within // 2 + pairs * (within % 2)
    return torch.where(comp < count, comp, torch.full_like(comp, count))


@triton.jit
def _codes(x):
    """int32 whose halves are the fp16 numbers ``1024 + code`` -> the two codes as fp16 (exact): one ``sub.f16x2``."""
    return tl.inline_asm_elementwise(_CODES, "=h,=h,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)


@triton.jit
def _run_tile(p_words, m_t, WORD0: tl.constexpr, NW: tl.constexpr, NWP: tl.constexpr, W: tl.constexpr,
              BT: tl.constexpr, FAST: tl.constexpr):
    """fp16 ``[BT, NWP * 32 / W]``: the codes of the run of ``NW`` words at word ``WORD0`` of each token's slot
    (``p_words [BT]``: the slots' first words), in tile order (module docstring); 0 past the run."""
    PER: tl.constexpr = 32 // W
    J: tl.constexpr = PER // 2
    MASK: tl.constexpr = ((1 << W) - 1) * 65537  # the code bits of both halves
    N: tl.constexpr = NWP * PER
    if FAST:
        o_w = tl.arange(0, NWP)
        b_w = tl.load(p_words[:, None] + WORD0 + o_w[None, :], mask=m_t[:, None] & (o_w < NW)[None, :], other=0)
        pairs = ()
        for j in tl.static_range(J):
            pairs = pairs + (((b_w >> (W * j)) & MASK) | 0x64006400,)
        LEVELS: tl.constexpr = 3 if J == 8 else (2 if J == 4 else 1)
        b_lo, b_hi = _codes(join_all(pairs, LEVELS))
        return tl.reshape(tl.join(b_lo, b_hi), [BT, N])
    else:  # the same numbers by plain integer arithmetic (Triton's interpreter runs no PTX)
        o_p = tl.arange(0, N)
        o_w = o_p // PER
        within = o_p % PER
        shift = (within // 2 + J * (within % 2)) * W
        b_w = tl.load(p_words[:, None] + WORD0 + o_w[None, :], mask=m_t[:, None] & (o_w < NW)[None, :], other=0)
        b_c = (b_w.to(tl.int32) >> shift[None, :]) & ((1 << W) - 1)
        return b_c.to(tl.float32).to(tl.float16)


@triton.jit
def _fused_decode_kernel(
    kc_ptr, vc_ptr, table_ptr, lens_ptr, q_ptr,  # q: [B, H, GP, KN] fp16, in tile order
    acc_ptr, m_ptr, l_ptr,  # per split: acc [B, S, H, GP, VN], m and l [B, S, H, GP]
    MAX_BLOCKS, NUM_BLOCKS, NSPLIT, SPLIT, FIRST, scale,
    H: tl.constexpr, GP: tl.constexpr, PAGE: tl.constexpr, BT: tl.constexpr,
    KROW_WORDS: tl.constexpr, KSLOT_WORDS: tl.constexpr, VROW_WORDS: tl.constexpr, VSLOT_WORDS: tl.constexpr,
    K8: tl.constexpr, K4: tl.constexpr, K2: tl.constexpr,  # words of each key run
    K8P: tl.constexpr, K4P: tl.constexpr, K2P: tl.constexpr,  # padded to powers of two
    V8: tl.constexpr, V4: tl.constexpr, V2: tl.constexpr, V8P: tl.constexpr, V4P: tl.constexpr, V2P: tl.constexpr,
    KN: tl.constexpr, VN: tl.constexpr, KQ4: tl.constexpr, KQ2: tl.constexpr, VA4: tl.constexpr, VA2: tl.constexpr,
    FAST: tl.constexpr, STEPS: tl.constexpr,
):
    i_b, i_h, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    o_g = tl.arange(0, GP)
    n = tl.minimum(tl.load(lens_ptr + i_b), MAX_BLOCKS * PAGE)  # unchecked lengths stay within the table
    start = FIRST + i_s * SPLIT
    stop = tl.minimum(start + SPLIT, n)
    i_bh = i_b * H + i_h
    # the scaled queries of each key run, [GP, columns of the run] fp16
    N8K: tl.constexpr = K8P * 4
    N4K: tl.constexpr = K4P * 8
    N2K: tl.constexpr = K2P * 16
    p_q = q_ptr + (i_bh * GP + o_g[:, None]) * KN
    b_q8 = tl.zeros([GP, 16], tl.float16)
    b_q4 = tl.zeros([GP, 16], tl.float16)
    b_q2 = tl.zeros([GP, 16], tl.float16)
    if K8 > 0:
        b_q8 = tl.load(p_q + tl.arange(0, N8K)[None, :])
    if K4 > 0:
        b_q4 = tl.load(p_q + KQ4 + tl.arange(0, N4K)[None, :])
    if K2 > 0:
        b_q2 = tl.load(p_q + KQ2 + tl.arange(0, N2K)[None, :])
    N8V: tl.constexpr = V8P * 4
    N4V: tl.constexpr = V4P * 8
    N2V: tl.constexpr = V2P * 16
    b_a8 = tl.zeros([GP, 16], tl.float32)
    b_a4 = tl.zeros([GP, 16], tl.float32)
    b_a2 = tl.zeros([GP, 16], tl.float32)
    if V8 > 0:
        b_a8 = tl.zeros([GP, N8V], tl.float32)
    if V4 > 0:
        b_a4 = tl.zeros([GP, N4V], tl.float32)
    if V2 > 0:
        b_a2 = tl.zeros([GP, N2V], tl.float32)
    b_m = tl.full([GP], float("-inf"), tl.float32)
    b_l = tl.zeros([GP], tl.float32)
    kw_ptr = kc_ptr.to(tl.pointer_type(tl.uint32))
    vw_ptr = vc_ptr.to(tl.pointer_type(tl.uint32))
    for it in range(0, STEPS):  # the interpreter's trip count; compiled, STEPS is 0 and the loop below runs
        o_t = start + it * BT + tl.arange(0, BT)
        m_t = o_t < stop
        b_blk = tl.load(table_ptr + i_b * MAX_BLOCKS + o_t // PAGE, mask=m_t, other=0).to(tl.int64)
        b_blk = tl.minimum(tl.maximum(b_blk, 0), NUM_BLOCKS - 1)  # unchecked entries stay within the caches
        b_slot = b_blk * PAGE + o_t % PAGE
        b_m, b_l, b_a8, b_a4, b_a2 = _fused_step(
            kw_ptr + b_slot * KROW_WORDS + i_h * KSLOT_WORDS, vw_ptr + b_slot * VROW_WORDS + i_h * VSLOT_WORDS, m_t,
            b_q8, b_q4, b_q2, b_a8, b_a4, b_a2, b_m, b_l, scale, GP, BT, K8, K4, K2, K8P, K4P, K2P, V8, V4, V2, V8P, V4P,
            V2P, FAST)
    if STEPS == 0:
        for t0 in range(start, stop, BT):
            o_t = t0 + tl.arange(0, BT)
            m_t = o_t < stop
            b_blk = tl.load(table_ptr + i_b * MAX_BLOCKS + o_t // PAGE, mask=m_t, other=0).to(tl.int64)
            b_blk = tl.minimum(tl.maximum(b_blk, 0), NUM_BLOCKS - 1)
            b_slot = b_blk * PAGE + o_t % PAGE
            b_m, b_l, b_a8, b_a4, b_a2 = _fused_step(
                kw_ptr + b_slot * KROW_WORDS + i_h * KSLOT_WORDS, vw_ptr + b_slot * VROW_WORDS + i_h * VSLOT_WORDS,
                m_t, b_q8, b_q4, b_q2, b_a8, b_a4, b_a2, b_m, b_l, scale, GP, BT, K8, K4, K2, K8P, K4P, K2P, V8, V4, V2,
                V8P, V4P, V2P, FAST)
    o_out = ((i_b * NSPLIT + i_s) * H + i_h) * GP + o_g  # [GP]
    p_acc = acc_ptr + o_out[:, None] * VN
    if V8 > 0:
        tl.store(p_acc + tl.arange(0, N8V)[None, :], b_a8)
    if V4 > 0:
        tl.store(p_acc + VA4 + tl.arange(0, N4V)[None, :], b_a4)
    if V2 > 0:
        tl.store(p_acc + VA2 + tl.arange(0, N2V)[None, :], b_a2)
    tl.store(m_ptr + o_out, b_m)
    tl.store(l_ptr + o_out, b_l)


@triton.jit
def _fused_step(pk, pv, m_t, b_q8, b_q4, b_q2, b_a8, b_a4, b_a2, b_m, b_l, scale, GP: tl.constexpr, BT: tl.constexpr,
                K8: tl.constexpr, K4: tl.constexpr, K2: tl.constexpr, K8P: tl.constexpr, K4P: tl.constexpr,
                K2P: tl.constexpr, V8: tl.constexpr, V4: tl.constexpr, V2: tl.constexpr, V8P: tl.constexpr,
                V4P: tl.constexpr, V2P: tl.constexpr, FAST: tl.constexpr):
    """One tile of ``BT`` tokens (``pk``, ``pv``: their key and value slots' first words): scores, the online
    softmax, the value sums."""
    b_s = tl.zeros([GP, BT], tl.float32)
    if K8 > 0:
        b_s += tl.dot(b_q8, tl.trans(_run_tile(pk, m_t, 0, K8, K8P, 8, BT, FAST)))
    if K4 > 0:
        b_s += tl.dot(b_q4, tl.trans(_run_tile(pk, m_t, K8, K4, K4P, 4, BT, FAST)))
    if K2 > 0:
        b_s += tl.dot(b_q2, tl.trans(_run_tile(pk, m_t, K8 + K4, K2, K2P, 2, BT, FAST)))
    b_s = tl.where(m_t[None, :], b_s * scale, float("-inf"))
    b_mn = tl.maximum(b_m, tl.max(b_s, 1))
    b_ref = tl.where(b_mn == float("-inf"), 0.0, b_mn)  # no token yet: nothing to weigh
    b_p = tl.exp(b_s - b_ref[:, None]).to(tl.float16)
    b_alpha = tl.exp(b_m - b_ref)
    b_l = b_l * b_alpha + tl.sum(b_p.to(tl.float32), 1)  # the fp16 weights the products sum
    if V8 > 0:
        b_a8 = b_a8 * b_alpha[:, None] + tl.dot(b_p, _run_tile(pv, m_t, 0, V8, V8P, 8, BT, FAST))
    if V4 > 0:
        b_a4 = b_a4 * b_alpha[:, None] + tl.dot(b_p, _run_tile(pv, m_t, V8, V4, V4P, 4, BT, FAST))
    if V2 > 0:
        b_a2 = b_a2 * b_alpha[:, None] + tl.dot(b_p, _run_tile(pv, m_t, V8 + V4, V2, V2P, 2, BT, FAST))
    return b_mn, b_l, b_a8, b_a4, b_a2


def _runs(layout: dict) -> list[tuple[int, int, int, int]]:
    """Per width of ``WIDTHS``: ``(components, first component, words, words padded)`` (padded: a power of two with
    at least 16 tile columns; 0 for an empty run)."""
    out, first = [], 0
    for n, w in zip(layout["counts"], WIDTHS):
        words = n * w // 32
        padded = max(triton.next_power_of_2(words), MIN_DOT * w // 32) if words else 0
        out.append((n, first, words, padded))
        first += n
    return out


def _plan(codec: TransformCodec, layout: dict, device) -> dict:
    """Per codec and device: each run's tile order as indices into ``[components + 1]`` (the last: zero)."""
    cache = codec.__dict__.setdefault("_fused_plan", {})
    if str(device) in cache:
        return cache[str(device)]
    index, columns = [], 0
    for (n, first, words, padded), w in zip(_runs(layout), WIDTHS):
        if words:
            order = _tile_order(n, w, padded)
            index.append(torch.where(order < n, order + first, torch.full_like(order, codec.dim)))
            columns += order.numel()
    plan = {"index": torch.cat(index).to(device) if index else torch.zeros(0, dtype=torch.long, device=device),
            "columns": columns, "runs": _runs(layout), "lo": layout["lo"].to(device), "step": layout["step"].to(device),
            "inverse": codec.inverse.float().to(device), "mean": codec.mean.float().to(device)}
    cache[str(device)] = plan
    return plan


def decode_attention(q, k_cache, v_cache, block_table, seq_lens, key_codec: TransformCodec,
                     value_codec: TransformCodec, *, scale: float, splits: int | None = None, check: bool = True,
                     first: int = 0, return_lse: bool = False):
    """``kvlab.transform.attention.decode_attention`` for codecs in the fused layout (keys after RoPE), its
    arguments checked there: ``q [B, Hq, D]`` -> ``[B, Hq, D]`` float32 over tokens ``first .. seq_lens[b] - 1``
    (and with ``return_lse`` the log-sum-exp of each query head's scores, ``[B, Hq]``, ``-inf`` over no token)."""
    batch, q_heads, dim = q.shape
    heads = key_codec.groups
    group = q_heads // heads
    device, page = q.device, k_cache.shape[1]
    kp, vp = _plan(key_codec, fused_layout(key_codec), device), _plan(value_codec, fused_layout(value_codec), device)
    gp = max(MIN_DOT, triton.next_power_of_2(group))
    span = max(1, block_table.shape[1] * page - first)  # tokens a sequence may hold past the first read
    block = BLOCK_TOKENS
    if splits is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        splits = max(1, min(C.cdiv(span, 8 * block), C.cdiv(_LAUNCH["programs_per_sm"] * sms, batch * heads)))
    split_len = C.cdiv(C.cdiv(span, splits), block) * block
    splits = C.cdiv(span, split_len)
    # the scaled queries in the keys' tile order: qs = (q inverse_h^T) * step, padded columns zero
    qf = q.float().view(batch, heads, group, dim)
    qt0 = torch.einsum("bhgd,hcd->bhgc", qf, kp["inverse"])  # q inverse_h^T
    qt = qt0 * kp["step"][None, :, None]
    qt = torch.cat([qt, torch.zeros_like(qt[..., :1])], -1)[..., kp["index"]]  # [B, H, G, KN]
    qs = torch.zeros(batch, heads, gp, kp["columns"], device=device, dtype=torch.float16)
    qs[:, :, :group], unscale = C.fit_fp16(qt) if check else (qt.half(), 1.0)  # fp16 scores stay finite
    acc = torch.empty(batch, splits, heads, gp, vp["columns"], device=device)
    m = torch.empty(batch, splits, heads, gp, device=device)
    lsum = torch.empty(batch, splits, heads, gp, device=device)
    (_, _, k8, k8p), (_, _, k4, k4p), (_, _, k2, k2p) = kp["runs"]
    (_, _, v8, v8p), (_, _, v4, v4p), (_, _, v2, v2p) = vp["runs"]
    kq4, va4 = 4 * k8p, 4 * v8p  # first tile column of each run
    kq2, va2 = kq4 + 8 * k4p, va4 + 8 * v4p
    fast = compiled(device)
    _fused_decode_kernel[(batch, heads, splits)](
        k_cache, v_cache, block_table.contiguous(), seq_lens.contiguous(), qs, acc, m, lsum,
        block_table.shape[1], k_cache.shape[0], splits, split_len, first, unscale * scale,
        H=heads, GP=gp, PAGE=page, BT=block, KROW_WORDS=key_codec.row_bytes // 4,
        KSLOT_WORDS=key_codec.group_bytes[0] // 4, VROW_WORDS=value_codec.row_bytes // 4,
        VSLOT_WORDS=value_codec.group_bytes[0] // 4, K8=k8, K4=k4, K2=k2, K8P=k8p, K4P=k4p, K2P=k2p,
        V8=v8, V4=v4, V2=v2, V8P=v8p, V4P=v4p, V2P=v2p, KN=kp["columns"], VN=vp["columns"], KQ4=kq4, KQ2=kq2, VA4=va4, VA2=va2, FAST=fast,
        STEPS=split_len // block if interpreted() else 0, num_warps=_LAUNCH["warps"], num_stages=_LAUNCH["stages"])
    # combine the splits; the mean code of every value component; back to the model's space once
    top = m.amax(1, keepdim=True)
    w = torch.where(torch.isfinite(m), torch.exp(m - torch.where(torch.isfinite(top), top, 0)), torch.zeros_like(m))
    total = (lsum * w).sum(1)  # [B, H, GP]: 0 over no token
    codes = (acc * w[..., None]).sum(1) / total.clamp_min(1e-30)[..., None]  # [B, H, GP, VN]
    mean_code = torch.zeros(batch, heads, group, dim + 1, device=device)
    mean_code[..., vp["index"]] = codes[:, :, :group]  # padded columns land on the spare last one
    y = vp["lo"][None, :, None] + vp["step"][None, :, None] * mean_code[..., :dim]  # [B, H, G, D]
    x = torch.einsum("bhgc,hcd->bhgd", y, vp["inverse"]) + vp["mean"][None, :, None]
    some = (total[:, :, :group] > 0)[..., None]
    x = torch.where(some, x, torch.zeros_like(x)).reshape(batch, q_heads, dim)
    if not return_lse:
        return x
    # the scores without the constants the softmax ignores: q . mean_h + sum_c qt_c lo_c
    const = (torch.einsum("bhgd,hd->bhg", qf, kp["mean"]) + (qt0 * kp["lo"][None, :, None]).sum(-1)) * scale
    lse = top[:, 0, :, :group] + torch.log(total[:, :, :group]) + const  # -inf over no token
    return x, lse.reshape(batch, q_heads)
