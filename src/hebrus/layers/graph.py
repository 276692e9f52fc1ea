"""The stage graph: embed, each branch's stage (per-layer embeddings), then per layer its mixer
and its ffn, then head.

Each stage reads public state and chunk-local values from the transaction and writes private
state back through it. In exact mode every stage runs its math one token at a time
(`sublayer.scan`), so a token's arithmetic never depends on how the tokens were chunked; fast
mode runs the chunk as one call. Which kind each stage is comes from the spec, and what a kind
builds from the kind's own module (`layers.kind`).
"""
from __future__ import annotations

import torch

from hebrus.layers.checks import Check
from hebrus.layers.hyper import residual
from hebrus.layers.kernels import Kernels
from hebrus.layers.kind import KINDS
from hebrus.layers.owners import OUTPUT
from hebrus.layers.spec import ModelSpec
from hebrus.layers.sublayer import FeedForward, Params
from hebrus.ops.norm import add_rms_norm, rms_norm
from hebrus.state.context import StepContext
from hebrus.state.step import StepBatch


class Embed:
    """The first stage. Under tensor parallelism a rank holds rows rank·n .. (rank+1)·n of the
    table (`layers.shard`): it looks up the tokens in them, zeros for the others, and the ranks'
    rows are added up (each token's row is one rank's, plus zeros: the same bits)."""
    name = "embed"

    def __init__(self, s: ModelSpec, params: Params, kernels: Kernels):
        self.table, self.streams, self.vocab = params["embed.weight"], s.hc_streams, s.vocab_size
        self.rank, self.split, self.reduce = kernels.rank, kernels.world > 1, kernels.reduce

    def run(self, txn: StepContext, step: StepBatch) -> None:
        """The first stage of every pass over the stages (whoever runs them): the streams start
        here, nothing pending, nothing taken (`StepBatch.forget`: a planned step is passed
        again with its buffers refilled)."""
        step.forget()
        txn.check_range(step.ids, self.vocab, Check.TOKEN_RANGE)
        x = self._rows(step.ids.clamp(0, self.vocab - 1))
        step.streams = x.unsqueeze(1).expand(-1, self.streams, -1).contiguous()
        step.pending = None

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return self.table[ids]
        n = self.table.shape[0]
        mine = ids - self.rank * n
        held = (mine >= 0) & (mine < n)
        return self.reduce(self.table[mine.clamp(0, n - 1)] * held[:, None].to(self.table.dtype))


class Head:
    name = "head"

    def __init__(self, s: ModelSpec, params: Params, kernels: Kernels):
        self.whole_chunk = kernels.whole_chunk
        self.residual = residual(s, params, "head_hc", kernels)
        self.norm, self.eps = params["norm.weight"], s.rms_norm_eps
        self.rms_norm, self.add_rms_norm = kernels.fused(rms_norm), kernels.fused(add_rms_norm)
        self.out = params["embed.weight"] if s.tie_embeddings else params["lm_head.weight"]
        self.linear, self.gather, self.vocab, self.split = kernels.linear, kernels.gather, s.vocab_size, kernels.world > 1

    def _project(self, h: torch.Tensor) -> torch.Tensor:
        """Normed rows h [T, D] -> logits [T, V] (under tensor parallelism each rank's vocabulary
        rows, joined: `layers.shard`)."""
        logits = self.linear(h, self.out)
        return self.gather(logits)[:, :self.vocab] if self.split else logits

    def logits(self, X: torch.Tensor) -> torch.Tensor:
        """Streams X [T, n, D] -> logits [T, V]."""
        return self._project(self.rms_norm(self.residual.head(X), self.norm, self.eps))

    def logits_row_by_row(self, X: torch.Tensor) -> torch.Tensor:
        """`logits`, each row computed as a chunk's last is (one row, in a buffer of its own), so
        each is the bits feeding the chunk up to that position would publish (exact mode)."""
        return torch.cat([self.logits(X[t:t + 1].clone()) for t in range(X.shape[0])])

    def _output(self, X: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
        """Logits of streams X, or of their normed stream h where the norm has run."""
        if h is not None:
            return self._project(h)
        return self.logits(X) if self.whole_chunk else self.logits_row_by_row(X)

    @staticmethod
    def streams(step: StepBatch) -> torch.Tensor:
        """The step's streams with a pending sublayer output added (`StepBatch.pending`)."""
        return step.streams if step.pending is None else step.streams + step.pending.unsqueeze(1)

    def run(self, txn: StepContext, step: StepBatch) -> None:
        X, h = step.streams, None
        if step.pending is not None:        # the last sublayer's output: added in the norm's kernel
            if step.each or all(n == 1 for n in step.lengths):      # where every row's logits are wanted
                X, h = self.add_rms_norm(X, step.pending, self.norm, self.eps)
            else:
                X = self.streams(step)
            step.streams, step.pending = X, None

        if step.keeps:              # the values after every position, or after each session's marks
            if step.marks is not None:
                at = list(step.kept_rows)
                X, h = X[at], None if h is None else h[at]
            logits = self._output(X, h)
            txn.write_each("residual", X)
            txn.write_each(OUTPUT, logits)
            return
        X = step.last_rows(X).clone()            # only each session's last position is published
        logits = self._output(X, None if h is None else step.last_rows(h))
        if step.sessions > 1:                                         # one row per session
            txn.write("residual", X)
            txn.write(OUTPUT, logits)
        else:
            txn.write("residual", X[0])
            txn.write(OUTPUT, logits[0])


def build_stages(s: ModelSpec, params: Params, kernels: Kernels) -> list:
    """The stages, in order, running on the op table `kernels` (see `layers.kernels`). A
    quantized model's weights reach here folded (`models.layout.as_layers_read`)."""
    shared: dict = {}
    stages: list = [Embed(s, params, kernels)]
    stages += [KINDS[name].stage(s, params, None, kernels, shared) for name in s.branches]
    for layer, (mixer, ffn, *branches) in s.layer_kinds():
        stages.append(mixer.stage(s, params, layer, kernels, shared))
        terms = {s.branches.index(branch.name): branch.layer_term(s, params, layer, kernels) for branch in branches}
        stages.append(FeedForward(s, params, layer, kernels, ffn.stage(s, params, layer, kernels, shared), terms))
    stages.append(Head(s, params, kernels))
    return stages
