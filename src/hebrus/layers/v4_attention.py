"""DeepSeek-V4's attention, three mixer kinds over one section: `swa` (the sliding window alone),
`hca` (and every entry of a heavily compressing compressor) and `csa` (and the entries a
lightning indexer chooses from a compressor of two overlapping series). The math is `ops.v4`'s;
this file is its state: each position's shared K = V row, and a compressing layer's entries
and the indexer's keys, are appended owners (an entry and a key a position: zeros, but at the
position that closes a window); the partial windows a compressor has not closed yet (each
slot's projections and gates) are banked owners, so a chunk that ends inside a window leaves
exactly the state a longer chunk passes through, and any chunking gives the same bits.

Positions are read on the host (`StepBatch.starts`): the kinds take eager steps only (a
planned step's positions live on the device; `host_positions` says so to the step runner).
Exact mode runs the definition position by position; fast mode a chunk at once (`walk_chunk`,
`choose_chunk`, `attend_chunk`: every window the chunk closes in one softmax, every query's
picks and attention in one product each), the same maps to rounding."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch

from hebrus.layers.kernels import Kernels
from hebrus.layers.kind import Cost, Kind, divided, own, spans
from hebrus.layers.sublayer import Sublayer
from hebrus.ops.norm import rms_norm
from hebrus.ops.v4 import (Yarn, attend_chunk, choose, choose_chunk, closed, grouped, interleaved_tables,
                           rotate_tail, sink_attention, walk, walk_chunk)
from hebrus.state.context import StepContext
from hebrus.state.owners import APPENDED, BANKED, OwnerSpec
from hebrus.state.step import StepBatch


@dataclass(frozen=True, slots=True)
class V4AttentionSection:
    key: ClassVar[str] = "v4_attention"
    heads: int
    head_dim: int
    rope_dim: int            # the trailing values of a row or a head that rotate
    q_rank: int
    window: int              # positions a query sees in its window, itself included
    groups: int              # the output projection's groups
    group_rank: int
    theta: float             # a sliding-window layer's rotation
    compress_theta: float    # a compressing layer's (its rows, queries, entries and the indexer's)
    hca_rate: int = 0
    csa_rate: int = 0
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    # YaRN on the compressing layers' rotation (`ops.v4.Yarn`): factor 0 is none
    yarn_factor: float = 0.0
    yarn_original: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_truncate: bool = True
    yarn_attention: float = 1.0

    def yarn(self) -> Yarn | None:
        if not self.yarn_factor:
            return None
        return Yarn(self.yarn_factor, self.yarn_original, self.yarn_beta_fast, self.yarn_beta_slow, self.yarn_truncate,
                    self.yarn_attention)

    def problems(self, s):
        if min(self.heads, self.head_dim, self.q_rank, self.window, self.groups, self.group_rank) < 1:
            yield "v4_attention: heads, head_dim, q_rank, window, groups and group_rank must be at least 1"
        if self.rope_dim % 2 or not 0 < self.rope_dim <= min(self.head_dim, self.index_dim or self.head_dim):
            yield (f"v4_attention: rope_dim ({self.rope_dim}) must be even, at least 2 and at most head_dim "
                   f"({self.head_dim}) and index_dim ({self.index_dim})")
        if self.heads * self.head_dim % self.groups:
            yield f"v4_attention: heads × head_dim ({self.heads * self.head_dim}) must split into {self.groups} groups"
        if self.hca_rate < 0 or self.csa_rate < 0:
            yield "v4_attention: compress rates must be at least 0"
        if self.csa_rate and min(self.index_heads, self.index_dim, self.index_topk) < 1:
            yield "v4_attention: a CSA layer's indexer needs index_heads, index_dim and index_topk of at least 1"
        if self.yarn_factor and (self.yarn_factor < 0 or self.yarn_original < 1 or self.yarn_beta_slow <= 0
                                 or self.yarn_beta_fast <= 0):
            yield "v4_attention: YaRN needs a positive factor, original context and betas"


def rotary(shared: dict, s, theta: float, like: torch.Tensor, yarn: Yarn | None = None):
    """The interleaved rotation's (cos, sin) for every position up to max_context, one per theta
    (and YaRN) for the model (`shared`)."""
    key = ("v4_rotary", theta, yarn)
    if key not in shared:
        shared[key] = interleaved_tables(s.section(V4AttentionSection).rope_dim, theta, s.max_context,
                                         like.dtype, like.device, yarn)
    return shared[key]


class V4Attention(Sublayer):
    host_positions = True               # eager steps only: positions read on the host

    def __init__(self, s, params, layer: int, kernels: Kernels, kind: "SlidingAttention", shared: dict):
        super().__init__(s, params, layer, "mixer", kernels)
        a = self.a = s.section(V4AttentionSection)
        self.name, self.rate, self.overlap = f"layers.{layer}.{kind.name}", kind.rate(a), kind.overlap
        prefix = self.name + "."
        self.w = {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}
        self.linear, self.norm_eps = kernels.linear, s.rms_norm_eps
        self.compress = rotary(shared, s, a.compress_theta, params["embed.weight"], a.yarn())
        self.tables = self.compress if self.rate else rotary(shared, s, a.theta, params["embed.weight"])
        self.banked = kind.banked(prefix)

    def run(self, txn: StepContext, batch: StepBatch) -> None:
        kept = ("rows", "entries", "keys")[:1 + bool(self.rate) + self.overlap]
        logs = {name: txn.rows(self.name + "." + name) for name in kept}
        state = tuple(txn.read(name) for name in self.banked) or None
        state = self.framed(batch, lambda at, h, state, each=False: self._attend(at, h, state, logs, each), state)
        write = txn.write_each if batch.keeps else txn.write
        for name, value in zip(self.banked, state or ()):
            write(name, value)

    def _attend(self, at: StepBatch, h: torch.Tensor, state, logs, each: bool):
        """Several sessions' tokens: each session's own, its state its row of `state`."""
        if at.sessions == 1:
            return self._session(at, h, state, logs, each)
        outs, states = [], []
        for i in range(at.sessions):
            mine = None if state is None else tuple(x[i] for x in state)
            y, mine = self._session(at.session(i), at.rows_of(i, h), mine, logs, False)
            outs.append(y)
            states.append(mine)
        return torch.cat(outs), None if state is None else tuple(torch.stack(x) for x in zip(*states))

    def _session(self, at: StepBatch, h: torch.Tensor, state, logs, each: bool):
        """One session's chunk h [T, D] from `state` -> (y [T, D], its state after the chunk, or
        with `each` after every token)."""
        if at.starts is None:
            raise RuntimeError("DeepSeek-V4 attention reads positions on the host: it runs eager steps only")
        a, w, T, start, m, eps = self.a, self.w, h.shape[0], at.starts[0], self.rate, self.norm_eps
        H, d = a.heads, a.head_dim
        cos, sin = (t[start:start + T] for t in self.tables)
        q_residual = rms_norm(self.linear(h, w["q_a.weight"]), w["q_a_norm.weight"], eps)
        q = rotate_tail(rms_norm(self.linear(q_residual, w["q_b.weight"]).view(T, H, d), None, eps), cos, sin)
        at.put(logs["rows"], rotate_tail(rms_norm(self.linear(h, w["kv.weight"]), w["kv_norm.weight"], eps), cos, sin))
        if m:
            state = self._walk(at, h, state, logs, each)
            if self.overlap:
                qi = self.linear(q_residual, w["indexer.q_b.weight"]).view(T, a.index_heads, a.index_dim)
                qi = rotate_tail(qi, cos, sin)
                weights = self.linear(h, w["indexer.weights.weight"]) * a.index_heads ** -0.5
        rows = at.visible(logs["rows"][at.which[0]])
        entries = at.visible(logs["entries"][at.which[0]]) if m else None
        keys = at.visible(logs["keys"][at.which[0]]) if self.overlap else None
        if self.kernels.whole_chunk:            # every query at once
            first = max(0, start - a.window + 1)
            closed_all = None if not m else closed(entries, start + T - 1, m)
            chosen = None
            if self.overlap:
                chosen = choose_chunk(qi, weights, closed(keys, start + T - 1, m), start, m, a.index_topk,
                                      a.index_dim ** -0.5)
            o = attend_chunk(q, rows[first:], first, start, a.window, w["sinks"], d ** -0.5, closed_all, m, chosen)
        else:                                   # the definition, a query at a time
            outs = []
            for j in range(T):
                t = start + j
                seen = [rows[max(0, t - a.window + 1):t + 1]]
                if m:
                    mine = closed(entries, t, m)
                    if self.overlap:
                        mine = mine[choose(qi[j], weights[j], closed(keys, t, m), a.index_topk, a.index_dim ** -0.5)]
                    seen.append(mine)
                outs.append(sink_attention(q[j], torch.cat(seen).to(q.dtype), w["sinks"], d ** -0.5))
            o = torch.stack(outs)
        o = rotate_tail(o, cos, sin, inverse=True).reshape(T, H * d)
        return self.linear(grouped(o, w["o_a.weight"], a.groups), w["o_b.weight"]), state

    def _walk(self, at: StepBatch, h: torch.Tensor, state, logs, each: bool):
        """The compressor's (and CSA's indexer's) projections of the chunk through their partial
        windows: their entries (keys) appended, the state after the chunk (or every token)."""
        w, start, m, cos, sin = self.w, at.starts[0], self.rate, *self.compress
        slot = torch.arange(start, start + h.shape[0], device=h.device) % m
        out = []
        parts = (("compressor.", "entries"), ("indexer.", "keys"))[:1 + self.overlap]
        per = 4 if self.overlap else 2             # window kv and gate, and CSA's previous window's
        for i, (p, log) in enumerate(parts):
            mine = state[i * per:(i + 1) * per]
            walked = mine if self.overlap else mine + (None, None)
            kv, gate = self.linear(h, w[p + "kv.weight"]), self.linear(h, w[p + "gate.weight"]) + w[p + "bias"][slot]
            fold = walk_chunk if self.kernels.whole_chunk and not each else partial(walk, each=each)
            rows, walked = fold(kv, gate, walked, start, m, self.overlap, w[p + "norm.weight"], self.norm_eps, cos, sin)
            at.put(logs[log], rows)
            out += walked[:per]
        return tuple(out)


class SlidingAttention(Kind):
    """`swa`: the sliding window alone; `hca` and `csa` add a compressor."""
    name = "swa"
    role = "mixer"
    section = V4AttentionSection
    quantized = ("q_a.weight", "q_b.weight", "kv.weight", "o_b.weight")
    wide = ("sinks",)
    outputs = ("o_b.weight",)
    overlap: ClassVar[bool] = False
    shards = "split"        # by query heads and the output's groups; K = V rows, compressor, indexer whole

    def shard_section(self, section, world):
        return dataclasses.replace(section, heads=divided("query heads", section.heads, world),
                                   groups=divided("output projection's groups", section.groups, world))

    def shard_weight(self, s, leaf, weight, rank, world):
        """q_b's rows and the sinks of the rank's heads; o_a's rows and o_b's columns of its groups
        (group g reads heads' values g·H·d/G onwards: the rank's groups read its heads' alone);
        q_a, the K = V row's projection, the compressor, the indexer and the norms whole."""
        a = s.section(V4AttentionSection)
        heads, groups = a.heads // world, a.groups // world
        if leaf == "q_b.weight":
            return spans(weight, 0, own(rank, heads * a.head_dim))
        if leaf == "sinks":
            return spans(weight, 0, own(rank, heads))
        if leaf == "o_a.weight":
            return spans(weight, 0, own(rank, groups * a.group_rank))
        if leaf == "o_b.weight":
            return spans(weight, 1, own(rank, groups * a.group_rank))
        return weight

    def rate(self, a: V4AttentionSection) -> int:
        return 0

    def weights(self, s, prefix):
        a, D = s.section(V4AttentionSection), s.hidden_size
        H, d = a.heads, a.head_dim
        return {f"{prefix}q_a.weight": (a.q_rank, D), f"{prefix}q_a_norm.weight": (a.q_rank,),
                f"{prefix}q_b.weight": (H * d, a.q_rank), f"{prefix}kv.weight": (d, D), f"{prefix}kv_norm.weight": (d,),
                f"{prefix}sinks": (H,), f"{prefix}o_a.weight": (a.groups * a.group_rank, H * d // a.groups),
                f"{prefix}o_b.weight": (D, a.groups * a.group_rank)} | self._compressors(s, prefix)

    def _compressors(self, s, prefix) -> dict:
        return {}

    def banked(self, prefix: str) -> tuple[str, ...]:
        """Its banked owners, in the order the stage reads them."""
        return ()

    def owners(self, s, prefix, dtype, state_dtype):
        """A row a position; a compressing layer's entries (and CSA's indexer keys) a row a
        position too, and its partial windows banked."""
        a = s.section(V4AttentionSection)
        return [OwnerSpec(prefix + "rows", (a.head_dim,), dtype, APPENDED)] + self._state(s, prefix, dtype, state_dtype)

    def _state(self, s, prefix, dtype, state_dtype) -> list:
        return []

    def init(self, leaf, shape, gen):
        return None

    def stage(self, s, params, layer, kernels, shared):
        return V4Attention(s, params, layer, kernels, self, shared)

    def cost(self, s, position):
        """Each head's scores over the window's rows and the entries it attends to, and their sum."""
        a = s.section(V4AttentionSection)
        window = min(a.window, position + 1)
        return Cost(rows={"rows": window}, flops=4 * a.heads * a.head_dim * window)


class HeavilyCompressed(SlidingAttention):
    name = "hca"
    wide = ("sinks", "compressor.bias")

    def rate(self, a):
        return a.hca_rate

    def width(self, a) -> int:
        """Values a position projects for an entry: one series, or two (CSA)."""
        return a.head_dim * (2 if self.overlap else 1)

    def _compressors(self, s, prefix):
        a, D = s.section(V4AttentionSection), s.hidden_size
        c, m = self.width(a), self.rate(a)
        return {f"{prefix}compressor.kv.weight": (c, D), f"{prefix}compressor.gate.weight": (c, D),
                f"{prefix}compressor.bias": (m, c), f"{prefix}compressor.norm.weight": (a.head_dim,)}

    def banked(self, prefix):
        return (prefix + "window_kv", prefix + "window_gate")

    def _state(self, s, prefix, dtype, state_dtype):
        a = s.section(V4AttentionSection)
        m, c = self.rate(a), self.width(a)
        return [OwnerSpec(prefix + "entries", (a.head_dim,), dtype, APPENDED),
                OwnerSpec(prefix + "window_kv", (m, c), state_dtype, BANKED),
                OwnerSpec(prefix + "window_gate", (m, c), state_dtype, BANKED)]

    def cost(self, s, position):
        a = s.section(V4AttentionSection)
        window, entries = min(a.window, position + 1), (position + 1) // self.rate(a)
        return Cost(rows={"rows": window, "entries": entries}, flops=4 * a.heads * a.head_dim * (window + entries))


class CompressedSparse(HeavilyCompressed):
    name = "csa"
    wide = ("sinks", "compressor.bias", "indexer.bias")
    overlap = True

    def rate(self, a):
        return a.csa_rate

    def _compressors(self, s, prefix):
        a, D = s.section(V4AttentionSection), s.hidden_size
        ci, m = a.index_dim, a.csa_rate
        return super()._compressors(s, prefix) | {
            f"{prefix}indexer.kv.weight": (2 * ci, D), f"{prefix}indexer.gate.weight": (2 * ci, D),
            f"{prefix}indexer.bias": (m, 2 * ci), f"{prefix}indexer.norm.weight": (ci,),
            f"{prefix}indexer.q_b.weight": (a.index_heads * ci, a.q_rank),
            f"{prefix}indexer.weights.weight": (a.index_heads, D)}

    def banked(self, prefix):
        return tuple(prefix + f"{series}{part}" for series in ("", "index_")
                     for part in ("window_kv", "window_gate", "previous_kv", "previous_gate"))

    def _state(self, s, prefix, dtype, state_dtype):
        a = s.section(V4AttentionSection)
        m, widths = a.csa_rate, {"": 2 * a.head_dim, "index_": 2 * a.index_dim}
        owners = [OwnerSpec(prefix + "entries", (a.head_dim,), dtype, APPENDED),
                  OwnerSpec(prefix + "keys", (a.index_dim,), dtype, APPENDED)]
        for name in self.banked(prefix):
            series = "index_" if name.removeprefix(prefix).startswith("index_") else ""
            owners.append(OwnerSpec(name, (m, widths[series]), state_dtype, BANKED))
        return owners

    def cost(self, s, position):
        a = s.section(V4AttentionSection)
        window, entries = min(a.window, position + 1), (position + 1) // a.csa_rate
        chosen = min(entries, a.index_topk)
        return Cost(rows={"rows": window, "entries": chosen, "keys": entries},
                    flops=4 * a.heads * a.head_dim * (window + chosen) + 2 * a.index_heads * a.index_dim * entries)
