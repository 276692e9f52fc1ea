"""Multi-head latent attention (MLA), a mixer kind (Kimi-Linear's layout: no rotary). Each
position appends one latent row, [c ; r]: c the RMS-normed compression of h (`kv_rank` wide), r a
key part every head shares (`rope_dim` wide), far fewer values a token than full K/V rows
(H·(nope + rope + value)). Heads' keys and values come from c through `kv_b_proj` (`ops.mla`):
expanded per row (the definition, exact mode's) or folded into the query and the output
(absorbed: fast mode's for a few queries, a decode step). The query comes from h directly, or
through a normed low-rank pair (`q_rank` > 0). With a quantized cache (`kv_cache`), a row is
kept as codes with one float32 scale beside it (`latent_scale`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from hebrus.layers.kernels import Kernels
from hebrus.layers.kind import Cost, Kind, divided, own, spans
from hebrus.layers.sublayer import Sublayer
from hebrus.ops.mla import absorbed_output, absorbed_query, mla_absorbed, mla_expanded
from hebrus.ops.qsa import dense_attention, dense_attention_fast, dense_attention_lanes
from hebrus.ops.quant import CACHE_DTYPES, Products, QuantizedRows, dense, quantize_rows
from hebrus.state.context import StepContext
from hebrus.state.owners import APPENDED, OwnerSpec
from hebrus.state.step import StepBatch

ATTEND = "mla.attend"           # (q, rows, positions, up, nope, attend) -> o: one session's queries over its latent rows
DENSE = "mla.dense"             # (q, k_rows, v_rows, positions) -> o: the attention both forms run
LANES = "mla.lanes"             # (q, k_blocks, v_blocks, tables, positions) -> o: N lanes' single (absorbed)
                                # queries, each over its rows through its block table
FEW_QUERIES = 16                # fast mode: up to this many queries absorbed, more expanded


@dataclass(frozen=True, slots=True)
class LatentSection:
    key: ClassVar[str] = "mla"
    heads: int
    kv_rank: int
    nope_dim: int           # each head's key part from the latent
    rope_dim: int           # the key part every head shares (unrotated here)
    value_dim: int
    q_rank: int = 0         # 0: the query straight from h
    norm_eps: float = 1e-6  # the latent's and the low-rank query's RMSNorms' (not the model's)

    def problems(self, s):
        return ()

    @property
    def row(self) -> int:
        """The values one position keeps a layer."""
        return self.kv_rank + self.rope_dim


def attend_fast(q, rows, positions, up, nope, attend):
    """Absorbed for a few queries (a decode step: nothing built per row), expanded for a chunk."""
    form = mla_absorbed if q.shape[0] <= FEW_QUERIES else mla_expanded
    return form(q, rows, positions, up, nope, attend)


class LatentAttention(Sublayer):
    reads_to_width = True           # a planned step's lanes read every row their tables hold

    def __init__(self, s, params, layer: int, kernels: Kernels):
        super().__init__(s, params, layer, "mixer", kernels)
        a = s.section(LatentSection)
        self.name = f"layers.{layer}.mla"
        prefix = self.name + "."
        w = {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}
        self.project = Products(w["q_proj.weight"], w["kv_a_proj.weight"], together=kernels.together,
                                linear=kernels.linear)
        self.w, self.a, self.linear, self.latent_eps = w, a, kernels.linear, a.norm_eps
        self.up = w["kv_b_proj.weight"].view(a.heads, a.nope_dim + a.value_dim, a.kv_rank)
        self.attend, self.dense, self.attend_lanes = kernels.ops[ATTEND], kernels.ops[DENSE], kernels.ops.get(LANES)
        self.cache = s.kv_cache

    def run(self, txn: StepContext, batch: StepBatch) -> None:
        rows = txn.rows(self.name + ".latent")
        scales = txn.rows(self.name + ".latent_scale") if self.cache is not None else None
        self.framed(batch, lambda at, h, state: (self._attend(h, at, rows, scales), state), None)

    def _attend(self, h: torch.Tensor, span: StepBatch, rows, scales) -> torch.Tensor:
        """h [T, D] at the positions of `span`: write their latent rows, then each session's
        queries over its rows [0, position]."""
        a, w, T = self.a, self.w, h.shape[0]
        q, kv = self.project(h)
        if a.q_rank:
            q = self.linear(self.rms_norm(q, w["q_norm.weight"], self.latent_eps), w["q_b_proj.weight"])
        q = q.view(T, a.heads, a.nope_dim + a.rope_dim)
        latent = torch.cat([self.rms_norm(kv[:, :a.kv_rank], w["kv_norm.weight"], self.latent_eps), kv[:, a.kv_rank:]], -1)
        if self.cache is None:
            span.put(rows, latent)
        else:                                   # codes, and beside them a scale a row
            codes, scale = quantize_rows(latent, self.cache)
            span.put(rows, codes)
            span.put(scales, scale[:, None])
        if span.token_a_lane and self.attend_lanes is not None:
            return self.linear(self._lanes(q, span, rows, scales).flatten(1), w["o_proj.weight"])
        outs = []
        for i in range(span.sessions):          # each session over its own rows
            mine = span.session(i) if span.sessions > 1 else span
            visible = mine.visible(rows[span.which[i]])
            if self.cache is not None:
                visible = dense(QuantizedRows.of(visible, mine.visible(scales[span.which[i]]), q.dtype))
            outs.append(self.attend(span.rows_of(i, q), visible, mine.positions, self.up, a.nope_dim, self.dense))
        o = torch.cat(outs) if len(outs) > 1 else outs[0]
        return self.linear(o.flatten(1), w["o_proj.weight"])

    def _lanes(self, q: torch.Tensor, span: StepBatch, rows, scales) -> torch.Tensor:
        """A planned step of a token a lane: every lane's absorbed query over its rows at once,
        read through the step's tables (a quantized cache's rows gathered and rebuilt first: that
        copy's blocks, lane after lane, are the blocks its tables name) -> o [N, H, value]."""
        log = rows[0]                           # any lane's log: the storage is the same
        if self.cache is None:
            blocks, tables = log.storage[:, :, None], span.tables                  # [B, R, 1, row]
        else:
            rebuilt, tables = span.as_blocks(dense(QuantizedRows.of(log.lanes(span.tables), scales[0].lanes(span.tables),
                                                                    q.dtype)))
            blocks = rebuilt[:, :, None]
        wide = absorbed_query(q, self.up, self.a.nope_dim)
        return absorbed_output(self.attend_lanes(wide, blocks, blocks, tables, span.positions), self.up, self.a.nope_dim)


