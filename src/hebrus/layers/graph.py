"""The stage graph: embed, ple (when the model has per-layer embeddings), then per layer its
mixer and its ffn, then head.

Each stage reads public state and chunk-local values from the transaction and writes private
state back through it. In exact mode every stage runs its math one token at a time (`scan`), so
a token's arithmetic never depends on how the tokens were chunked; fast mode runs the chunk as
one batch. Which layers a model has, and in which form, comes from its `ModelSpec`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from hebrus.layers.gdn import GatedDeltaNet
from hebrus.layers.hyper import residual
from hebrus.layers.kernels import Kernels
from hebrus.layers.moe import MLP, LayerEmbedding, MixtureOfExperts
from hebrus.layers.ple import PerLayerEmbedding
from hebrus.layers.qsa import Attention, RotaryTables
from hebrus.layers.span import Span
from hebrus.layers.spec import ModelSpec
from hebrus.ops.norm import rms_norm
from hebrus.state.context import StepContext
from hebrus.state.status import Status

Params = dict[str, torch.Tensor]


def scan(step: Callable, batched: bool, start: int, inputs: tuple[torch.Tensor, ...], state,
         each: bool = False):
    """`step(position, *inputs, state) -> (out, state)` over the chunk: once when batched (fast
    mode), once per token (on fresh copies) in exact mode. With `each` (a prefix transaction),
    the state after every token, stacked, instead of the last: exact mode keeps each token's,
    and a batched step is called with `each=True` to return them itself."""
    if batched:
        return step(start, *inputs, state, each=True) if each else step(start, *inputs, state)
    outs, states = [], []
    for t in range(inputs[0].shape[0]):
        out, state = step(start + t, *(x[t:t + 1].clone() for x in inputs), state)
        outs.append(out)
        states.append(state)
    if each:
        state = tuple(map(torch.stack, zip(*states))) if isinstance(state, tuple) else torch.stack(states)
    return torch.cat(outs), state


class Embed:
    name = "embed"

    def __init__(self, c: ModelSpec, params: Params):
        self.table, self.streams, self.vocab = params["embed.weight"], c.hc_streams, c.vocab_size

    def run(self, txn: StepContext) -> None:
        ids = txn.local["ids"]
        txn.check_range(ids, self.vocab, Status.TOKEN_RANGE)
        x = self.table[ids.clamp(0, self.vocab - 1)]
        txn.emit("streams", x.unsqueeze(1).expand(-1, self.streams, -1).contiguous())


class PLE:
    name = "ple"

    def __init__(self, c: ModelSpec, params: Params, kernels: Kernels):
        self.ple, self.kernels, self.keep = PerLayerEmbedding(c, params), kernels, c.ple_ngram - 1
        self.vocab = c.vocab_size

    def run(self, txn: StepContext) -> None:
        ids, history = txn.local["ids"], txn.read("ple.history")
        txn.check_range(ids, self.vocab, Status.TOKEN_RANGE)
        if txn.batched:             # row i: one token of session i, hashed with its own history
            hashes = [order[:, 0] for order in self.ple.hashes(ids[:, None], history)]
        else:
            hashes = self.ple.hashes(ids, history)
        for bucket, size in zip(hashes, self.ple.buckets):
            txn.check_range(bucket, size, Status.HASH_RANGE)
        hashes = [bucket.clamp(0, size - 1) for bucket, size in zip(hashes, self.ple.buckets)]
        ids = ids.clamp(0, self.vocab - 1)
        claims = self.ple.claims(txn.hold)

        def step(pos, ids, *rest, each=False):
            *hashes, conv = rest
            return self.ple(ids, hashes, conv, sessions=txn.batched, claims=claims, each=each)

        ple, conv = scan(step, self.kernels.batched, txn.start, (ids, *hashes), txn.read("ple.conv"), txn.each)
        txn.emit("ple", ple)
        if txn.batched:
            txn.write("ple.history", torch.cat([history, ids[:, None]], dim=1)[:, -self.keep:])
        elif txn.each:                  # after token t: the `keep` ids ending at it
            ids = torch.cat([history, ids])
            after = torch.arange(1, len(ids) - self.keep + 1, device=ids.device)
            txn.write_each("ple.history", ids[after[:, None] + torch.arange(self.keep, device=ids.device)])
        else:
            txn.write("ple.history", torch.cat([history, ids])[-self.keep:])
        (txn.write_each if txn.each else txn.write)("ple.conv", conv)


class Sublayer:
    """Shared shape of the mixer and ffn stages: the residual's pre, RMSNorm, the sublayer, the
    residual's post."""

    def __init__(self, c: ModelSpec, params: Params, layer: int, part: str, kernels: Kernels):
        p = f"layers.{layer}."
        self.layer, self.kernels, self.eps = layer, kernels, c.rms_norm_eps
        self.residual = residual(c, params, f"{p}{part}_hc", kernels.fused)
        self.norm = params[f"{p}{part}_norm.weight"]
        self.rms_norm = kernels.fused(rms_norm)

    def mix_in(self, X: torch.Tensor):
        """X [T, n, D] -> (normed sublayer input h [T, D], post, comb)."""
        c, post, comb = self.residual.pre(X)
        return self.rms_norm(c, self.norm, self.eps), post, comb

    def mix_out(self, X, y, post, comb) -> torch.Tensor:
        return self.residual.post(X, y, post, comb)


