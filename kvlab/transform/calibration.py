"""Calibrating the transform codec of a model: ``calibrate(model, ids, bits=3.5) -> TransformKV``.

What is measured, once, on held-out text (``ids``, disjoint from any text the codec is evaluated on)
    The model runs over ``ids`` in windows of ``window`` tokens (positions ``0 .. window - 1``, as in
    evaluation); an attention function registered with ``transformers.AttentionInterface`` records every
    layer's keys, values and queries. The first token of each window (the attention sink, kept in 16
    bit by the cache) is left out of the statistics.

Per layer, for keys and values separately
    1. **What an error costs.** A key error ``e`` changes the scores ``q . e`` of the queries of its
       KV head's group; a value error changes the attention output, which ``W_o`` maps to the residual
       stream. The codec minimises the expected squared error of those, ``e^T M e``:

       * keys before RoPE (``keys="pre_rope"``): the score of query ``q`` (before RoPE) at distance
         ``t`` is ``q^T R_t k``; averaged over distances, ``M`` is diagonal, each channel pair
         ``(j, j + D/2)`` weighted by the mean of its two channels' ``E[q^2]``, summed over the group's
         query heads (the RoPE-averaged second moment of the queries);
       * keys after RoPE (``keys="post_rope"``): ``M = sum over the group's query heads of E[q q^T]``;
       * values: ``M = sum over the group's query heads j of W_o[:, j]^T W_o[:, j]``;
       * ``weighting=False``: ``M = I`` (plain mean squared error).

    2. **The transform.** ``z = (x - mean) M^(1/2)`` (row vectors; per group of ``dim`` numbers:
       the layer's heads jointly, ``groups="joint"``, or each head, ``groups="head"``; ``"joint keys"``: keys
       jointly, values per head) and the KLT
       ``U`` (eigenvectors of ``cov(z)``, largest variance first): ``forward = M^(1/2) U``,
       ``inverse = U^T M^(-1/2)``, so ``|y - y_hat|^2 = e^T M e``.
    3. **Codebooks.** With the per-token gain ``s = rms(y)`` (``gain=True``; by default 1: on SmolLM2 at 3.5 bits
       its 16 bits per vector buy less as codes than as a gain), component ``c``
       of ``u = y / s`` gets, for every width ``b = 0 .. 8``, the ``2**b`` centroids of a Lloyd-Max
       quantizer fitted to its calibration samples, each weighted by ``s^2`` (so that the distortion is
       that of ``y``), and its distortion ``D_c(b)``.
    4. **Bits.** The group's code bits (its budget: ``bits`` per element, the 16 bits of the gain and
       the 16-bit ``sink`` and ``residual`` tokens at a context of ``context`` tokens included) go one
       at a time to the component whose distortion falls most with one more bit
       (``allocation="greedy"``, greedy marginal allocation on convex curves), or evenly, the
       components of largest variance taking the remainder (``allocation="uniform"``).
    5. **Bits across layers** (``allocation="global"``). The distortions of different layers, and of keys and
       values, cost the model different amounts. ``sensitivity`` measures it: with the per-layer codec at
       ``reference_bits``, the KL divergence of the model's next-token distribution when one layer's keys (or
       values) alone are coded, per unit of their calibrated distortion (``lambda``). The budget of all layers
       and both parts is then pooled, and each bit goes to the component, of any layer and part, whose
       distortion times its ``lambda`` falls most.

Cost
    Constants: per layer and part, the mean, both transforms (``dim^2`` each per group) and the used
    centroids (``TransformKV.constants()``). Calibration of SmolLM2-135M on 4096 tokens: seconds on a CPU.
"""

from __future__ import annotations

import heapq
import math

import torch

from .. import _checks as C
from ..calibration import RoPE
from .codec import MAX_BITS, TransformCodec, TransformKV

__all__ = ["assemble", "calibrate", "capture", "code_budget", "fit_codec", "fit_curves", "sensitivity"]

GROUPS = ("joint", "head", "joint keys")
KEYS = ("pre_rope", "post_rope")
ALLOCATIONS = ("greedy", "uniform", "global")
RECORDER = "kvlab_transform_calibration"
LLOYD_ITERATIONS = 25
FIT_BITS = 7  # widths fitted on the calibration samples (8 levels per ~16 samples would fit noise)
LAYOUTS = ("stream", "fused")
FUSED_WIDTHS = (0, 2, 4, 8)  # the fused layout's widths: whole codes in each 32-bit word
FUSED_BLOCK = 16  # components that share a width: the same ranks of every head


