"""Gated attention over append-only K/V rows, two mixer kinds sharing one section: `qsa` over
the rows an indexer selects (its index keys are rows too), `attention` over every row. Both
rotate the first `rotary_dim` features of each head (partial rotary), with tables built over
those features only."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
import torch.nn.functional as F

from hebrus.layers.checks import Check
from hebrus.layers.kernels import Kernels, unfused
from hebrus.layers.kind import Cost, Kind, divided, normal, own, spans
from hebrus.layers.sublayer import Sublayer
from hebrus.ops.norm import layer_norm
from hebrus.ops.qsa import (dense_attention, dense_attention_fast, dense_attention_lanes, index_scores, select,
                            sigmoid_gated, sparse_attention)
from hebrus.ops.quant import CACHE_DTYPES, Products, QuantizedRows, dense, quantize_rows
from hebrus.ops.rope import apply_rope, normed_rotated, rope_tables
from hebrus.state.context import StepContext
from hebrus.state.step import StepBatch
from hebrus.state.owners import APPENDED, OwnerSpec


QUERY_BLOCK = 1024      # queries of a chunk scored and attended together (bounds a long chunk's memory)
# a step of several sessions' chunks attends token by token while its tokens read at most this many
# bytes of K/V rows a session on average: each token reads its rows [0, position] for itself, where attention
# over one session's chunk reads them once for a block of its queries; below it, a call a session
# costs the host more than the reads cost the device (an estimate, to be measured)
LANES_READ = 256 << 20
DENSE = "attention.dense"               # (q, k_rows, v_rows, positions) -> o: attention over every row
LANES = "attention.lanes"               # (q, k_blocks, v_blocks, tables, positions, gate=None) -> o: N
                                        # sessions' single queries, each over its rows through its block
                                        # table; with `gate`, o ⊙ σ(gate)
SPARSE = "attention.sparse"             # (q, k_rows, v_rows, picked, valid) -> o: over the picked rows
ROTATE = "attention.rotate"             # (q, k, q_norm, k_norm, cos, sin, eps, into=None) -> (q, k) normed and
                                        # rotated, or None where it does not take them; with `into` = (v,
                                        # k_cache, v_cache, blocks, offsets) k's and v's rows written there too
INDEX_INPUT = "attention.index_input"   # h -> what the indexer reads (training: cut from the trunk's gradient)
PROJECTED = ("q_proj.weight", "gate_proj.weight", "k_proj.weight", "v_proj.weight")     # of h, side by side
INDEXED = ("index_q.weight", "index_k.weight", "index_w.weight")                         # of the indexer's input


@dataclass(frozen=True, slots=True)
class AttentionSection:
    """Heads and rotary width; the indexer's heads, width and top_k (qsa only)."""
    key: ClassVar[str] = "attention"
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float = 10000.0
    index_heads: int = 1
    index_dim: int = 2
    top_k: int = 1

    def problems(self, s):
        if self.heads % self.kv_heads:
            yield f"attention heads ({self.heads}) must be a multiple of its K/V heads ({self.kv_heads})"
        if self.rotary_dim % 2 or not 2 <= self.rotary_dim <= self.head_dim:
            yield f"the rotary width ({self.rotary_dim}) must be even and at most the head dim ({self.head_dim})"
        if "qsa" in s.mixers:
            if self.index_dim % 2:
                yield f"the index dim ({self.index_dim}) must be even (rotary embedding)"
            if self.top_k > s.max_context:
                yield f"top_k={self.top_k} exceeds max_context={s.max_context}"

    def unused(self, s) -> tuple[str, ...]:
        """The indexer's fields, without qsa layers."""
        return () if "qsa" in s.mixers else ("index_heads", "index_dim", "top_k")


class RotaryTables:
    """cos/sin tables for every position up to `max_context`, built once per model and per
    rotary width, and shared by every layer that rotates that width. A table of width r rotates
    the first r features of a head (partial rotary) with frequencies over those r features."""

    def __init__(self, s, like: torch.Tensor):
        self.theta, self.positions = s.section(AttentionSection).rope_theta, s.max_context
        self.dtype, self.device = like.dtype, like.device
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        if dim not in self._tables:
            self._tables[dim] = rope_tables(dim, self.theta, self.positions, self.dtype, self.device)
        return self._tables[dim]


