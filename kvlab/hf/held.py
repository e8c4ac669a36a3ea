"""The 16-bit tokens a paged cache of calibrated transform codes keeps beside them: the first ``sink`` tokens of a
sequence and a ring of its last ``residual`` (position ``p`` at entry ``sink + p % residual``), for codecs calibrated
to keep them (``kvlab.transform.calibration.calibrate``'s ``sink`` and ``residual``). ``kv16`` is fp16
``[B, sink + residual, 2, H, D]`` (keys, then values). ``store_held`` writes new tokens into it (a decode step
without a host sync); ``attend_held`` merges attention over it with attention over the coded tokens by the two
parts' log-sum-exp.
"""

from __future__ import annotations

import torch

__all__ = ["attend_held", "store_held"]


def store_held(kv16: torch.Tensor, seq_lens: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid, sink: int,
               residual: int) -> None:
    """Keep the fp16 copies of ``key``/``value`` ``[B, H, n, D]``, the tokens after each sequence's ``seq_lens`` stored
    ones (``valid [B, n]``: which are real; ``None``: all) that fall in the sink or in the last ``residual``."""
    batch, n = key.shape[0], key.shape[2]
    device = key.device
    kv = torch.stack([key, value], 2).transpose(1, 3).to(torch.float16)  # [B, n, K/V, H, D]
    rows = torch.arange(batch, device=device)
    if n == 1 and valid is None:  # a decode step: position seq_lens (before this token is counted)
        pos = seq_lens.long()
        new = kv[:, 0]  # [B, K/V, H, D]
        if sink:
            at = pos.clamp(max=sink - 1)
            kv16[rows, at] = torch.where((pos < sink)[:, None, None, None], new, kv16[rows, at])
        if residual:
            kv16[rows, sink + pos % residual] = new
        return
    rank = torch.arange(n, device=device).expand(batch, n) if valid is None else valid.long().cumsum(1) - 1
    keep = torch.ones(batch, n, dtype=torch.bool, device=device) if valid is None else valid
    pos = seq_lens.long()[:, None] + rank  # [B, n]
    end = seq_lens.long() + keep.sum(1)  # [B]: tokens held after this store
    b, j = torch.nonzero(keep & (pos < sink), as_tuple=True)
    kv16[b, pos[b, j]] = kv[b, j]
    if residual:
        b, j = torch.nonzero(keep & (pos >= (end[:, None] - residual)), as_tuple=True)
        kv16[b, sink + pos[b, j] % residual] = kv[b, j]


def attend_held(kv16: torch.Tensor, q: torch.Tensor, scale: float, lens: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, sink: int, residual: int) -> torch.Tensor:
    """``q [B, Hq, D]``'s attention over every token of sequences of ``lens`` tokens: the attention over the coded
    tokens (``out [B, Hq, D]``, its log-sum-exp ``lse [B, Hq]``, ``-inf`` over none) merged with the attention over
    the fp16 copies."""
    batch, q_heads, dim = q.shape
    heads = kv16.shape[3]
    lens = lens.long()[:, None]  # [B, 1]
    j = torch.arange(sink + residual, device=q.device)[None, :]
    r = (j - sink).clamp_min(0)
    at = lens - 1 - (lens - 1 - r) % max(residual, 1)  # position held by ring entry r
    valid = torch.where(j < sink, j < lens, (at >= sink) & (at >= 0))  # [B, S + R]
    k16, v16 = kv16[:, :, 0].float(), kv16[:, :, 1].float()  # [B, S + R, H, D]
    qg = q.float().view(batch, heads, q_heads // heads, dim)
    s = torch.einsum("bhgd,bjhd->bhgj", qg, k16) * scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse16 = torch.logsumexp(s, -1).reshape(batch, q_heads)
    out16 = torch.einsum("bhgj,bjhd->bhgd", torch.softmax(s, -1), v16).reshape(batch, q_heads, dim)
    total = torch.logaddexp(lse, lse16)
    w, w16 = torch.exp(lse - total), torch.exp(lse16 - total)
    return out.float() * w[..., None] + out16 * w16[..., None]
