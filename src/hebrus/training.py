"""Training through the runtime's own layers: a whole sequence, from an empty state, with autograd.

There is no second copy of the model math here. `forward` builds the stages exactly as a loaded
model does (`layers.graph.build_stages`) on parameters that require gradients, and runs them in
a `SequenceContext`: a step context (`state.context`) that starts from every owner's initial
value and keeps what the stages write in ordinary tensors, so gradients flow through them. The
op table is fast mode's, with three training entries:

- the delta rule in its chunked form with longer chunks (fewer sequential steps a sequence);
- a chooser that records what it chose from: the indexer's scores of each sparse-attention
  layer and the router probabilities of each routed layer;
- sparse attention that, beside attending over the picked rows, measures how far the indexer's
  distribution is from dense attention's (averaged over heads, held constant): the KL term that
  teaches the indexer to select what attention needs, since top-k passes it no gradient;
- the indexer reads its input cut from the gradient, so the KL term trains the indexer's own
  weights and nothing below it.

`Losses` adds the router balance term (experts' load times their mean probability, as in
Switch-style routers) and reports each routed layer's load.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hebrus.layers.graph import Head, build_stages
from hebrus.layers.attention import INDEX_INPUT, SPARSE
from hebrus.layers.gdn import DELTA_RULE
from hebrus.layers.kernels import Kernels
from hebrus.layers.kind import kind_ops
from hebrus.layers.moe import EXPERTS
from hebrus.layers.owners import owner_specs
from hebrus.layers.spec import ModelSpec
from hebrus.ops.choose import top_k
from hebrus.ops.gdn import gdn_chunked, gdn_recurrent
from hebrus.ops.moe import experts_grouped
from hebrus.ops.norm import accum_dtype
from hebrus.ops.qsa import sparse_attention
from hebrus.state.pool import Log
from hebrus.state.step import StepBatch
from hebrus.layers.layout import init_parameters, layout as layer_weights
from hebrus.models import layout
from hebrus.models.hebrus import HebrusConfig

KL_ROWS = 256           # query rows per sparse-attention layer that the indexer's KL term samples


class SequenceContext:
    """One sequence as one chunk from the empty state (`state.context.StepContext`): reads give
    each owner's initial value, writes and row logs are plain tensors (autograd sees them), and
    device-side checks are not kept (training data is trusted and in range)."""

    def __init__(self, spec: ModelSpec, ids: torch.Tensor, dtype: torch.dtype):
        self.written: dict[str, torch.Tensor] = {}
        self._owners = {o.name: o for o in owner_specs(spec, dtype, accum_dtype(dtype))}
        self._rows: dict[str, Log] = {}
        self._device, self._length = ids.device, len(ids)

    def read(self, name: str) -> torch.Tensor:
        o = self._owners[name]
        return torch.full(o.shape, o.fill, dtype=o.dtype, device=self._device)

    def write(self, name: str, value: torch.Tensor) -> None:
        self.written[name] = value

    def rows(self, name: str) -> list[Log]:
        if name not in self._rows:
            o = self._owners[name]
            rows = torch.zeros((self._length,) + o.shape, dtype=o.dtype, device=self._device)
            self._rows[name] = Log.whole(rows, self._length)
        return [self._rows[name]]

    def flag(self, bad: torch.Tensor, bit: int) -> None:
        pass

    def check_range(self, values: torch.Tensor, upper: int, bit: int, lower: int | None = 0) -> None:
        pass

    def hold(self, resource) -> None:         # trained tables are never paged
        raise TypeError("training runs on resident parameters, not paged tables")


@dataclass
class Record:
    """What one forward's choices were made from."""
    kl: list[torch.Tensor] = field(default_factory=list)                     # per sparse-attention layer
    routes: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)   # site: (p, chosen)
    _index_scores: torch.Tensor | None = None

    def choose(self, site: str, start, scores: torch.Tensor, k: int, ordered: bool = True) -> torch.Tensor:
        chosen = top_k(scores.detach(), k)
        if ordered:                        # experts: scores are the router's probabilities
            self.routes[site] = (scores, chosen)
        else:                              # attended rows: the indexer's visible scores
            self._index_scores = scores
        return chosen

    def sparse_attend(self, q, k_rows, v_rows, picked, valid) -> torch.Tensor:
        if self._index_scores is not None and q.requires_grad:
            self.kl.append(_indexer_kl(self._index_scores, q.detach(), k_rows.detach()))
        self._index_scores = None
        return sparse_attention(q, k_rows, v_rows, picked, valid)