class GDNMixer(Sublayer):
    def __init__(self, c: ModelSpec, params: Params, layer: int, kernels: Kernels):
        super().__init__(c, params, layer, "mixer", kernels)
        self.name = f"layers.{layer}.gdn"
        self.gdn = GatedDeltaNet(c, params, self.name + ".")

    def run(self, txn: StepContext) -> None:
        conv, rec = self.name + ".conv", self.name + ".recurrent"

        def step(pos, X, state, each=False):
            h, post, comb = self.mix_in(X)
            y, conv_state, S = self.gdn(h, *state, self.kernels, sessions=txn.batched, each=each)
            return self.mix_out(X, y, post, comb), (conv_state, S)

        X, (conv_state, S) = scan(step, self.kernels.batched, txn.start, (txn.local["streams"],),
                                  (txn.read(conv).transpose(-1, -2), txn.read(rec)), txn.each)
        write = txn.write_each if txn.each else txn.write
        write(conv, conv_state.transpose(-1, -2))
        write(rec, S)
        txn.emit("streams", X)


class AttentionMixer(Sublayer):
    """Gated attention over the layer's K/V rows: `qsa` (indexer-selected rows, its index keys
    are rows too) or `attention` (every row)."""

    def __init__(self, c: ModelSpec, params: Params, layer: int, kernels: Kernels, rotary: RotaryTables,
                 kind: str):
        super().__init__(c, params, layer, "mixer", kernels)
        self.name = f"layers.{layer}.{kind}"
        self.parts = ("k", "v", "index") if kind == "qsa" else ("k", "v")
        if c.kv_cache is not None:               # a quantized cache: each log's scales after the codes
            self.parts += tuple(part + "_scale" for part in self.parts)
        self.attn = Attention(c, params, self.name + ".", rotary, kernels, indexed=kind == "qsa")

    def run(self, txn: StepContext) -> None:
        rows = [txn.rows(f"{self.name}.{part}") for part in self.parts]
        checks = [part.check_range for part in txn.parts] if txn.batched else txn.check_range

        def step(pos, X, state):
            h, post, comb = self.mix_in(X)
            return self.mix_out(X, self.attn(h, pos, rows, checks), post, comb), state

        X, _ = scan(step, self.kernels.batched, txn.start, (txn.local["streams"],), None)
        txn.emit("streams", X)


