"""The frame every layer kind's stage sits in: `scan` (a chunk as one call in fast mode, token
by token in exact mode), `Sublayer` (the residual's pre, RMSNorm, the sublayer, the residual's
post) and `FeedForward`, the ffn stage around a kind's feed-forward function and the branches'
terms."""
from __future__ import annotations

from typing import Callable

import torch

from hebrus.layers.hyper import residual
from hebrus.layers.kernels import Kernels
from hebrus.ops.norm import rms_norm
from hebrus.state.context import StepContext
from hebrus.state.step import StepBatch

Params = dict[str, torch.Tensor]


def scan(step: Callable, whole_chunk: bool, batch: StepBatch, inputs: tuple[torch.Tensor, ...], state):
    """`step(batch, *inputs, state) -> (out, state)` over the step: once with `whole_chunk`
    (fast mode), once per token (on fresh copies, with `batch.token(t)`) in exact mode. For a
    prefix transaction (`batch.each`), the state after every token, stacked, instead of the last:
    exact mode keeps each token's, and a whole-chunk step is called with `each=True` to return
    them itself."""
    each = batch.each and state is not None     # a step without state has nothing to keep per token
    if whole_chunk:
        return step(batch, *inputs, state, each=True) if each else step(batch, *inputs, state)
    outs, states = [], []
    for t in range(inputs[0].shape[0]):
        out, state = step(batch.token(t), *(x[t:t + 1].clone() for x in inputs), state)
        outs.append(out)
        states.append(state)
    if each:
        state = tuple(map(torch.stack, zip(*states))) if isinstance(state, tuple) else torch.stack(states)
    return torch.cat(outs), state


class Sublayer:
    """Shared shape of the mixer and ffn stages: the residual's pre, RMSNorm, the sublayer, the
    residual's post."""

    def __init__(self, s, params: Params, layer: int, part: str, kernels: Kernels):
        p = f"layers.{layer}."
        self.layer, self.kernels, self.eps = layer, kernels, s.rms_norm_eps
        self.residual = residual(s, params, f"{p}{part}_hc", kernels.fused)
        self.norm = params[f"{p}{part}_norm.weight"]
        self.rms_norm = kernels.fused(rms_norm)

    def mix_in(self, X: torch.Tensor):
        """X [T, n, D] -> (normed sublayer input h [T, D], post, comb)."""
        c, post, comb = self.residual.pre(X)
        return self.rms_norm(c, self.norm, self.eps), post, comb

    def mix_out(self, X, y, post, comb) -> torch.Tensor:
        return self.residual.post(X, y, post, comb)


class FeedForward(Sublayer):
    """y = feed(h) plus each branch's term for this layer. `feed` is the ffn kind's: called as
    `feed.bind(txn)` once a step, which gives `f(h [T, D], step) -> y [T, D]`; a branch's term
    reads its value (`StepBatch.terms`, by the branch's place in the spec) at this layer."""

    def __init__(self, s, params: Params, layer: int, kernels: Kernels, feed, terms: dict[int, Callable]):
        super().__init__(s, params, layer, "ffn", kernels)
        self.name = f"layers.{layer}.ffn"
        self.feed, self.terms = feed, terms

    def run(self, txn: StepContext, batch: StepBatch) -> None:
        f = self.feed.bind(txn)
        terms = list(self.terms.values())

        def step(pos, X, *rest):
            *inputs, state = rest
            h, post, comb = self.mix_in(X)
            y = f(h, pos)
            for term, x in zip(terms, inputs):
                y = y + term(h, x)
            return self.mix_out(X, y, post, comb), state

        inputs = (batch.streams, *(batch.terms[i][:, self.layer] for i in self.terms))
        batch.streams, _ = scan(step, self.kernels.whole_chunk, batch, inputs, None)