class MLA(Kind):
    name = "mla"
    role = "mixer"
    section = LatentSection
    # kv_b_proj stays float: both forms read it per head as a tensor, not through a product
    quantized = ("q_proj.weight", "q_b_proj.weight", "kv_a_proj.weight", "o_proj.weight")
    outputs = ("o_proj.weight",)
    keeps_rows = True                 # a kv-cache format applies to its latent rows
    # q_proj: the query's projection of h, whole or (q_rank > 0) down to the rank, then normed and up (q_b_proj)
    side_by_side = (("q_proj.weight", "kv_a_proj.weight"),)
    shards = "split"            # by heads; the latent row every head reads whole on every rank

    def shard_section(self, section, world):
        return dataclasses.replace(section, heads=divided("heads", section.heads, world))

    def shard_weight(self, s, leaf, weight, rank, world):
        """The query's rows (q_b_proj's with a low-rank query), kv_b_proj's rows and the out
        projection's columns by heads; the latent's projection and norm, and a low-rank query's
        first half and norm, whole (each rank computes and keeps the same latent rows)."""
        a = s.section(LatentSection)
        h = a.heads // world
        query = "q_b_proj.weight" if a.q_rank else "q_proj.weight"
        if leaf == query:
            return spans(weight, 0, own(rank, h * (a.nope_dim + a.rope_dim)))
        if leaf == "kv_b_proj.weight":
            return spans(weight, 0, own(rank, h * (a.nope_dim + a.value_dim)))
        if leaf == "o_proj.weight":
            return spans(weight, 1, own(rank, h * a.value_dim))
        return weight

    def weights(self, s, prefix):
        a, D = s.section(LatentSection), s.hidden_size
        H, qk = a.heads, a.nope_dim + a.rope_dim
        query = ({f"{prefix}q_proj.weight": (a.q_rank, D), f"{prefix}q_norm.weight": (a.q_rank,),
                  f"{prefix}q_b_proj.weight": (H * qk, a.q_rank)} if a.q_rank else {f"{prefix}q_proj.weight": (H * qk, D)})
        return query | {
            f"{prefix}kv_a_proj.weight": (a.row, D),
            f"{prefix}kv_norm.weight": (a.kv_rank,),
            f"{prefix}kv_b_proj.weight": (H * (a.nope_dim + a.value_dim), a.kv_rank),
            f"{prefix}o_proj.weight": (D, H * a.value_dim),
        }

    def owners(self, s, prefix, dtype, state_dtype):
        """A latent row a position: [c (kv_rank) ; r (rope_dim)]; with a quantized cache, codes
        and beside them a float32 scale a row."""
        row = (s.section(LatentSection).row,)
        if s.kv_cache is None:
            return [OwnerSpec(prefix + "latent", row, dtype, APPENDED)]
        return [OwnerSpec(prefix + "latent", row, CACHE_DTYPES[s.kv_cache], APPENDED),
                OwnerSpec(prefix + "latent_scale", (1,), torch.float32, APPENDED)]

    def init(self, leaf, shape, gen):
        return None

    def stage(self, s, params, layer, kernels, shared):
        return LatentAttention(s, params, layer, kernels)

    def cost(self, s, position):
        """Absorbed: each head's scores over every latent row before the token and the weighted
        sum of them (its query's and output's folding are weights, counted as such)."""
        a = s.section(LatentSection)
        return Cost(flops=2 * a.heads * (a.row + a.kv_rank) * position)

    def ops(self, mode, device, dtype):
        """Exact: every row expanded, attention as written. Fast: `attend_fast` over torch's fused
        attention (`ops.qsa.dense_attention_fast`), and a planned step's lanes absorbed, all at
        once over their tables (`ops.qsa.dense_attention_lanes`, the matrix-product form)."""
        if mode != "fast":
            return {ATTEND: mla_expanded, DENSE: dense_attention}
        return {ATTEND: attend_fast, DENSE: dense_attention_fast, LANES: dense_attention_lanes}
