"""Hash-routed experts, an ffn kind (DeepSeek-V4's first layers): the MoE kind's experts, shared
expert and weights by router score, but each token's experts are fixed by its id, a row of a
frozen table (`router.table` [vocab, top_k]), not chosen. Its routes are recorded with the
routed layers' (`layers.moe.routed_layers`), so a step's experts are state like any routed
layer's."""
from __future__ import annotations

import torch

from hebrus.layers.moe import ExpertsSection, MoE, RoutedFeed


class HashMoE(MoE):
    name = "hash_moe"
    wide = ()
    integer = ("router.table",)

    def weights(self, s, prefix):
        """The MoE kind's, without the correction bias (nothing is chosen), with the table."""
        shapes = super().weights(s, prefix)
        shapes.pop(f"{prefix}router.bias", None)
        return shapes | {f"{prefix}router.table": (s.vocab_size, s.section(ExpertsSection).top_k)}

    def init(self, leaf, shape, gen):
        """Each token's experts: the first top_k ids in a random order of its own (a draw knows
        the table's shape, not the number of experts; a checkpoint brings its own table)."""
        if leaf == "router.table":
            return torch.rand(shape, generator=gen).argsort(-1)
        return super().init(leaf, shape, gen)

    def stage(self, s, params, layer, kernels, shared):
        return RoutedFeed(s, params, layer, kernels, self.name)

    def ops(self, mode, device, dtype):
        """None of its own: its experts run through the MoE kind's (`moe.experts`)."""
        return {}
