"""Per-layer embeddings: unigram + hashed n-gram tables, then a causal conv with a SiLU branch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hebrus.layers.spec import ModelSpec
from hebrus.ops.conv import causal_conv
from hebrus.ops.ple import ngram_buckets
from hebrus.weights.pages import PageClaim, PagedTable, take


class PerLayerEmbedding:
    def __init__(self, c: ModelSpec, params: dict[str, torch.Tensor]):
        self.unigram = params["ple.unigram.weight"]
        self.tables = [params[f"ple.ngram.{m}.weight"] for m in range(2, c.ple_ngram + 1)]
        self.constants = params["ple.hash_constants"]
        self.conv_w = params["ple.conv.weight"]
        self.buckets = c.ple_buckets
        self.layers, self.dim = c.num_layers, c.ple_dim

    def claims(self, hold) -> dict[int, PageClaim]:
        """One claim per paged table for this chunk, each handed to `hold` (the transaction's)."""
        claims = {}
        for table in (self.unigram, *self.tables):
            if isinstance(table, PagedTable):
                claims[id(table)] = claim = PageClaim(table)
                hold(claim)
        return claims

    def hashes(self, ids: torch.Tensor, history: torch.Tensor) -> list[torch.Tensor]:
        return ngram_buckets(ids, history, self.constants, self.buckets)

    def __call__(self, ids: torch.Tensor, hashes: list[torch.Tensor], conv_state: torch.Tensor,
                 sessions: bool = False, claims: dict | None = None, each: bool = False):
        """ids [T] -> (ple [T, L, P], conv_state [Kp-1, L·P]). With `sessions`, id i is one
        token of session i, whose conv state is conv_state[i]. Paged tables (`weights.pages`)
        are read through this chunk's `claims`. With `each`, the conv state after every token
        [T, Kp-1, L·P]."""
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