class Attention:
    """Gated attention; with `indexed`, over the top_k rows the indexer scores highest."""

    def __init__(self, s, params: dict[str, torch.Tensor], prefix: str, rotary: RotaryTables,
                 kernels: Kernels, indexed: bool):
        a = s.section(AttentionSection)
        w = {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}
        self.w, self.choose, self.site, self.indexed = w, kernels.choose, prefix.removesuffix("."), indexed
        self.project = Products(*(w[name] for name in PROJECTED), together=kernels.together,
                                linear=kernels.linear)                                    # -> q, gate, k, v
        self.index_project = (Products(*(w[name] for name in INDEXED), together=kernels.together, linear=kernels.linear)
                              if indexed else None)                                              # -> qi, ki, iw
        self.attend, self.sparse_attend, self.fused = kernels.ops[DENSE], kernels.ops[SPARSE], kernels.fused
        self.linear = kernels.linear
        self.attend_lanes, self.rotate = kernels.ops.get(LANES), kernels.ops.get(ROTATE)
        self.index_input = kernels.ops[INDEX_INPUT]
        self.hq, self.hkv, self.dh = a.heads, a.kv_heads, a.head_dim
        self.hi, self.di, self.top_k = a.index_heads, a.index_dim, a.top_k
        self.cache, self.parts = s.kv_cache, 3 if indexed else 2      # quantized rows: scales after codes
        self.eps = s.rms_norm_eps
        self.rope = rotary(a.rotary_dim)
        self.index_rope = rotary(self.di) if indexed else None

    def __call__(self, h: torch.Tensor, span: StepBatch, rows, check_range) -> torch.Tensor:
        """h [T, D] at the positions of `span` (`state.step`). Writes their rows of the row logs
        (k, v and, indexed, index; `rows` holds each log's one per session), then each session
        attends over its rows [0, position]. `check_range` takes the device-side check that no
        query picked a row past its own position."""
        T, w = h.shape[0], self.w
        cos, sin = (span.take(t) for t in self.rope)
        q, gate, k, v = self.project(h)
        q = self._rotated_put(span, rows, q.view(T, self.hq, self.dh), k.view(T, self.hkv, self.dh),
                              v.view(T, self.hkv, self.dh), cos, sin)
        if self.indexed:
            hi = self.index_input(h)
            qi, ki, iw = self.index_project(hi)
            qi = qi.view(T, self.hi, self.di)
            ki = layer_norm(ki, w["index_k_norm.weight"], w["index_k_norm.bias"], self.eps)
            icos, isin = (span.take(t) for t in self.index_rope)
            qi, ki = (self.fused(apply_rope)(x, icos, isin) for x in (qi, ki))
            self._put(span, rows, 2, ki)
        if span.token_a_lane and not self.indexed and self.attend_lanes is not None:
            gated = self._lanes(span, q, rows, gate.view(T, self.hq, self.dh))
            return self.linear(gated.flatten(1), w["o_proj.weight"])
        placed = self._placed(span, rows)
        if placed is not None:                # several sessions' chunks: each token a lane, in one call
            k_log, v_log = (r[span.which[0]] for r in rows[:2])
            gated = self.attend_lanes(q, k_log.storage, v_log.storage, placed.tables, span.positions,
                                      gate.view(T, self.hq, self.dh))
            return self.linear(gated.flatten(1), w["o_proj.weight"])
        outs, past = [], []
        for i in range(span.sessions):        # each session over its own rows
            mine, logs, cut = span.session(i) if span.sessions > 1 else span, [r[span.which[i]] for r in rows], span.rows_of
            if self.indexed:
                o, over = self._sparse(mine, cut(i, qi), cut(i, iw), cut(i, q), logs)
                past.append(over)
            else:
                k_rows, v_rows = (dense(self._view(logs, part, mine.visible, q.dtype)) for part in (0, 1))
                o = self.attend(cut(i, q), k_rows, v_rows, mine.positions)
            outs.append(o)
        if past:                              # sessions see different numbers of rows: pad with 0 (in range)
            width = max(p.shape[1] for p in past)
            check_range(torch.cat([F.pad(p, (0, width - p.shape[1])) for p in past]), 1, Check.INDEX_RANGE,
                        lower=None)
        o = torch.cat(outs) if len(outs) > 1 else outs[0]
        gated = self.fused(sigmoid_gated)(o, gate.view(T, self.hq, self.dh))
        return self.linear(gated.flatten(1), w["o_proj.weight"])

    def _rotated(self, q, k, cos, sin):
        """q and k each normed per head and rotated: in one op where the table has one that takes
        them (`ROTATE`), else each through the fused twin."""
        w = self.w
        both = None if self.rotate is None else self.rotate(q, k, w["q_norm.weight"], w["k_norm.weight"], cos, sin,
                                                              self.eps)
        if both is None:
            rotate = self.fused(normed_rotated)
            both = rotate(q, w["q_norm.weight"], cos, sin, self.eps), rotate(k, w["k_norm.weight"], cos, sin, self.eps)
        return both

    def _rotated_put(self, span: StepBatch, rows, q, k, v, cos, sin) -> torch.Tensor:
        """q and k normed and rotated, and k's and v's rows written -> q. A planned step's lanes
        writing a 16-bit cache do it in one op where the table's `ROTATE` takes them (the logs
        then hear what it wrote, as from their own writes); otherwise rotated, then put."""
        logs = ([span.lanes_log(rows[part]) for part in (0, 1)] if self.rotate is not None and self.cache is None
                else [None])
        if logs[0] is not None:
            w = self.w
            into = (v, logs[0].storage, logs[1].storage, span.blocks, span.offsets)
            both = self.rotate(q, k, w["q_norm.weight"], w["k_norm.weight"], cos, sin, self.eps, into)
            if both is not None:
                for log, value in zip(logs, (both[1], v)):
                    log.wrote_rows(value)
                return both[0]
        q, k = self._rotated(q, k, cos, sin)
        self._put(span, rows, 0, k)
        self._put(span, rows, 1, v)
        return q

    def _placed(self, span: StepBatch, rows):
        """Where an eager step of several sessions' chunks has its tokens' rows (`StepBatch.placed`),
        if it attends token by token, each token a lane over its session's rows through its table
        (one call, where each session would be one): with rows kept as they are (no quantized
        cache), an op for lanes that reads each lane's rows only up to its position (a kernel:
        `reads_to_position`), and its tokens reading no more than `LANES_READ` bytes of rows a
        session on average. Else None."""
        if (self.indexed or self.cache is not None or span.sessions < 2 or span.starts is None
                or not getattr(self.attend_lanes, "reads_to_position", False)):
            return None
        k = rows[0][span.which[0]].storage
        row_bytes = 2 * k[0, 0].numel() * k.element_size()                  # a row of K and of V
        read = sum(n * a + n * (n + 1) // 2 for a, n in zip(span.starts, span.lengths)) * row_bytes
        return span.placed([rows[0][m] for m in span.which]) if read <= LANES_READ * span.sessions else None

    def _lanes(self, span: StepBatch, q: torch.Tensor, rows, gate: torch.Tensor) -> torch.Tensor:
        """A planned step of one token per lane: every lane's rows at once, read through the
        step's tables, each masked past its lane's position, the output gated by `gate`. A
        quantized cache's rows are gathered and made dense first: that copy's blocks, lane after
        lane, are the blocks its tables name."""
        logs = [r[0] for r in rows]             # any lane's log: the storage is the same
        if self.cache is None:
            blocks, tables = [logs[part].storage for part in (0, 1)], span.tables
        else:
            k, v = (dense(self._view(logs, part, lambda log: log.lanes(span.tables), q.dtype)) for part in (0, 1))
            (k, tables), (v, _) = span.as_blocks(k), span.as_blocks(v)
            blocks = [k, v]
        return self.attend_lanes(q, *blocks, tables, span.positions, gate)

    def _put(self, span, rows, part: int, value: torch.Tensor) -> None:
        """Write the chunk's rows of row log `part` (0 k, 1 v, 2 index): as they are, or, with a
        quantized cache, their codes and beside them (log `part` + `parts`) their scales."""
        if self.cache is None:
            span.put(rows[part], value)
            return
        codes, scale = quantize_rows(value, self.cache)
        span.put(rows[part], codes)
        span.put(rows[part + self.parts], scale if scale.dim() > 1 else scale[:, None])

    def _view(self, logs, part: int, cut, dtype: torch.dtype):
        """Rows `cut` of one session's row log `part`: a tensor, or with a quantized cache
        `QuantizedRows`."""
        if self.cache is None:
            return cut(logs[part])
        return QuantizedRows.of(cut(logs[part]), cut(logs[part + self.parts]), dtype)

    def _sparse(self, span, qi, iw, q, logs):
        """One session's queries over the rows its indexer picks -> (o, each pick's offset from
        its query's position, which must be ≤ 0). The index keys are read whole (every visible
        row is scored); K and V where they lie (`Log.picking`): only the picked rows are read."""
        T, positions = q.shape[0], span.positions
        if span.starts is not None and T > QUERY_BLOCK:
            # a long chunk, a block of queries at a time over the rows it sees: the scores and
            # their sort take O(block × context) memory, never O(chunk × context)
            blocks = []
            for a in range(0, T, QUERY_BLOCK):
                b, end = min(T, a + QUERY_BLOCK), span.start + min(T, a + QUERY_BLOCK)
                seen = [self._view(logs, 2, lambda r, end=end: r.upto(end), q.dtype),
                        *(self._view(logs, part, lambda r, end=end: r.picking(end), q.dtype) for part in (0, 1))]
                blocks.append(self._pick_and_attend(qi[a:b], iw[a:b], q[a:b], seen, span.start + a, positions[a:b]))
            return tuple(map(torch.cat, zip(*blocks)))
        seen = [self._view(logs, 2, span.visible, q.dtype),
                *(self._view(logs, part, span.picking, q.dtype) for part in (0, 1))]
        return self._pick_and_attend(qi, iw, q, seen, span.start, positions)

    def _pick_and_attend(self, qi, iw, q, rows, start, positions):
        """Queries at `positions` (the first at `start`) over the visible (index, k, v) rows
        (k and v: tensors, or `QuantizedRows` whose picked rows alone are rebuilt)."""
        index_rows, k_rows, v_rows = rows
        picked, valid = self.select(index_scores(qi, iw, dense(index_rows)), start, positions)
        return self.sparse_attend(q, k_rows, v_rows, picked, valid), picked - positions[:, None]

    def select(self, scores: torch.Tensor, start, positions: torch.Tensor):
        """The rows each query attends to: the top_k of its visible scores, the model's chooser
        making the choice (a set: rank order does not matter)."""
        return select(scores, positions, self.top_k, partial(self.choose, self.site, start, ordered=False))


class AttentionMixer(Sublayer):
    """Gated attention over the layer's K/V rows: `qsa` (indexer-selected rows, its index keys
    are rows too) or `attention` (every row)."""

    def __init__(self, s, params, layer: int, kernels: Kernels, rotary: RotaryTables, kind: str):
        super().__init__(s, params, layer, "mixer", kernels)
        self.name = f"layers.{layer}.{kind}"
        self.parts = ("k", "v", "index") if kind == "qsa" else ("k", "v")
        if s.kv_cache is not None:               # a quantized cache: each log's scales after the codes
            self.parts += tuple(part + "_scale" for part in self.parts)
        self.attn = Attention(s, params, self.name + ".", rotary, kernels, indexed=kind == "qsa")
        # sparse attention and a quantized cache gather the lanes' rows up to the width; the
        # lanes' dense attention reads to each lane's position where its op says so
        self.reads_to_width = (self.attn.indexed or self.attn.cache is not None
                               or not getattr(self.attn.attend_lanes, "reads_to_position", False))

    def run(self, txn: StepContext, batch: StepBatch) -> None:
        rows = [txn.rows(f"{self.name}.{part}") for part in self.parts]

        self.framed(batch, lambda at, h, state: (self.attn(h, at, rows, txn.check_range), state), None)


class DenseAttention(Kind):
    """Gated attention over every row."""
    name = "attention"
    role = "mixer"
    section = AttentionSection
    quantized = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight")
    outputs = ("o_proj.weight",)
    keeps_rows = True
    side_by_side = (PROJECTED,)
    logs = ("k", "v")                     # its row logs
    shards = "split"        # by query heads; K/V heads split too, or each rank the one its heads read

    def shard_section(self, section, world):
        heads = divided("query heads", section.heads, world)
        if section.kv_heads % world and world % section.kv_heads:
            raise ValueError(f"its K/V heads ({section.kv_heads}) neither divide among {world} ranks nor "
                             f"divide {world}")
        return dataclasses.replace(section, heads=heads, kv_heads=max(1, section.kv_heads // world))

    def shard_weight(self, s, leaf, weight, rank, world):
        """q, gate and o by query heads; k and v by K/V heads, or (fewer K/V heads than ranks)
        the one K/V head the rank's query heads read; the norms and the indexer (qsa) whole."""
        a = s.section(AttentionSection)
        hq, dh = a.heads // world, a.head_dim
        if leaf in ("q_proj.weight", "gate_proj.weight"):
            return spans(weight, 0, own(rank, hq * dh))
        if leaf == "o_proj.weight":
            return spans(weight, 1, own(rank, hq * dh))
        if leaf in ("k_proj.weight", "v_proj.weight"):
            if a.kv_heads % world == 0:
                return spans(weight, 0, own(rank, a.kv_heads // world * dh))
            return spans(weight, 0, own(rank * hq // (a.heads // a.kv_heads), dh))
        return weight

    def weights(self, s, prefix):
        a, D = s.section(AttentionSection), s.hidden_size
        Hq, Hkv, dh = a.heads, a.kv_heads, a.head_dim
        return {
            f"{prefix}q_proj.weight": (Hq * dh, D),
            f"{prefix}gate_proj.weight": (Hq * dh, D),
            f"{prefix}k_proj.weight": (Hkv * dh, D),
            f"{prefix}v_proj.weight": (Hkv * dh, D),
            f"{prefix}q_norm.weight": (dh,),
            f"{prefix}k_norm.weight": (dh,),
            f"{prefix}o_proj.weight": (D, Hq * dh),
        }

    def owners(self, s, prefix, dtype, state_dtype):
        """A row a position in each log: K and V [kv_heads, head_dim] (qsa: and the index key
        [index_dim]); with a quantized cache, codes and beside them a float32 scale per row (per
        head of a K/V row)."""
        a = s.section(AttentionSection)
        rows = dtype if s.kv_cache is None else CACHE_DTYPES[s.kv_cache]
        shapes = {"k": (a.kv_heads, a.head_dim), "v": (a.kv_heads, a.head_dim), "index": (a.index_dim,)}
        specs = [OwnerSpec(prefix + log, shapes[log], rows, APPENDED) for log in self.logs]
        if s.kv_cache is not None:
            specs += [OwnerSpec(f"{prefix}{log}_scale", shapes[log][:1] if log != "index" else (1,), torch.float32,
                                APPENDED) for log in self.logs]
        return specs

    def init(self, leaf, shape, gen):
        return None

    def stage(self, s, params, layer, kernels, shared):
        if "rotary" not in shared:
            shared["rotary"] = RotaryTables(s, params["embed.weight"])
        return AttentionMixer(s, params, layer, kernels, shared["rotary"], self.name)

    def cost(self, s, position):
        """Scores and the weighted sum of V over every row before the token."""
        a = s.section(AttentionSection)
        return Cost(flops=4 * a.heads * a.head_dim * position)

    def rotary_widths(self, s) -> set[int]:
        return {s.section(AttentionSection).rotary_dim}

    def ops(self, mode, device, dtype):
        """Dense attention as written, or in fast mode through torch's fused scaled-dot-product
        attention for a chunk and two matrix products for a few queries, and one query per lane
        over rows read through block tables (for a 16-bit model on CUDA, a kernel reading them
        where they lie: `hebrus.ops.cuda.attention_lanes`); sparse attention over the picked
        rows; the indexer reads the layer's input as it is. On CUDA, q's and k's norms and
        rotations also run as one kernel (`hebrus.ops.cuda.rotary`)."""
        dense = dense_attention_fast if mode == "fast" else dense_attention
        ops = {DENSE: dense, SPARSE: sparse_attention, INDEX_INPUT: unfused}
        if mode == "fast":                    # exact mode runs each session alone
            ops[LANES] = dense_attention_lanes
            if device is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
                from hebrus.ops.cuda.attention_lanes import attention_lanes_cuda
                from hebrus.ops.cuda.rotary import normed_rotated_pair
                ops[LANES] = attention_lanes_cuda        # the rows read where they lie
                ops[ROTATE] = normed_rotated_pair        # q's and k's norms and rotations in one kernel
        return ops


class SparseAttention(DenseAttention):
    """Gated attention over the top_k rows an indexer scores highest."""
    name = "qsa"
    logs = ("k", "v", "index")
    side_by_side = (PROJECTED, INDEXED)

    def weights(self, s, prefix):
        a, D = s.section(AttentionSection), s.hidden_size
        return super().weights(s, prefix) | {
            f"{prefix}index_q.weight": (a.index_heads * a.index_dim, D),
            f"{prefix}index_k.weight": (a.index_dim, D),
            f"{prefix}index_k_norm.weight": (a.index_dim,),
            f"{prefix}index_k_norm.bias": (a.index_dim,),
            f"{prefix}index_w.weight": (a.index_heads, D),
        }

    def init(self, leaf, shape, gen):
        return normal(shape, 0.1, gen) if leaf == "index_k_norm.bias" else None

    def cost(self, s, position):
        """The indexer scores every row before the token; attention reads top_k of them."""
        a = s.section(AttentionSection)
        picked = min(a.top_k, position)
        return Cost(rows={"k": picked, "v": picked},
                    flops=2 * a.index_heads * a.index_dim * position + 4 * a.heads * a.head_dim * picked)

    def rotary_widths(self, s) -> set[int]:
        a = s.section(AttentionSection)
        return {a.rotary_dim, a.index_dim}
