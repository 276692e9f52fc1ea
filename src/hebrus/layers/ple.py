"""Per-layer embeddings, a branch kind: unigram + hashed n-gram tables, a causal conv with a
SiLU branch (its own stage, after the embedding), and in every feed-forward sublayer the term
PLE_l(h) = RMSNorm(W_down (gelu_tanh(W_gate h) ⊙ ple_t[l])).

A table is a tensor, or a `RowTable` whose rows are brought in as a chunk needs them (the
paged tables of `weights.pages`): it is read through a claim this chunk's transaction holds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from hebrus.layers.checks import Check
from hebrus.layers.kernels import Kernels, unfused
from hebrus.layers.kind import Cost, Kind, normal
from hebrus.layers.sublayer import scan
from hebrus.ops.conv import causal_conv
from hebrus.ops.norm import rms_norm
from hebrus.ops.ple import gelu_mul, ngram_buckets
from hebrus.state.context import StepContext
from hebrus.state.step import StepBatch
from hebrus.state.owners import OwnerSpec


@dataclass(frozen=True, slots=True)
class PLESection:
    key: ClassVar[str] = "ple"
    dim: int                            # P, a layer's slice
    ngram: int = 2
    buckets: tuple[int, ...] = (1,)     # rows of the n-gram tables, orders 2..ngram
    conv_kernel: int = 1

    def problems(self, s):
        if len(self.buckets) != self.ngram - 1:
            yield f"{len(self.buckets)} PLE bucket counts for n-gram orders 2..{self.ngram}"

    def width(self, s) -> int:
        """L·P: one P-wide slice per layer."""
        return s.num_layers * self.dim


class RowTable(Protocol):
    """A table not held whole on the device: `claim()` a chunk's use of it (handed to the
    transaction, which commits or releases it), `gather(rows, claim)` its rows."""
    def claim(self): ...
    def gather(self, index: torch.Tensor, claim) -> torch.Tensor: ...


def take(table, index: torch.Tensor, claims: dict) -> torch.Tensor:
    """Rows of a table: a tensor indexed directly, a `RowTable` through this chunk's claim."""
    if isinstance(table, torch.Tensor):
        return table[index]
    return table.gather(index, claims[id(table)])


class PerLayerEmbedding:
    def __init__(self, s, params: dict[str, torch.Tensor], fused=unfused):
        p = s.section(PLESection)
        self.ngram_buckets = fused(ngram_buckets)      # integer arithmetic: any form gives the same ids
        self.unigram = params["ple.unigram.weight"]
        self.tables = [params[f"ple.ngram.{m}.weight"] for m in range(2, p.ngram + 1)]
        self.constants = params["ple.hash_constants"]
        self.conv_w = params["ple.conv.weight"]
        self.buckets = p.buckets
        self.layers, self.dim = s.num_layers, p.dim

    def claims(self, hold) -> dict:
        """One claim per row table for this chunk, each handed to `hold` (the transaction's)."""
        claims = {}
        for table in (self.unigram, *self.tables):
            if not isinstance(table, torch.Tensor):
                claims[id(table)] = claim = table.claim()
                hold(claim)
        return claims

    def hashes(self, ids: torch.Tensor, history: torch.Tensor) -> list[torch.Tensor]:
        return self.ngram_buckets(ids, history, self.constants, self.buckets)

    def __call__(self, ids: torch.Tensor, hashes: list[torch.Tensor], conv_state: torch.Tensor,
                 sessions: bool = False, claims: dict | None = None, each: bool = False):
        """ids [T] -> (ple [T, L, P], conv_state [Kp-1, L·P]). With `sessions`, id i is one
        token of session i, whose conv state is conv_state[i]. Row tables are read through this
        chunk's `claims`. With `each`, the conv state after every token [T, Kp-1, L·P]."""
        e = take(self.unigram, ids, claims)
        for table, bucket in zip(self.tables, hashes):
            e = e + take(table, bucket, claims)
        if sessions:
            mixed, conv_state = causal_conv(e[:, None], conv_state, self.conv_w)
            mixed = mixed[:, 0]
        else:
            mixed, conv_state = causal_conv(e, conv_state, self.conv_w, each)
        a = e + F.silu(mixed)
        return a.view(-1, self.layers, self.dim), conv_state


