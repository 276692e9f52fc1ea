"""The owner table of a session, generated from the model's spec (one source of truth): the
frame's owners, then what each kind keeps (`layers.kind`), in a fixed order."""
from __future__ import annotations

import torch

from hebrus.layers.kind import KINDS, check_unique
from hebrus.layers.spec import ModelSpec
from hebrus.state.owners import OwnerSpec

FRONTIER = "frontier"       # the banked owner holding a session's frontier (the transaction writes it)
OUTPUT = "logits"           # the banked owner a transaction copies out to its caller (the head writes it)


def owner_table(s: ModelSpec, dtype: torch.dtype, state_dtype: torch.dtype) -> list[tuple[OwnerSpec, object, str]]:
    """(owner, the kind that keeps it or None for the frame, its name within the kind): the
    frontier, the residual and the logits; each branch's; each layer's mixer's and ffn's; then
    what mixers and ffns keep once per model (the routes)."""
    n, D, V = s.hc_streams, s.hidden_size, s.vocab_size
    table = [(OwnerSpec(FRONTIER, (), torch.int64), None, FRONTIER),
             (OwnerSpec("residual", (n, D), dtype), None, "residual"),
             (OwnerSpec(OUTPUT, (V,), dtype), None, OUTPUT)]

    def model_wide(kind):
        return [(o, kind, o.name.removeprefix(kind.name + ".")) for o in kind.model_owners(s, dtype, state_dtype)]

    for name in s.branches:
        table += model_wide(KINDS[name])
    for layer, kinds in s.layer_kinds():
        for kind in kinds:
            prefix = f"layers.{layer}.{kind.name}."
            table += [(o, kind, o.name.removeprefix(prefix)) for o in kind.owners(s, prefix, dtype, state_dtype)]
    for kind in s.kinds():
        if kind.role != "branch":
            table += model_wide(kind)
    check_unique(((owner.name, kind) for owner, kind, _ in table), "owner", "kept")
    return table


def owner_specs(s: ModelSpec, dtype: torch.dtype, state_dtype: torch.dtype) -> list[OwnerSpec]:
    return [owner for owner, _, _ in owner_table(s, dtype, state_dtype)]