# ----------------------------------------------------------------------------- what the model does


def capture(model, ids: torch.Tensor, *, window: int = 1024) -> list[dict]:
    """Per layer: ``keys`` (after RoPE), ``keys_pre`` (RoPE undone; ``None`` for a model whose layers use several
    rotary embeddings, e.g. Gemma 3), ``values`` as float32 ``[N, H, D]`` over the
    tokens of ``ids`` except each window's first, and the query moments of each KV head's group (float64):
    ``q_square [H, D]`` (sum over the group of ``E[q_c^2]``) and ``q_outer [H, D, D]`` (of ``E[q q^T]``)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    try:
        rope = RoPE.from_model(model)
    except ValueError:  # no single RoPE: keys can be calibrated after RoPE only
        rope = None
    layers: dict[int, dict] = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        i = module.layer_idx
        b, heads, n, dim = key.shape
        pos = torch.arange(n)
        k = key.detach().double().cpu()
        q = query.detach().double().cpu().reshape(b, heads, -1, n, dim)[:, :, :, 1:]  # [B, H, group, n-1, D]
        rec = layers.setdefault(i, {"keys": [], "keys_pre": [], "values": [], "q_square": 0, "q_outer": 0, "q_n": 0})
        rec["keys"].append(k[:, :, 1:].transpose(1, 2).reshape(-1, heads, dim).float())
        if rope is not None:
            rec["keys_pre"].append(rope.undo(k, pos)[:, :, 1:].transpose(1, 2).reshape(-1, heads, dim).float())
        rec["values"].append(value.detach().float().cpu()[:, :, 1:].transpose(1, 2).reshape(-1, heads, dim))
        rec["q_square"] = rec["q_square"] + q.square().sum((0, 3)).sum(1)  # [H, D]
        rec["q_outer"] = rec["q_outer"] + torch.einsum("bhgnd,bhgne->hde", q, q)  # [H, D, D]
        rec["q_n"] += b * (n - 1)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(RECORDER, record)
    device = next(model.parameters()).device
    previous = model.config._attn_implementation
    model.config._attn_implementation = RECORDER
    try:
        with torch.no_grad():
            for start in range(0, ids.numel() - window + 1, window):
                model(ids[None, start : start + window].to(device), use_cache=False, logits_to_keep=1)
    finally:
        model.config._attn_implementation = previous
    out = []
    for i in sorted(layers):
        rec = layers[i]
        out.append({"keys": torch.cat(rec["keys"]), "keys_pre": torch.cat(rec["keys_pre"]) if rope is not None else None,
                    "values": torch.cat(rec["values"]), "q_square": rec["q_square"] / rec["q_n"],
                    "q_outer": rec["q_outer"] / rec["q_n"]})
    return out


def _value_weights(model, layer: int, heads: int, dim: int) -> torch.Tensor:
    """``[H, D, D]``: sum over the query heads ``j`` of KV head ``h``'s group of ``W_o[:, j]^T W_o[:, j]``."""
    w = model.model.layers[layer].self_attn.o_proj.weight.detach().double().cpu()  # [hidden, Hq * D]
    q_heads = w.shape[1] // dim
    cols = w.reshape(w.shape[0], heads, q_heads // heads, dim)
    return torch.einsum("ohgd,ohge->hde", cols, cols)


def _pair_average(q_square: torch.Tensor) -> torch.Tensor:
    """RoPE-averaged weights: channels ``j`` and ``j + D/2`` (one rotating pair) both get their mean."""
    half = q_square.shape[-1] // 2
    mean = (q_square[..., :half] + q_square[..., half:]) / 2
    return torch.cat([mean, mean], -1)


# ----------------------------------------------------------------------------- one codec


def code_budget(bits: float, dim: int, *, gain: bool = True, sink: int = 0, residual: int = 0,
                context: int = 1024) -> int:
    """Code bits of one group of ``dim`` numbers per token such that the cache holds ``bits`` per element at
    ``context`` tokens: ``sink + residual`` tokens at 16 bits, the others at (code bits + gain) / dim."""
    held = min(sink + residual, context)
    per_element = (bits * context - 16 * held) / (context - held)
    return int(math.floor(per_element * dim + 1e-9)) - 16 * gain


def _lloyd(u: torch.Tensor, w: torch.Tensor, levels: int, sums=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted Lloyd-Max quantizers of every row of ``u [C, N]`` (weights ``w [N]``) with ``levels`` levels:
    ascending centroids ``[C, levels]`` and the weighted mean squared error of each row ``[C]``.

    Each row is sorted once; a cell's weight, weighted sum and weighted sum of squares are differences of
    prefix sums (``sums``: ``_prefix_sums(u, w)``, shared between widths), so an iteration costs
    ``O(levels log N)`` per row."""
    su, cw, cwu, cwuu = _prefix_sums(u, w) if sums is None else sums
    rows, n = su.shape
    total_w = cw[:, -1:]
    if levels == 1:
        c = cwu[:, -1:] / total_w
        return c, (cwuu[:, -1] - cwu[:, -1] ** 2 / cw[:, -1]) / cw[:, -1]
    probs = (torch.arange(levels, dtype=su.dtype) + 0.5) / levels
    c = torch.gather(su, 1, (probs * (n - 1)).round().long().expand(rows, -1)).contiguous()  # quantiles
    pad = lambda t: torch.cat([torch.zeros(rows, 1, dtype=t.dtype), t], 1)
    cw0, cwu0, cwuu0 = pad(cw), pad(cwu), pad(cwuu)

    def cells(c):
        edges = (c[:, 1:] + c[:, :-1]) / 2
        # samples in cell j: those with edges[j-1] < u <= edges[j] (the codec counts boundaries strictly below u)
        at = torch.cat([torch.zeros(rows, 1, dtype=torch.long), torch.searchsorted(su, edges, right=True),
                        torch.full((rows, 1), n, dtype=torch.long)], 1)
        mass = cw0.gather(1, at[:, 1:]) - cw0.gather(1, at[:, :-1])
        wu = cwu0.gather(1, at[:, 1:]) - cwu0.gather(1, at[:, :-1])
        wuu = cwuu0.gather(1, at[:, 1:]) - cwuu0.gather(1, at[:, :-1])
        return mass, wu, wuu

    for _ in range(LLOYD_ITERATIONS):
        mass, wu, _ = cells(c)
        new = torch.sort(torch.where(mass > 0, wu / mass.clamp_min(1e-300), c), 1).values
        done = bool(((new - c).abs() <= 1e-6 * (c.abs().amax(1, keepdim=True) + 1e-12)).all())
        c = new
        if done:
            break
    mass, wu, wuu = cells(c)
    err = (wuu - 2 * c * wu + c.square() * mass).sum(1)
    return c, err.clamp_min(0) / cw[:, -1]


def _grid(u: torch.Tensor, w: torch.Tensor, levels: int, sums=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted uniform quantizers of every row of ``u [C, N]`` (weights ``w [N]``) with ``levels`` levels
    ``lo + j step``: ascending centroids ``[C, levels]`` and the weighted mean squared error of each row ``[C]``.

    Alternates the nearest level of each sample with the weighted least-squares ``(lo, step)`` of the samples given
    their levels, from the grid spanning the ``0.5 / levels`` and ``1 - 0.5 / levels`` quantiles. As in ``_lloyd``,
    each row is sorted once (``sums``: ``_prefix_sums(u, w)``) and a level's samples are a run of it."""
    su, cw, cwu, cwuu = _prefix_sums(u, w) if sums is None else sums
    rows, n = su.shape
    total = cw[:, -1]
    if levels == 1:
        c = cwu[:, -1:] / total[:, None]
        return c, (cwuu[:, -1] - cwu[:, -1] ** 2 / total).clamp_min(0) / total
    pad = lambda t: torch.cat([torch.zeros(rows, 1, dtype=t.dtype), t], 1)
    cw0, cwu0, cwuu0 = pad(cw), pad(cwu), pad(cwuu)
    at = lambda p: torch.searchsorted(cw, (p * total)[:, None]).clamp(max=n - 1)[:, 0]
    lo = su.gather(1, at(0.5 / levels)[:, None])[:, 0]
    step = ((su.gather(1, at(1 - 0.5 / levels)[:, None])[:, 0] - lo) / (levels - 1)).clamp_min(1e-12)
    j = torch.arange(levels, dtype=su.dtype)

    def cells(lo, step):  # per level: its samples' weight, weighted sum, weighted sum of squares
        edges = lo[:, None] + step[:, None] * (j[:-1] + 0.5)  # samples above edge k are at level k + 1 or more
        at = torch.cat([torch.zeros(rows, 1, dtype=torch.long), torch.searchsorted(su, edges.contiguous(), right=True),
                        torch.full((rows, 1), n, dtype=torch.long)], 1)
        diff = lambda c: c.gather(1, at[:, 1:]) - c.gather(1, at[:, :-1])
        return diff(cw0), diff(cwu0), diff(cwuu0)

    for _ in range(LLOYD_ITERATIONS):
        mass, wu, _ = cells(lo, step)
        sj, sjj, sju = (mass * j).sum(1), (mass * j * j).sum(1), (wu * j).sum(1)
        su_ = wu.sum(1)
        det = total * sjj - sj * sj
        ok = det > 1e-12 * total * sjj.clamp_min(1e-30)
        new_step = torch.where(ok, (total * sju - sj * su_) / det.clamp_min(1e-300), step).clamp_min(1e-12)
        new_lo = torch.where(ok, (su_ - new_step * sj) / total, lo)
        done = bool(((new_step - step).abs() <= 1e-7 * step).all() and ((new_lo - lo).abs() <= 1e-7 * step).all())
        lo, step = new_lo, new_step
        if done:
            break
    mass, wu, wuu = cells(lo, step)
    c = lo[:, None] + step[:, None] * j
    err = (wuu - 2 * c * wu + c.square() * mass).sum(1)
    return c, err.clamp_min(0) / total


def _prefix_sums(u: torch.Tensor, w: torch.Tensor):
    """Rows of ``u`` sorted, and the prefix sums of ``w``, ``w u`` and ``w u^2`` in that order (float64)."""
    su, order = torch.sort(u.double(), 1)
    ws = w.double()[order]
    return su, ws.cumsum(1), (ws * su).cumsum(1), (ws * su.square()).cumsum(1)


def _allocate(curves: torch.Tensor, budget: int, allocation: str, variance: torch.Tensor) -> torch.Tensor:
    """Bits per component ``[C]`` from distortion curves ``[C, MAX_BITS + 1]`` and a budget of code bits."""
    comps = curves.shape[0]
    budget = max(0, min(budget, comps * MAX_BITS))
    if allocation == "uniform":
        bits = torch.full((comps,), budget // comps, dtype=torch.long)  # within FIT_BITS by the caller's budget
        bits[variance.argsort(descending=True)[: budget % comps]] += 1
        return bits
    return _greedy([[curves]], [1.0], budget, MAX_BITS)[0][0]


def _greedy(curves: list[list[torch.Tensor]], weights: list[float], budget: int, top: int) -> list[list[torch.Tensor]]:
    """Greedy marginal allocation: ``budget`` code bits, one at a time, each to the component whose weighted
    distortion falls most with it, up to ``top`` bits per component. ``curves[u][g]``: the distortion curves
    ``[C, top + 1]`` of group ``g`` of unit ``u`` (one unit: a layer's keys or values), ``weights[u]`` the unit's
    weight. Ties go to the first unit, group and component. Returns the bits, shaped as ``curves``."""
    bits = [[torch.zeros(c.shape[0], dtype=torch.long) for c in unit] for unit in curves]
    heap = [(-w * float(c[k, 0] - c[k, 1]), u, g, k)
            for u, (unit, w) in enumerate(zip(curves, weights)) for g, c in enumerate(unit) for k in range(c.shape[0])]
    heapq.heapify(heap)
    for _ in range(budget):
        if not heap:
            break
        _, u, g, k = heapq.heappop(heap)
        row = bits[u][g]
        row[k] += 1
        b, c = int(row[k]), curves[u][g]
        if b < top:
            heapq.heappush(heap, (-weights[u] * float(c[k, b] - c[k, b + 1]), u, g, k))
    return bits


def fit_curves(x: torch.Tensor, weight: torch.Tensor, *, groups: int, gain: bool = True, grid: bool = False) -> list[dict]:
    """Per group: the mean, both transforms, and for every width ``0 .. FIT_BITS`` each component's centroids
    and distortion, of samples ``x [N, H, D]`` with error weights ``weight [H, D, D]`` (per head). ``grid``: uniform
    levels (``_grid``) at the widths of the fused layout (``FUSED_WIDTHS``, or the tuple ``grid``), the other widths'
    distortions infinite."""
    n, heads, dim = x.shape
    width = heads * dim // groups
    x = x.double().reshape(n, groups, width)
    blocks = torch.block_diag(*weight.double())  # [H D, H D]: each group's weight is block-diagonal over its heads
    widths = FUSED_WIDTHS if grid is True else (grid or ())
    fits = []
    for g in range(groups):
        m = blocks[g * width : (g + 1) * width, g * width : (g + 1) * width]
        m = m / m.diagonal().mean()
        evals, evecs = torch.linalg.eigh((m + m.T) / 2)
        evals = evals.clamp_min(1e-4 * evals.max())
        root, inv_root = (evecs * evals.sqrt()) @ evecs.T, (evecs / evals.sqrt()) @ evecs.T
        mean = x[:, g].mean(0)
        z = (x[:, g] - mean) @ root
        _, u = torch.linalg.eigh(z.T @ z / n)
        u = u.flip(1)  # largest variance first
        forward, inverse = root @ u, u.T @ inv_root
        y = (x[:, g] - mean) @ forward  # [N, width]
        s = y.square().mean(1).sqrt().to(torch.float16).double() if gain else torch.ones(n, dtype=torch.float64)
        uu = (y / s.clamp_min(1e-30)[:, None]).T.contiguous()  # [width, N]
        w = s.square()
        curves = torch.full((width, MAX_BITS + 1), math.nan, dtype=torch.float64)
        cents, sums = [], _prefix_sums(uu, w)
        for b in range(MAX_BITS + 1):
            if grid and b in widths:
                c, d = _grid(uu, w, 1 << b, sums)
            elif not grid and b <= FIT_BITS:
                c, d = _lloyd(uu, w, 1 << b, sums)
            else:
                c, d = torch.zeros(width, 1 << b, dtype=torch.float64), torch.full((width,), math.inf, dtype=torch.float64)
            cents.append(c)
            curves[:, b] = d
        fits.append(dict(mean=mean, forward=forward, inverse=inverse, cents=cents, curves=curves, variance=y.var(0)))
    return fits


def assemble(fits: list[dict], budget: int, *, gain: bool = True, allocation: str = "greedy",
             bits: list[torch.Tensor] | None = None) -> TransformCodec:
    """The ``TransformCodec`` of ``fit_curves``' groups with ``budget`` code bits per group and token (or the
    given ``bits``, one ``[width]`` tensor per group)."""
    bit_rows, books = [], []
    for g, f in enumerate(fits):
        curves = f["curves"].clone()
        curves[:, FIT_BITS + 1 :] = math.inf  # widths past FIT_BITS are never chosen (by _allocate)
        if bits is None:
            row = _allocate(curves, min(budget, curves.shape[0] * FIT_BITS), allocation, f["variance"])
        else:
            row = bits[g].long()
        width = row.shape[0]
        book = torch.zeros(width, 1 << int(row.max()), dtype=torch.float64)
        for c in range(width):
            b = int(row[c])
            book[c, : 1 << b] = f["cents"][b][c]
            book[c, 1 << b :] = f["cents"][b][c, -1]
        bit_rows.append(row)
        books.append(book)
    levels = max(b.shape[1] for b in books)
    books = [torch.cat([b, b[:, -1:].expand(-1, levels - b.shape[1])], 1) for b in books]
    stack = lambda key: torch.stack([f[key] for f in fits]).float()
    return TransformCodec(stack("mean"), stack("forward"), stack("inverse"), torch.stack(bit_rows).to(torch.uint8),
                          torch.stack(books).float(), gain)


def _fused_allocate(units: list[list[dict]], weights: list[float], budget: int) -> list[torch.Tensor]:
    """Widths of the fused layout: per unit (a layer's keys or values, ``units[u]`` its heads' fits), one width of
    ``FUSED_WIDTHS`` per block of ``FUSED_BLOCK`` component ranks, the same for every head (components past the
    last whole block get none). ``budget`` code bits per token over all units and heads go, a step to the next
    width at a time, to the block whose weighted distortion falls most per bit (a step past the bits left is
    skipped). Every unit keeps its first block at 2 bits at least (a row of no bits stores nothing to decode).
    Returns ``[dim]`` widths per unit."""
    sums, state, heap = [], [], []
    for unit in units:
        curves = sum(f["curves"] for f in unit)  # [D, MAX_BITS + 1]: the heads' distortions summed
        k = curves.shape[0] // FUSED_BLOCK
        sums.append(curves[: k * FUSED_BLOCK].reshape(k, FUSED_BLOCK, -1).sum(1))
        state.append([0] * k)

    def push(u, k):
        i = FUSED_WIDTHS.index(state[u][k])
        if i + 1 < len(FUSED_WIDTHS):
            now, nxt = FUSED_WIDTHS[i], FUSED_WIDTHS[i + 1]
            cost = (nxt - now) * FUSED_BLOCK * len(units[u])
            heapq.heappush(heap, (-weights[u] * float(sums[u][k, now] - sums[u][k, nxt]) / cost, u, k, nxt, cost))

    left = budget
    for u in range(len(units)):
        if state[u]:
            state[u][0] = FUSED_WIDTHS[1]
            left -= FUSED_WIDTHS[1] * FUSED_BLOCK * len(units[u])
        for k in range(len(state[u])):
            push(u, k)
    while heap:
        _, u, k, nxt, cost = heapq.heappop(heap)
        if cost <= left:
            state[u][k] = nxt
            left -= cost
            push(u, k)
    out = []
    for u, unit in enumerate(units):
        w = torch.zeros(unit[0]["curves"].shape[0], dtype=torch.long)
        w[: len(state[u]) * FUSED_BLOCK] = torch.tensor(state[u], dtype=torch.long).repeat_interleave(FUSED_BLOCK)
        out.append(w)
    return out


def _fused_codec(unit: list[dict], widths: torch.Tensor) -> TransformCodec:
    """The codec of one unit in the fused layout: every head's components reordered (a stable sort) by width,
    widest first, so that each width's codes are one run of whole 32-bit words."""
    order = torch.sort(widths, descending=True, stable=True).indices
    ordered = [dict(mean=f["mean"], forward=f["forward"][:, order], inverse=f["inverse"][order],
                    cents=[c[order] for c in f["cents"]], curves=f["curves"][order], variance=f["variance"][order])
               for f in unit]
    return assemble(ordered, 0, gain=False, bits=[widths[order]] * len(unit))


def fit_codec(x: torch.Tensor, weight: torch.Tensor, budget: int, *, groups: int, gain: bool = True,
              allocation: str = "greedy") -> TransformCodec:
    """The transform codec of samples ``x [N, H, D]`` with error weights ``weight [H, D, D]`` (per head) and
    ``budget`` code bits per group and token (see the module docstring)."""
    return assemble(fit_curves(x, weight, groups=groups, gain=gain), budget, gain=gain, allocation=allocation)


def _distortion(fits: list[dict], codec: TransformCodec) -> float:
    """Calibrated distortion of ``codec``'s allocation: per token, summed over its groups and components."""
    return sum(float(f["curves"][torch.arange(f["curves"].shape[0]), b.long().cpu()].sum())
               for f, b in zip(fits, codec.bits))


def sensitivity(model, ids: torch.Tensor, kv: TransformKV, *, windows: int = 2, window: int = 1024) -> torch.Tensor:
    """float64 ``[layers, 2]``: the KL divergence (nats per token) of ``model``'s next-token distribution from its
    distribution with 16-bit keys and values, when one layer's keys (column 0) or values (column 1) alone are
    stored by ``kv``'s codec (its sink in 16 bit, no recent window). Measured on ``windows`` windows of ``ids``
    (starting at ``i * len(ids) // windows``): the first half of a window is the prompt, the second half is scored
    against the stored prompt, as ``kvlab.perplexity`` scores it."""
    from ..study.simulated import SimulatedCache, fp16_part, rope_tables, transform_part

    C.check_int("windows", windows, minimum=1)
    C.check_int("window", window, minimum=4)
    if ids.dim() != 1 or ids.numel() < window:
        raise ValueError(f"ids must be 1-d token ids with at least one window of {window}, got shape {tuple(ids.shape)}")
    device = next(model.parameters()).device
    tables = rope_tables(model) if kv.rope is not None else None
    half = window // 2

    def scored(parts, w):
        cache = SimulatedCache(parts, residual=0, sink=kv.sink)
        model(w[:, :half], cache=cache, use_cache=True)
        return torch.log_softmax(model(w[:, half:], cache=cache, use_cache=True).logits[0].double(), -1)

    kl = torch.zeros(kv.layers, 2, dtype=torch.float64)
    plain = [(fp16_part(), fp16_part()) for _ in range(kv.layers)]
    with torch.no_grad():
        for i in range(windows):
            start = min(i * ids.numel() // windows, ids.numel() - window)
            w = ids[None, start : start + window].to(device)
            ref = scored(plain, w)
            for layer in range(kv.layers):
                for part in (0, 1):
                    parts = list(plain)
                    coded = (transform_part(kv.keys[layer], tables) if part == 0 else transform_part(kv.values[layer]))
                    parts[layer] = (coded, plain[layer][1]) if part == 0 else (plain[layer][0], coded)
                    kl[layer, part] += float((ref.exp() * (ref - scored(parts, w))).sum(-1).mean()) / windows
    return kl


# ----------------------------------------------------------------------------- a model


def calibrate(model, ids: torch.Tensor, *, bits: float = 3.5, groups: str = "joint", keys: str = "pre_rope",
              weighting: bool = True, gain: bool = False, allocation: str = "greedy", sink: int = 1,
              residual: int = 16, context: int = 1024, window: int = 1024, captured: list | None = None,
              fits: dict | None = None, reference_bits: float = 2.5, sensitivity_windows: int = 2,
              layout: str = "stream") -> TransformKV:
    """Transform codecs for every layer's keys and values of ``model``, calibrated on the 1-d token ids ``ids``
    (see the module docstring). ``bits``: bits per element the cache holds at ``context`` tokens, everything
    counted (codes, gains, the ``sink`` and ``residual`` tokens in 16 bit). ``captured``: the output of
    ``capture(model, ids, window=window)``, to calibrate several variants from one pass; ``fits``: a dict that
    keeps each layer's transforms and distortion curves, and the sensitivities, between calls (variants that
    differ only in bits, allocation, sink or window share them). ``allocation="global"``: ``sensitivity`` of the codec at
    ``reference_bits`` on ``sensitivity_windows`` windows of ``ids`` weights each layer's keys and values (step 5
    of the module docstring); it costs two passes over half a window per layer, part and window.

    ``layout="fused"``: uniform levels that ``kvlab.transform.attention.decode_attention`` scores without a
    lookup where ``groups="head"`` (other groups are decoded token by token). It needs ``keys="post_rope"`` and
    ``gain=False``; each component gets uniform levels; widths are
    0, 2, 4 or 8 bits, one per block of 16 component ranks shared by a layer's heads (``allocation="greedy"``:
    the bits of each layer's keys or values apart; ``"global"``: pooled as in step 5), widest components first."""
    C.check_tensor("ids", ids, (torch.int32, torch.int64))
    if ids.dim() != 1 or ids.numel() < window:
        raise ValueError(f"ids must be 1-d token ids with at least one window of {window}, got shape {tuple(ids.shape)}")
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 0 < bits <= MAX_BITS:
        raise ValueError(f"bits must be a number in (0, {MAX_BITS}], got {bits!r}")
    C.check_choice("groups", groups, GROUPS)
    C.check_choice("keys", keys, KEYS)
    C.check_choice("allocation", allocation, ALLOCATIONS)
    C.check_choice("layout", layout, LAYOUTS)
    if layout == "fused":
        wrong = [f"{k}={v!r}" for k, v, bad in (("keys", keys, keys != "post_rope"), ("gain", gain, gain is not False),
                                                  ("allocation", allocation, allocation == "uniform")) if bad]
        if wrong:
            raise ValueError(f"layout='fused' needs keys='post_rope', gain=False and allocation 'greedy' or 'global', "
                             f"got {', '.join(wrong)}")
    if isinstance(reference_bits, bool) or not isinstance(reference_bits, (int, float)) or not 0 < reference_bits <= MAX_BITS:
        raise ValueError(f"reference_bits must be a number in (0, {MAX_BITS}], got {reference_bits!r}")
    C.check_int("sensitivity_windows", sensitivity_windows, minimum=1)
    C.check_bool("weighting", weighting)
    C.check_bool("gain", gain)
    C.check_int("sink", sink, minimum=0)
    C.check_int("residual", residual, minimum=0)
    C.check_int("context", context, minimum=sink + residual + 1)
    from ..hf.cache import model_shape

    _, heads, dim = model_shape(model.config, "calibrate", sliding=True)
    width = dim  # the narrowest group: its budget is the smallest
    if groups == "joint":
        width = heads * dim
    for name, b in [("bits", bits)] + ([("reference_bits", reference_bits)] if allocation == "global" else []):
        top = max(FUSED_WIDTHS) if layout == "fused" else FIT_BITS  # the widest code a component gets
        budget = code_budget(b, width, gain=gain, sink=sink, residual=residual, context=context)
        held = min(sink + residual, context)
        if budget > top * width:
            most = ((top + 16 * gain / width) * (context - held) + 16 * held) / context
            raise ValueError(f"{name}={b} asks for more than {top}-bit codes for every component (layout={layout!r}): with "
                             f"sink={sink} and residual={residual} tokens in 16 bit at context={context}, {name} can be "
                             f"at most {math.floor(most * 1000) / 1000:.3f}; for more, keep the cache in fp16")
        if budget < 1:
            least = ((1 + 16 * gain) / width * (context - held) + 16 * held) / context
            raise ValueError(f"{name}={b} leaves no bits for the codes: with sink={sink} and residual={residual} tokens "
                             f"in 16 bit at context={context}{' and a gain per vector' if gain else ''}, {name} must be "
                             f"at least {least:.3f}")
    rope = RoPE.from_model(model) if keys == "pre_rope" else None  # a ValueError naming keys='post_rope' without one RoPE
    data = capture(model, ids, window=window) if captured is None else captured
    fits = {} if fits is None else fits
    key_codecs, value_codecs, unit_ids, pooled = [], [], [], 0
    for i, rec in enumerate(data):
        n, heads, dim = rec["keys"].shape
        gk = 1 if groups in ("joint", "joint keys") else heads
        gv = 1 if groups == "joint" else heads
        budget_k, budget_v = (code_budget(bits, heads * dim // g, gain=gain, sink=sink, residual=residual,
                                          context=context) for g in (gk, gv))
        eye = torch.eye(dim, dtype=torch.float64).expand(heads, dim, dim)
        grid = tuple(FUSED_WIDTHS) if layout == "fused" else False
        kid, vid = (i, "keys", keys, gk, weighting, gain, grid), (i, "values", gv, weighting, gain, grid)
        if kid not in fits:
            wk = eye if not weighting else (torch.diag_embed(_pair_average(rec["q_square"])) if keys == "pre_rope"
                                            else rec["q_outer"])
            fits[kid] = fit_curves(rec["keys_pre"] if keys == "pre_rope" else rec["keys"], wk, groups=gk, gain=gain,
                                   grid=grid)
        if vid not in fits:
            wv = eye if not weighting else _value_weights(model, i, heads, dim)
            fits[vid] = fit_curves(rec["values"], wv, groups=gv, gain=gain, grid=grid)
        if grid:
            pooled += budget_k * gk + budget_v * gv
            if allocation != "global":
                key_codecs.append(_fused_codec(fits[kid], _fused_allocate([fits[kid]], [1.0], budget_k * gk)[0]))
                value_codecs.append(_fused_codec(fits[vid], _fused_allocate([fits[vid]], [1.0], budget_v * gv)[0]))
        elif allocation == "global":  # the per-layer budgets, pooled below
            pooled += sum(max(0, min(b, f["curves"].shape[0] * FIT_BITS))
                          for b, part in ((budget_k, fits[kid]), (budget_v, fits[vid])) for f in part)
        else:
            key_codecs.append(assemble(fits[kid], budget_k, gain=gain, allocation=allocation))
            value_codecs.append(assemble(fits[vid], budget_v, gain=gain, allocation=allocation))
        unit_ids.append((kid, vid))
    if allocation != "global":
        return TransformKV(tuple(key_codecs), tuple(value_codecs), rope, sink, residual)
    ref = calibrate(model, ids, bits=reference_bits, groups=groups, keys=keys, weighting=weighting, gain=gain,
                    allocation="greedy", sink=sink, residual=residual, context=context, window=window, captured=data,
                    fits=fits, layout=layout)
    sid = ("sensitivity", reference_bits, sensitivity_windows, groups, keys, weighting, gain, sink, residual, context,
           window, layout)
    if sid not in fits:  # variants that differ only in bits share it
        fits[sid] = sensitivity(model, ids, ref, windows=sensitivity_windows, window=window)
    kl = fits[sid]
    units, weights = [], []
    for i in range(len(data)):
        for part, codec in ((0, ref.keys[i]), (1, ref.values[i])):
            unit = fits[unit_ids[i][part]]
            units.append(unit)
            if layout == "fused":  # the reference's widths in the fits' order of components
                g = len(unit)
                budget = code_budget(reference_bits, unit[0]["curves"].shape[0], gain=gain, sink=sink,
                                     residual=residual, context=context)
                w = _fused_allocate([unit], [1.0], budget * g)[0]
                distortion = sum(float(f["curves"][torch.arange(w.numel()), w].sum()) for f in unit)
            else:
                distortion = _distortion(unit, codec)
            weights.append(max(float(kl[i, part]), 1e-12) / max(distortion, 1e-30))
    if layout == "fused":
        codecs = [_fused_codec(unit, w) for unit, w in zip(units, _fused_allocate(units, weights, pooled))]
        return TransformKV(tuple(codecs[0::2]), tuple(codecs[1::2]), rope, sink, residual)
    widths = _greedy([[f["curves"] for f in unit] for unit in units], weights, pooled, FIT_BITS)
    codecs = [assemble(unit, 0, gain=gain, bits=b) for unit, b in zip(units, widths)]
    return TransformKV(tuple(codecs[0::2]), tuple(codecs[1::2]), rope, sink, residual)