class PLEStage:
    name = "ple"

    def __init__(self, s, params, kernels: Kernels):
        self.ple, self.kernels = PerLayerEmbedding(s, params, kernels.fused), kernels
        self.keep = s.section(PLESection).ngram - 1
        self.vocab = s.vocab_size
        self.index = s.branches.index(PLE.name)      # where its value travels (`StepBatch.terms`)

    def run(self, txn: StepContext, batch: StepBatch) -> None:
        ids, history = batch.ids, txn.read("ple.history")
        txn.check_range(ids, self.vocab, Check.TOKEN_RANGE)
        hashes = self._hashes(batch, ids, history)
        for bucket, size in zip(hashes, self.ple.buckets):
            txn.check_range(bucket, size, Check.HASH_RANGE)
        hashes = [bucket.clamp(0, size - 1) for bucket, size in zip(hashes, self.ple.buckets)]
        ids = ids.clamp(0, self.vocab - 1)
        claims = self.ple.claims(txn.hold)

        def step(at, ids, *rest, each=False):
            *hashes, conv = rest
            return self.ple(ids, hashes, conv, sessions=at.one_each, claims=claims, each=each)

        ple, conv = scan(step, self.kernels.whole_chunk, batch, (ids, *hashes), txn.read("ple.conv"))
        batch.terms[self.index] = ple
        self._write_history(txn, batch, ids, history)
        (txn.write_each if batch.keeps else txn.write)("ple.conv", conv)

    def _hashes(self, batch: StepBatch, ids: torch.Tensor, history: torch.Tensor) -> list[torch.Tensor]:
        """Each token's n-gram buckets, hashed with its own session's history."""
        if batch.sessions == 1:
            return self.ple.hashes(ids, history)
        if batch.one_each:                  # row i: one token of session i
            return [order[:, 0] for order in self.ple.hashes(ids[:, None], history)]
        each = [self.ple.hashes(batch.rows_of(i, ids), history[i]) for i in range(batch.sessions)]
        return [torch.cat(order) for order in zip(*each)]

    def _write_history(self, txn: StepContext, batch: StepBatch, ids: torch.Tensor, history: torch.Tensor) -> None:
        if batch.marks is not None:         # after each session's marks: the `keep` ids ending at each
            after = []
            for i, counts in enumerate(batch.marks):
                mine = torch.cat([history if batch.sessions == 1 else history[i], batch.rows_of(i, ids)])
                at = torch.tensor(counts, device=ids.device)
                after.append(mine[at[:, None] + torch.arange(self.keep, device=ids.device)])
            txn.write_each("ple.history", torch.cat(after))
        elif batch.one_each:
            txn.write("ple.history", torch.cat([history, ids[:, None]], dim=1)[:, -self.keep:])
        elif batch.sessions > 1:
            txn.write("ple.history", torch.stack([torch.cat([history[i], batch.rows_of(i, ids)])[-self.keep:]
                                                  for i in range(batch.sessions)]))
        elif batch.each:                    # after every token t: the `keep` ids ending at it
            ids = torch.cat([history, ids])
            after = torch.arange(1, len(ids) - self.keep + 1, device=ids.device)
            txn.write_each("ple.history", ids[after[:, None] + torch.arange(self.keep, device=ids.device)])
        else:
            txn.write("ple.history", torch.cat([history, ids])[-self.keep:])


class LayerEmbedding:
    """PLE_l(h) = RMSNorm(W_down (gelu_tanh(W_gate h) ⊙ ple_t[l])), its elementwise parts run as
    the op table's `fused` runs them."""

    def __init__(self, s, params: dict[str, torch.Tensor], prefix: str, kernels):
        self.gate, self.down = params[prefix + "gate.weight"], params[prefix + "down.weight"]
        self.norm = params[prefix + "norm.weight"]
        self.eps, self.fused, self.linear = s.rms_norm_eps, kernels.fused, kernels.linear

    def __call__(self, h: torch.Tensor, ple: torch.Tensor) -> torch.Tensor:
        mixed = self.fused(gelu_mul)(self.linear(h, self.gate), ple)
        return self.fused(rms_norm)(self.linear(mixed, self.down), self.norm, self.eps)


class PLE(Kind):
    name = "ple"
    role = "branch"
    section = PLESection
    quantized = ()
    integer = ("hash_constants",)
    outputs = ("norm.weight",)
    shards = "whole"            # every rank looks up and adds the same terms

    def model_weights(self, s):
        p, V = s.section(PLESection), s.vocab_size
        LP = p.width(s)
        shapes = {"ple.unigram.weight": (V, LP)}
        for m, buckets in zip(range(2, p.ngram + 1), p.buckets):
            shapes[f"ple.ngram.{m}.weight"] = (buckets, LP)
        shapes["ple.hash_constants"] = (p.ngram - 1, p.ngram)
        shapes["ple.conv.weight"] = (LP, p.conv_kernel)
        return shapes

    def weights(self, s, prefix):
        P, D = s.section(PLESection).dim, s.hidden_size
        return {f"{prefix}gate.weight": (P, D), f"{prefix}down.weight": (D, P), f"{prefix}norm.weight": (D,)}

    def model_owners(self, s, dtype, state_dtype):
        """The last ngram-1 ids (PAD = V before the first), the conv's last Kp-1 inputs."""
        p, V = s.section(PLESection), s.vocab_size
        return [OwnerSpec("ple.history", (p.ngram - 1,), torch.int64, fill=V, limit=V + 1),
                OwnerSpec("ple.conv", (p.conv_kernel - 1, p.width(s)), dtype)]

    def owners(self, s, prefix, dtype, state_dtype):
        return []

    def init(self, leaf, shape, gen):
        """Tables N(0, 1); hash constants random odd 62-bit integers (so the int64 products wrap),
        zero past each order's width."""
        if leaf == "hash_constants":
            odd = torch.randint(0, 2**61, shape, generator=gen, dtype=torch.int64, device="cpu") * 2 + 1
            keep = torch.arange(shape[1], device="cpu")[None, :] < torch.arange(2, shape[0] + 2, device="cpu")[:, None]
            return torch.where(keep, odd, 0)
        if leaf == "unigram.weight" or leaf.startswith("ngram."):
            return normal(shape, 1.0, gen)
        return None

    def stage(self, s, params, layer, kernels, shared):
        return PLEStage(s, params, kernels)

    def layer_term(self, s, params, layer, kernels):
        return LayerEmbedding(s, params, f"layers.{layer}.ple.", kernels)

    def cost(self, s, position):
        """A token reads one row of each table."""
        p = s.section(PLESection)
        return Cost(lookups=("unigram.weight", *(f"ngram.{m}.weight" for m in range(2, p.ngram + 1))))
