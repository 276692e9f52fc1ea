"""DeepSeek-V4's attention, as pure functions over one layer's state (the definition, token by
token: exact mode's form, and the twin any faster one is tested against).

Every layer attends over one head of shared keys and values (K = V: a row of `head_dim` values
a position, RMS-normed, its trailing `rope_dim` values rotated at the row's position) within a
sliding window of the last `window` positions, plus, in a compressing layer, entries that each
summarise `rate` positions:

- an entry closes when its window's last position arrives: its positions' projections `kv` and
  `gate` (plus a learned bias per slot) weigh, per channel, by a softmax over the slots, the
  result RMS-normed and rotated at the window's first position (`close`);
- heavily compressed attention (HCA) attends to every closed entry; compressed sparse attention
  (CSA) projects 2·head_dim values a position, two series: an entry weighs its own window's
  second half together with the previous window's first half (2·rate slots; the first entry has
  no previous window, its slots weigh nothing), and a lightning indexer (the same compression at
  its own width, over its own projections) scores every closed entry for each query and keeps
  the `index_topk` best.

A query at position t sees window rows t - window < s ≤ t and entries w < (t + 1) // rate. Its
heads' softmax takes a learned sink logit per head besides the rows' (`sink_attention`); the
output's trailing `rope_dim` values are rotated back by t (the inverse rotation: each row's
contribution then depends on its distance from t alone); heads go out through a grouped low-rank
projection (`grouped_output`).

Rotations here pair neighbouring channels (2i, 2i + 1), not the two halves (`ops.rope`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hebrus.ops.choose import top_k
from hebrus.ops.norm import rms_norm
from hebrus.ops.rope import inverse_frequencies


def interleaved_tables(rope_dim: int, theta: float, positions: int, dtype: torch.dtype, device=None,
                       yarn: "Yarn | None" = None):
    """cos, sin [positions, rope_dim / 2]: one angle per pair of channels, built in float64;
    with `yarn`, its frequencies and its factor on both tables."""
    inv_freq, scale = inverse_frequencies(rope_dim, theta), 1.0
    if yarn is not None:
        inv_freq, scale = yarn.frequencies(rope_dim, theta), yarn.attention
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    return (angles.cos() * scale).to(dtype=dtype, device=device), (angles.sin() * scale).to(dtype=dtype, device=device)


@dataclass(frozen=True, slots=True)
class Yarn:
    """YaRN's frequencies: each pair's interpolated by `factor` where it turns fewer than
    `beta_slow` times over the `original` context, kept where more than `beta_fast` times, a
    linear ramp between (its ends rounded outwards with `truncate`); cos and sin times `attention`."""
    factor: float
    original: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention: float = 1.0

    def frequencies(self, rope_dim: int, theta: float) -> torch.Tensor:
        def dim_of(turns: float) -> float:               # the pair index that turns `turns` times
            return rope_dim * math.log(self.original / (turns * 2 * math.pi)) / (2 * math.log(theta))
        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        kept = inverse_frequencies(rope_dim, theta)
        return kept / self.factor * ramp + kept * (1 - ramp)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, ..., d] with its trailing 2·P channels rotated pair by pair by cos, sin [T, P] (the
    inverse rotation with `inverse`); the leading d - 2P channels as they are."""
    P = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (P,)
    cos, sin = cos.reshape(shape).to(x.dtype), sin.reshape(shape).to(x.dtype)
    if inverse:
        sin = -sin
    keep, tail = x[..., :x.shape[-1] - 2 * P], x[..., x.shape[-1] - 2 * P:]
    even, odd = tail[..., 0::2], tail[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([keep, rotated], dim=-1)


def close(kv: torch.Tensor, gate: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
    """One entry from its slots: kv, gate [S, d] (gates with their bias; -inf: a slot that
    weighs nothing) -> RMS-normed Σ_s softmax_s(gate) ⊙ kv_s [d] (unrotated)."""
    weights = torch.softmax(gate, dim=0)
    return rms_norm((weights * kv).sum(0), norm, eps)


def slots(window, previous, overlap: bool):
    """An entry's slots from its window's projections (kv or gate [rate, c]) and, overlapping
    (CSA: c = 2·d), the previous window's (None for the first entry): [rate or 2·rate, d]."""
    if not overlap:
        return window
    d = window.shape[-1] // 2
    return torch.cat([previous[:, :d], window[:, d:]])


def sink_attention(q: torch.Tensor, rows: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """One query's heads q [H, d] over rows [S, d] (keys and values both) with a sink logit per
    head [H] beside the rows' -> [H, d]; no rows: zeros."""
    logits = torch.cat([q @ rows.T * scale, sinks.to(q.dtype)[:, None]], dim=-1)
    weights = torch.softmax(logits, dim=-1)[:, :-1]
    return weights @ rows


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The lightning indexer's score of each key for one query: Σ_h weights_h · ReLU(q_h · key)
    · scale, q [H, c], weights [H], keys [W, c] -> [W]."""
    return (F.relu(q @ keys.T) * scale * weights[:, None]).sum(0)


def grouped(o: torch.Tensor, o_a: torch.Tensor, groups: int) -> torch.Tensor:
    """Heads' outputs o [T, H·d] in `groups` groups, each through its own block of o_a
    [groups·rank, H·d / groups] -> [T, groups·rank] (the grouped output projection's first half)."""
    T = o.shape[0]
    x = o.view(T, groups, -1)                                            # [T, G, H·d / G]
    w = o_a.view(groups, -1, x.shape[-1])                                # [G, rank, H·d / G]
    return torch.einsum("tgi,gri->tgr", x, w.to(x.dtype)).reshape(T, -1)


def grouped_output(o: torch.Tensor, o_a: torch.Tensor, o_b: torch.Tensor, groups: int) -> torch.Tensor:
    """The grouped output projection: `grouped`, then all groups through o_b [D, groups·rank] -> [T, D]."""
    return grouped(o, o_a, groups) @ o_b.T.to(o.dtype)


def walk(kv, gate, state, start: int, rate: int, overlap: bool, norm, eps: float, cos, sin, each: bool = False):
    """A compressor over T positions from `start`: kv, gate [T, c] (each gate with its slot's
    bias), state (window_kv, window_gate, previous_kv, previous_gate: slot t % rate holds
    position t's; the previous pair None without `overlap`), cos, sin the entries' rotation
    tables -> (rows [T, d]: zeros, but at a position that closes its window the entry, rotated
    at the window's first position; the state after the last position, or with `each` after
    every one, stacked)."""
    window_kv, window_gate, previous_kv, previous_gate = state
    d = kv.shape[-1] // 2 if overlap else kv.shape[-1]
    rows, states = [], []
    for j in range(kv.shape[0]):
        t = start + j
        window_kv, window_gate = window_kv.clone(), window_gate.clone()
        window_kv[t % rate], window_gate[t % rate] = kv[j], gate[j]
        row = kv.new_zeros(1, d)
        if t % rate == rate - 1:
            # the first entry has no previous window: its slots weigh nothing
            before = previous_gate if t >= rate or not overlap else torch.full_like(previous_gate, float("-inf"))
            entry = close(slots(window_kv, previous_kv, overlap), slots(window_gate, before, overlap), norm, eps)
            first = t - rate + 1
            row = rotate_tail(entry[None], cos[first:first + 1], sin[first:first + 1])
            if overlap:
                previous_kv, previous_gate = window_kv, window_gate
        rows.append(row)
        states.append((window_kv, window_gate, previous_kv, previous_gate))
    if each:
        return torch.cat(rows), tuple(None if x[0] is None else torch.stack(x) for x in zip(*states))
    return torch.cat(rows), states[-1]


def closed(entries: torch.Tensor, t: int, rate: int) -> torch.Tensor:
    """The entries position t sees, from an entry log that holds one row a position (an entry at
    its window's last position, zeros elsewhere) up to at least t: w < (t + 1) // rate."""
    return entries[rate - 1:t + 1:rate]


def choose(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, top: int, scale: float) -> torch.Tensor:
    """The indexer's choice for one query: the `top` best-scored keys (all, when fewer), best
    first, ties to the smaller index -> indices."""
    if not keys.shape[0]:
        return torch.zeros(0, dtype=torch.long, device=keys.device)
    return top_k(index_scores(q, weights, keys, scale)[None], min(top, keys.shape[0]))[0]


@dataclass(frozen=True, slots=True)
class Shape:
    """One layer's dimensions. `rate` 0: the sliding window alone; `overlap`: CSA (two series,
    an indexer), else HCA."""
    heads: int
    head_dim: int
    rope_dim: int
    window: int
    groups: int
    eps: float
    rate: int = 0
    overlap: bool = False
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0


def fresh_state(width: int, rate: int, overlap: bool, dtype: torch.dtype):
    """A compressor's state before its first position (a series of `width` values): zeros. A
    window is full whenever it closes, and the previous window the first entry would read is
    masked by position (`walk`), so no state holds an empty slot's -inf (a state is finite)."""
    c = 2 * width if overlap else width
    return tuple(torch.zeros(rate, c, dtype=dtype) for _ in range(4 if overlap else 2)) + (() if overlap else (None, None))


def step(w: dict, shape: Shape, state: dict, h: torch.Tensor, t: int, main, compress) -> tuple[torch.Tensor, dict]:
    """The definition of one position t of one layer, from a session's state: normed input h [D]
    -> (output [D], the state after t). The state: "rows" [t, d] (every earlier position's row),
    and a compressing layer's "entries" [t, d] (one row a position, `walk`'s) and "compressor"
    (its state), with CSA the indexer's "keys" and "indexer" too (empty at the first position:
    `fresh_state`). `main`, `compress`: (cos, sin) tables of the two rotations (a sliding-window
    layer's rows and queries take `main`; a compressing layer's, and its entries, `compress`).
    `w`: the layer's weights by role (q_a, q_a_norm, q_b, kv, kv_norm, sinks, o_a, o_b; the
    compressor's c_kv, c_gate, c_bias, c_norm; the indexer's i_kv, i_gate, i_bias, i_norm,
    i_q_b, i_weights)."""
    state = dict(state)
    H, d, eps, m = shape.heads, shape.head_dim, shape.eps, shape.rate
    cos, sin = compress if m else main
    at = slice(t, t + 1)
    q_residual = rms_norm(h @ w["q_a"].T, w["q_a_norm"], eps)
    q = rotate_tail(rms_norm((q_residual @ w["q_b"].T).view(1, H, d), None, eps), cos[at], sin[at])[0]
    row = rotate_tail(rms_norm(h @ w["kv"].T, w["kv_norm"], eps)[None], cos[at], sin[at])
    state["rows"] = torch.cat([state["rows"], row])
    visible = [state["rows"][max(0, t - shape.window + 1):t + 1]]
    if m:
        for name, log, p in (("compressor", "entries", "c_"), ("indexer", "keys", "i_"))[:1 + shape.overlap]:
            kv, gate = h @ w[p + "kv"].T, h @ w[p + "gate"].T + w[p + "bias"][t % m]
            rows, state[name] = walk(kv[None], gate[None], state[name], t, m, shape.overlap, w[p + "norm"], eps, *compress)
            state[log] = torch.cat([state[log], rows])
        entries = closed(state["entries"], t, m)
        if shape.overlap:
            qi = rotate_tail((q_residual @ w["i_q_b"].T).view(1, shape.index_heads, shape.index_dim),
                             compress[0][at], compress[1][at])[0]
            weights = (h @ w["i_weights"].T) * shape.index_heads ** -0.5
            entries = entries[choose(qi, weights, closed(state["keys"], t, m), shape.index_topk, shape.index_dim ** -0.5)]
        visible.append(entries)
    o = sink_attention(q, torch.cat(visible), w["sinks"], d ** -0.5)
    o = rotate_tail(o[None], cos[at], sin[at], inverse=True).reshape(1, H * d)
    return grouped_output(o, w["o_a"], w["o_b"], shape.groups)[0], state


# ---- a chunk at once: fast mode's forms, each the same map as its position-by-position twin ------

def walk_chunk(kv, gate, state, start: int, rate: int, overlap: bool, norm, eps: float, cos, sin):
    """`walk` over a chunk at once (the state after its last position only): the chunk's rows
    after the open window's earlier ones, cut into whole windows, every entry closed in one
    softmax. -> (rows [T, d], state)."""
    window_kv, window_gate, previous_kv, previous_gate = state
    T, c = kv.shape
    d = c // 2 if overlap else c
    held = start % rate                                   # the open window's positions before the chunk
    base = start - held
    seq_kv = torch.cat([window_kv[:held], kv.to(window_kv.dtype)])          # in the state's dtype, as `walk`
    seq_gate = torch.cat([window_gate[:held], gate.to(window_gate.dtype)])
    n = (held + T) // rate                                # windows the chunk closes
    rows = kv.new_zeros(T, d)
    if n:
        full_kv = seq_kv[:n * rate].view(n, rate, c)
        full_gate = seq_gate[:n * rate].view(n, rate, c)
        if overlap:
            first = base == 0                             # the very first window has no previous one
            before_kv = torch.cat([previous_kv[None], full_kv[:-1]])[..., :d]
            before_gate = torch.cat([previous_gate[None], full_gate[:-1]])[..., :d]
            if first:
                before_gate = before_gate.clone()
                before_gate[0] = float("-inf")
            slot_kv = torch.cat([before_kv, full_kv[..., d:]], dim=1)           # [n, 2·rate, d]
            slot_gate = torch.cat([before_gate, full_gate[..., d:]], dim=1)
        else:
            slot_kv, slot_gate = full_kv, full_gate
        entries = rms_norm((torch.softmax(slot_gate, dim=1) * slot_kv).sum(1), norm, eps)
        firsts = base + rate * torch.arange(n, device=kv.device)
        entries = rotate_tail(entries, cos[firsts], sin[firsts])
        closing = firsts + rate - 1 - start                                     # their rows in the chunk
        rows[closing] = entries.to(rows.dtype)
        if overlap:
            previous_kv, previous_gate = full_kv[-1], full_gate[-1]
    last = min(T, rate)                                   # each slot's latest position
    latest = torch.arange(start + T - last, start + T, device=kv.device) % rate
    window_kv, window_gate = window_kv.clone(), window_gate.clone()
    window_kv[latest], window_gate[latest] = kv[-last:].to(window_kv.dtype), gate[-last:].to(window_gate.dtype)
    return rows, (window_kv, window_gate, previous_kv, previous_gate)


TILE = 128          # queries a tile of `attend_chunk` and `choose_chunk`: their logits and picks are per tile


def attend_chunk(q, rows, first: int, start: int, window: int, sinks, scale: float, entries=None, rate: int = 0,
                 chosen=None):
    """Every query of a chunk: q [T, H, d] at positions start..start+T-1 over rows [S, d]
    (position `first` on), each within its window, and entries [n, d] of which query t sees
    w < (t + 1) // rate (all of them, or with `chosen` [T, k] the indexer's picks, -1 for none)
    -> [T, H, d]. The same map as `sink_attention` a query; queries go `TILE` at a time, each
    tile over the rows its windows reach (the logits of a tile, not of the chunk, are held)."""
    outs = []
    for a in range(0, q.shape[0], TILE):
        b = min(a + TILE, q.shape[0])
        lo = max(first, start + a - window + 1)                     # the tile's first row
        outs.append(_attend_tile(q[a:b], rows[lo - first:start + b - first], lo, start + a, window, sinks, scale,
                                 entries, rate, None if chosen is None else chosen[a:b]))
    return torch.cat(outs)


def _attend_tile(q, rows, first: int, start: int, window: int, sinks, scale: float, entries, rate: int, chosen):
    T, S = q.shape[0], rows.shape[0]
    at = start + torch.arange(T, device=q.device)
    row_at = first + torch.arange(S, device=q.device)
    seen = (row_at[None] <= at[:, None]) & (row_at[None] > at[:, None] - window)            # [T, S]
    rows = rows.to(q.dtype)
    logits = [torch.einsum("thd,sd->ths", q, rows).masked_fill(~seen[:, None], float("-inf")) * scale]
    keys = None
    if entries is not None and entries.shape[0]:
        if chosen is None:                  # HCA: every closed entry
            keys = entries.to(q.dtype)
            valid = torch.arange(keys.shape[0], device=q.device)[None] < ((at + 1) // rate)[:, None]
            logits.append(torch.einsum("thd,nd->thn", q, keys).masked_fill(~valid[:, None], float("-inf")) * scale)
        else:                               # CSA: each query's picks
            keys = entries.to(q.dtype)[chosen.clamp(min=0)]                                 # [T, k, d]
            logits.append(torch.einsum("thd,tkd->thk", q, keys).masked_fill(~(chosen >= 0)[:, None], float("-inf"))
                          * scale)
    logits.append(sinks.to(q.dtype)[None, :, None].expand(T, -1, 1))
    weights = torch.softmax(torch.cat(logits, dim=-1), dim=-1)
    out = torch.einsum("ths,sd->thd", weights[..., :S], rows)
    if keys is not None:
        shared = "thn,nd->thd" if chosen is None else "thk,tkd->thd"
        out = out + torch.einsum(shared, weights[..., S:-1], keys)
    return out


def choose_chunk(q, weights, keys, start: int, rate: int, top: int, scale: float) -> torch.Tensor:
    """`choose` for every query of a chunk, `TILE` at a time: q [T, H, c], weights [T, H], keys
    [n, c] -> [T, k] (k = min(top, n)): query t's best of the keys it sees, best first, ties to
    the smaller index, -1 past the ones it sees."""
    T, n = q.shape[0], keys.shape[0]
    keys, picks = keys.to(q.dtype), []
    for a in range(0, T, TILE):
        b = min(a + TILE, T)
        at = start + torch.arange(a, b, device=q.device)
        seen = torch.arange(n, device=q.device)[None] < ((at + 1) // rate)[:, None]
        scores = (F.relu(torch.einsum("thc,nc->thn", q[a:b], keys)) * scale * weights[a:b, :, None]).sum(1)
        picked = top_k(scores.masked_fill(~seen, float("-inf")), min(top, n))
        picks.append(torch.where(seen.gather(1, picked), picked, -1))
    return torch.cat(picks)