def _indexer_kl(scores: torch.Tensor, q: torch.Tensor, k_rows: torch.Tensor) -> torch.Tensor:
    """KL(dense attention ‖ indexer) over a sample of query rows, attention averaged over heads.
    scores [T, S] (-inf past each query: what a query may not see is masked by those), q [T, Hq,
    dh], k_rows [S, Hkv, dh]; a chunk longer than a query block comes block by block."""
    T = q.shape[0]
    rows = torch.randperm(T, device=q.device)[:KL_ROWS] if T > KL_ROWS else torch.arange(T, device=q.device)
    seen = torch.isfinite(scores[rows])
    with torch.no_grad():
        k = k_rows.repeat_interleave(q.shape[1] // k_rows.shape[1], dim=1)
        logits = torch.einsum("thd,shd->ths", q[rows].float(), k.float()) * q.shape[-1] ** -0.5
        target = torch.softmax(logits.masked_fill(~seen[:, None, :], float("-inf")), -1).mean(1)
    logp = torch.log_softmax(scores[rows].float().masked_fill(~seen, -1e9), -1)
    terms = torch.where(seen & (target > 0), target * (target.clamp_min(1e-30).log() - logp), 0.0)
    return terms.sum(-1).mean()


def training_kernels(record: Record, gdn_chunk: int = 128) -> Kernels:
    """Fast mode's op table with the training entries (see the module's docstring)."""
    def delta_rule(q, k, v, g, beta, state):
        if q.shape[-3] > 1:
            return gdn_chunked(q, k, v, g, beta, state, chunk=gdn_chunk)
        return gdn_recurrent(q, k, v, g, beta, state)

    ops = kind_ops("fast", None, None) | {DELTA_RULE: delta_rule, EXPERTS: experts_grouped,
                                          SPARSE: record.sparse_attend, INDEX_INPUT: torch.Tensor.detach}
    return Kernels(True, record.choose, ops=ops)


def forward(spec: ModelSpec, params: dict[str, torch.Tensor], ids: torch.Tensor,
            gdn_chunk: int = 128) -> tuple[torch.Tensor, Record]:
    """ids [T] from the empty state -> (logits [T, V] at every position, the record of choices).
    The stages are built afresh on `params` each call, so values derived from parameters at
    build time (the delta rule's decay constants) carry their gradients."""
    record = Record()
    kernels = training_kernels(record, gdn_chunk)
    params = layout.as_layers_read(spec, params, kernels.quantized_linear)
    stages = build_stages(spec, params, kernels)
    ctx = SequenceContext(spec, ids, params["embed.weight"].dtype)
    step = StepBatch.chunk(ids, 0)
    for stage in stages[:-1]:
        stage.run(ctx, step)
    head = stages[-1]
    assert isinstance(head, Head)
    return head.logits(head.streams(step)), record


@dataclass
class Losses:
    loss: torch.Tensor             # what is minimised
    lm: torch.Tensor               # next-byte cross-entropy, nats
    kl: torch.Tensor               # mean indexer KL
    balance: torch.Tensor          # mean router balance term (1 is perfectly balanced)
    load: dict[str, torch.Tensor]  # per routed layer: each expert's share of the routed choices [E]


def losses(spec: ModelSpec, params, ids: torch.Tensor, kl_weight: float = 0.1, balance_weight: float = 0.01,
           gdn_chunk: int = 128) -> Losses:
    """Next-token loss on ids[1:] given ids[:-1], plus the indexer's KL and the routers' balance."""
    logits, record = forward(spec, params, ids[:-1], gdn_chunk)
    lm = F.cross_entropy(logits.float(), ids[1:])
    zero = lm.new_zeros(())
    kl = torch.stack(record.kl).mean() if record.kl else zero
    terms, load = [], {}
    for site, (p, chosen) in record.routes.items():
        experts = p.shape[-1]
        share = F.one_hot(chosen, experts).float().sum(1).mean(0) / chosen.shape[1]     # [E], no gradient
        terms.append(experts * (share * p.float().mean(0)).sum())
        load[site] = share
    balance = torch.stack(terms).mean() if terms else zero
    return Losses(lm + kl_weight * kl + balance_weight * balance, lm.detach(), kl.detach(), balance.detach(), load)


def initial_parameters(c, seed: int | None = None) -> dict[str, torch.Tensor]:
    """Parameters to start training from: the presets' initialisation (`layers.layout`, which
    makes every component active for tests) with the scales a network learns from: embeddings
    at 1/√D (tied logits start near unit scale, the loss near log V), and what each sublayer
    writes into the residual stream (its kind's `outputs`: output projections, the per-layer
    embeddings' output norm) scaled by 1/√(2·layers) so the residual stream starts from small
    updates."""
    if isinstance(c, HebrusConfig):                 # seeded by its init_seed
        params, spec = c.init_parameters(seed), c.spec()
    else:
        params, spec = init_parameters(c, 0 if seed is None else seed), c
    residual_scale = (2 * spec.num_layers) ** -0.5
    outputs = {w.name for w in layer_weights(spec) if w.kind is not None and w.leaf in w.kind.outputs}
    for name, t in params.items():
        if name in ("embed.weight", "lm_head.weight"):
            t.mul_(spec.hidden_size ** -0.5 / float(t.std()))
        elif name in outputs:                   # the kinds' `outputs` (a PLE norm weight: 1 × scale)
            t.mul_(residual_scale)
    return params


def trainable(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The floating-point parameters, as leaves that require gradients (hash constants stay)."""
    return {name: (p.detach().clone().requires_grad_() if p.is_floating_point() else p.clone())
            for name, p in params.items()}