class FFN(Sublayer):
    """y = MoE(h) or MLP(h), plus PLE_l(h) when the model has per-layer embeddings. A routed
    layer records its chosen experts in its column of the `routes` rows."""

    def __init__(self, c: ModelSpec, params: Params, layer: int, kernels: Kernels):
        super().__init__(c, params, layer, "ffn", kernels)
        self.name = f"layers.{layer}.ffn"
        kind = c.ffns[layer]
        self.routed = kind == "moe"
        if kind == "moe":
            self.moe = MixtureOfExperts(c, params, f"layers.{layer}.moe.", kernels, self.name)
            self.column, self.experts = c.moe_layers.index(layer), c.moe_experts
        elif kind == "mlp":
            self.mlp = MLP(params, f"layers.{layer}.mlp.", kernels)
        else:
            raise ValueError(f"unknown feed-forward kind {kind!r}")
        self.ple = LayerEmbedding(c, params, f"layers.{layer}.ple.") if c.ple_dim else None

    def run(self, txn: StepContext) -> None:
        routes = txn.rows("routes") if self.routed else None

        def step(pos, X, *rest):
            *ple, state = rest
            h, post, comb = self.mix_in(X)
            if self.routed:
                weights, experts = self.moe.route(h, pos)
                txn.check_range(experts, self.experts, Status.ROUTE_RANGE)
                experts = experts.clamp(0, self.experts - 1)
                column = [r[:, self.column] for r in routes] if txn.batched else routes[:, self.column]
                Span(pos, len(X), X.device).put(column, experts)
                y = self.moe(h, weights, experts)
            else:
                y = self.mlp(h)
            if self.ple is not None:
                y = y + self.ple(h, ple[0])
            return self.mix_out(X, y, post, comb), state

        inputs = (txn.local["streams"],)
        if self.ple is not None:
            inputs += (txn.local["ple"][:, self.layer],)
        X, _ = scan(step, self.kernels.batched, txn.start, inputs, None)
        txn.emit("streams", X)


class Head:
    name = "head"

    def __init__(self, c: ModelSpec, params: Params, kernels: Kernels):
        self.batched = kernels.batched
        self.residual = residual(c, params, "head_hc", kernels.fused)
        self.norm, self.eps = params["norm.weight"], c.rms_norm_eps
        self.rms_norm = kernels.fused(rms_norm)
        self.out = params["embed.weight"] if c.tie_embeddings else params["lm_head.weight"]

    def logits(self, X: torch.Tensor) -> torch.Tensor:
        """Streams X [T, n, D] -> logits [T, V]."""
        return F.linear(self.rms_norm(self.residual.head(X), self.norm, self.eps), self.out)

    def logits_row_by_row(self, X: torch.Tensor) -> torch.Tensor:
        """`logits`, each row computed as a chunk's last is (one row, in a buffer of its own), so
        each is the bits feeding the chunk up to that position would publish (exact mode)."""
        return torch.cat([self.logits(X[t:t + 1].clone()) for t in range(X.shape[0])])

    def run(self, txn: StepContext) -> None:
        if txn.each:                # a prefix transaction: the values after every position
            X = txn.local["streams"]
            logits = self.logits(X) if self.batched else self.logits_row_by_row(X)
            txn.write_each("residual", X)
            txn.write_each("logits", logits)
            return
        X = txn.last_rows(txn.local["streams"]).clone()      # only the last position is published
        logits = self.logits(X)
        if txn.batched:                                       # one row per session
            txn.write("residual", X)
            txn.write("logits", logits)
        else:
            txn.write("residual", X[0])
            txn.write("logits", logits[0])


def build_stages(c: ModelSpec, params: Params, kernels: Kernels) -> list:
    """The stages, in order, running on the op table `kernels` (see `layers.kernels`). A
    quantized model's weights reach the layers folded into `ops.quant.Quantized` weights."""
    from hebrus.weights.layout import float_shapes
    from hebrus.weights.quant import folded
    params = folded(params, c.quantization, float_shapes(c), kernels.quantized_linear)
    stages: list = [Embed(c, params)]
    if c.ple_dim:
        stages.append(PLE(c, params, kernels))
    rotary = RotaryTables(c, params["embed.weight"])
    for layer, kind in enumerate(c.mixers):
        if kind == "gdn":
            mixer = GDNMixer(c, params, layer, kernels)
        elif kind in ("qsa", "attention"):
            mixer = AttentionMixer(c, params, layer, kernels, rotary, kind)
        else:
            raise ValueError(f"unknown mixer {kind!r}")
        stages += [mixer, FFN(c, params, layer, kernels)]
    stages.append(Head(c, params, kernels))
    return stages
