"""The stage graph: embed, ple, then per layer its mixer and its ffn, then head.

Each stage reads public state and chunk-local values from the transaction and writes private
state back through it. In exact mode every stage runs its math one token at a time (`scan`), so
a token's arithmetic never depends on how the tokens were chunked; fast mode runs the chunk as
one batch.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from hebrus.config import HebrusConfig
from hebrus.model.gdn import GatedDeltaNet
from hebrus.model.hyper import HyperConnection
from hebrus.model.kernels import Kernels
from hebrus.model.moe import LayerEmbedding, MixtureOfExperts
from hebrus.model.ple import PerLayerEmbedding
from hebrus.model.qsa import RotaryTables, SparseAttention
from hebrus.ops.norm import rms_norm
from hebrus.state.status import Status

Params = dict[str, torch.Tensor]


def scan(step: Callable, batched: bool, start: int, inputs: tuple[torch.Tensor, ...], state):
    """`step(position, *inputs, state) -> (out, state)` over the chunk: once when batched (fast
    mode), once per token (on fresh copies) in exact mode."""
    if batched:
        return step(start, *inputs, state)
    outs = []
    for t in range(inputs[0].shape[0]):
        out, state = step(start + t, *(x[t:t + 1].clone() for x in inputs), state)
        outs.append(out)
    return torch.cat(outs), state


class Embed:
    name = "embed"

    def __init__(self, c: HebrusConfig, params: Params):
        self.table, self.streams, self.vocab = params["embed.weight"], c.hc_streams, c.vocab_size

    def run(self, txn) -> None:
        ids = txn.local["ids"]
        txn.check_range(ids, self.vocab, Status.TOKEN_RANGE)
        x = self.table[ids.clamp(0, self.vocab - 1)]
        txn.emit("streams", x.unsqueeze(1).expand(-1, self.streams, -1).contiguous())


class PLE:
    name = "ple"

    def __init__(self, c: HebrusConfig, params: Params, kernels: Kernels):
        self.ple, self.kernels, self.keep = PerLayerEmbedding(c, params), kernels, c.ple_ngram - 1
        self.vocab = c.vocab_size

    def run(self, txn) -> None:
        ids, history = txn.local["ids"], txn.read("ple.history")
        txn.check_range(ids, self.vocab, Status.TOKEN_RANGE)
        hashes = self.ple.hashes(ids, history)
        for bucket, size in zip(hashes, self.ple.buckets):
            txn.check_range(bucket, size, Status.HASH_RANGE)
        hashes = [bucket.clamp(0, size - 1) for bucket, size in zip(hashes, self.ple.buckets)]
        ids = ids.clamp(0, self.vocab - 1)
        ple, conv = scan(self._step, self.kernels.batched, txn.start, (ids, *hashes), txn.read("ple.conv"))
        txn.emit("ple", ple)
        txn.write("ple.history", torch.cat([history, ids])[-self.keep:])
        txn.write("ple.conv", conv)

    def _step(self, pos, ids, *rest):
        *hashes, conv = rest
        return self.ple(ids, hashes, conv)


class Sublayer:
    """Shared shape of the mixer and ffn stages: mHC pre, RMSNorm, the sublayer, mHC post."""

    def __init__(self, c: HebrusConfig, params: Params, layer: int, part: str, kernels: Kernels):
        p = f"layers.{layer}."
        self.layer, self.kernels, self.eps = layer, kernels, c.rms_norm_eps
        self.hc = HyperConnection(c, params, f"{p}{part}_hc")
        self.norm = params[f"{p}{part}_norm.weight"]

    def mix_in(self, X: torch.Tensor):
        """X [T, n, D] -> (normed sublayer input h [T, D], post, comb)."""
        c, post, comb = self.hc.pre(X)
        return rms_norm(c, self.norm, self.eps), post, comb

    def mix_out(self, X, y, post, comb) -> torch.Tensor:
        return self.hc.post(X, y, post, comb)


class GDNMixer(Sublayer):
    def __init__(self, c: HebrusConfig, params: Params, layer: int, kernels: Kernels):
        super().__init__(c, params, layer, "mixer", kernels)
        self.name = f"layers.{layer}.gdn"
        self.gdn = GatedDeltaNet(c, params, self.name + ".")

    def run(self, txn) -> None:
        conv, rec = self.name + ".conv", self.name + ".recurrent"
        X, (conv_state, S) = scan(self._step, self.kernels.batched, txn.start, (txn.local["streams"],),
                                  (txn.read(conv).T, txn.read(rec)))
        txn.write(conv, conv_state.T)
        txn.write(rec, S)
        txn.emit("streams", X)

    def _step(self, pos, X, state):
        h, post, comb = self.mix_in(X)
        y, conv_state, S = self.gdn(h, *state, self.kernels.delta_rule)
        return self.mix_out(X, y, post, comb), (conv_state, S)


class QSAMixer(Sublayer):
    def __init__(self, c: HebrusConfig, params: Params, layer: int, kernels: Kernels, rotary: RotaryTables):
        super().__init__(c, params, layer, "mixer", kernels)
        self.name = f"layers.{layer}.qsa"
        self.attn = SparseAttention(c, params, self.name + ".", rotary, kernels)

    def run(self, txn) -> None:
        rows = [txn.rows(f"{self.name}.{part}") for part in ("k", "v", "index")]

        def step(pos, X, state):
            h, post, comb = self.mix_in(X)
            return self.mix_out(X, self.attn(h, pos, *rows, txn.check_range), post, comb), state

        X, _ = scan(step, self.kernels.batched, txn.start, (txn.local["streams"],), None)
        txn.emit("streams", X)


class FFN(Sublayer):
    """y = MoE(h) + PLE_l(h); records the chosen experts in the `routes` rows."""

    def __init__(self, c: HebrusConfig, params: Params, layer: int, kernels: Kernels):
        super().__init__(c, params, layer, "ffn", kernels)
        self.name = f"layers.{layer}.ffn"
        self.moe = MixtureOfExperts(c, params, f"layers.{layer}.moe.", kernels, self.name)
        self.ple = LayerEmbedding(c, params, f"layers.{layer}.ple.")
        self.experts = c.moe_experts

    def run(self, txn) -> None:
        routes = txn.rows("routes")

        def step(pos, X, ple, state):
            h, post, comb = self.mix_in(X)
            weights, experts = self.moe.route(h, pos)
            txn.check_range(experts, self.experts, Status.ROUTE_RANGE)
            experts = experts.clamp(0, self.experts - 1)
            routes[pos:pos + len(X), self.layer] = experts.to(routes.dtype)
            y = self.moe(h, weights, experts) + self.ple(h, ple)
            return self.mix_out(X, y, post, comb), state

        inputs = (txn.local["streams"], txn.local["ple"][:, self.layer])
        X, _ = scan(step, self.kernels.batched, txn.start, inputs, None)
        txn.emit("streams", X)


class Head:
    name = "head"

    def __init__(self, c: HebrusConfig, params: Params):
        self.hc = HyperConnection(c, params, "head_hc")
        self.norm, self.eps = params["norm.weight"], c.rms_norm_eps
        self.out = params["embed.weight"] if c.tie_embeddings else params["lm_head.weight"]

    def run(self, txn) -> None:
        X = txn.local["streams"][-1:].clone()                 # only the last position is published
        logits = F.linear(rms_norm(self.hc.head(X), self.norm, self.eps), self.out)
        txn.write("residual", X[0])
        txn.write("logits", logits[0])


def build_stages(c: HebrusConfig, params: Params, kernels: Kernels) -> list:
    """The stages, in order, running on the op table `kernels` (see `model.kernels`)."""
    stages: list = [Embed(c, params), PLE(c, params, kernels)]
    rotary = RotaryTables(c, params["embed.weight"])
    for layer, kind in enumerate(c.layer_types):
        if kind == "gdn":
            mixer = GDNMixer(c, params, layer, kernels)
        else:
            mixer = QSAMixer(c, params, layer, kernels, rotary)
        stages += [mixer, FFN(c, params, layer, kernels)]
    stages.append(Head(c, params))
    return stages
