"""`ModelSpec`: what the shared layers are built from.

Every family (`hebrus.models`) translates its own config into one of these; the layers, the
owner table and the tensor layout read only this. The spec holds what every model has (the
vocabulary, the width, the residual, which kind each layer's mixer and ffn is, which branches
run beside them) and one *section* per kind in use: each kind's dimensions, a dataclass its own
module defines (`spec.section(Section)`). A kind is checked against the registry
(`layers.kind`) here, and nowhere else.

The residual is the frame around every sublayer: "hyper" (n hyper-connection streams, Sinkhorn
mixing) or "plain" (x + f(norm(x)), exactly; one stream).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator, TypeVar

from hebrus.errors import InvalidInput
from hebrus.layers.kind import KINDS, kinds_of

RESIDUALS = ("hyper", "plain")
Section = TypeVar("Section")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    mixers: tuple[str, ...]
    ffns: tuple[str, ...]
    max_context: int
    rms_norm_eps: float
    tie_embeddings: bool = False
    # the residual
    residual: str = "hyper"
    hc_streams: int = 1
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # kinds that run beside the layers ("ple": per-layer embeddings)
    branches: tuple[str, ...] = ()
    # each kind's dimensions: instances of the kinds' section dataclasses, one per type
    sections: tuple = ()
    # weights: None, or a weights.quant.Quantization (which projections are stored quantized, how)
    quantization: object = None
    # K/V rows and index keys: None (the model dtype), or "int8" / "fp8" codes with a scale per row
    kv_cache: str | None = None

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise InvalidInput(f"invalid {self.family} model: " + "; ".join(problems))

    def _problems(self) -> Iterator[str]:
        if len(self.mixers) != len(self.ffns):
            yield f"{len(self.mixers)} mixers for {len(self.ffns)} feed-forward layers"
        for role, names in (("mixer", self.mixers), ("ffn", self.ffns), ("branch", self.branches)):
            for name in dict.fromkeys(names):
                if name not in KINDS or KINDS[name].role != role:
                    yield f"unknown {role} {name!r}; {role}s are {', '.join(sorted(kinds_of(role)))}"
        if self.residual not in RESIDUALS:
            yield f"unknown residual {self.residual!r}; residuals are {', '.join(RESIDUALS)}"
        if self.residual == "plain" and self.hc_streams != 1:
            yield "a plain residual has one stream"
        types = [type(section) for section in self.sections]
        if len(set(types)) != len(types):
            yield "two sections of one type"
        for kind in self.kinds():
            if kind.section is not None and kind.section not in types:
                yield f"{kind.name} layers need a {kind.section.__name__}"
        for section in self.sections:
            yield from section.problems(self)

    # ---- derived ---------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.mixers)

    def kinds(self) -> list:
        """The registered kinds the model uses, each once, in the order it first appears:
        branches, then layer by layer its mixer and its ffn."""
        names = dict.fromkeys((*self.branches, *(k for pair in zip(self.mixers, self.ffns) for k in pair)))
        return [KINDS[name] for name in names if name in KINDS]

    def layer_kinds(self) -> Iterator[tuple[int, tuple]]:
        """(layer, its kinds in order: the mixer, the ffn, then each branch's term)."""
        for layer, (mixer, ffn) in enumerate(zip(self.mixers, self.ffns)):
            yield layer, (KINDS[mixer], KINDS[ffn], *(KINDS[name] for name in self.branches))

    def section(self, of: type[Section]) -> Section:
        """This model's section of type `of` (a kind's dimensions)."""
        for section in self.sections:
            if type(section) is of:
                return section
        raise KeyError(f"{self.family} model has no {of.__name__}")

    @property
    def keeps_rows(self) -> bool:
        """Whether a layer keeps K/V rows (what a kv-cache format applies to)."""
        return any(kind.keeps_rows for kind in self.kinds())

    def fields_in_use(self) -> list[tuple[str, object]]:
        """(name, value) of what the model's layers read: the common fields (no hyper-connection
        fields for a plain residual), then each section in use, its fields named `section.field`."""
        hidden = {"family", "sections"}
        if self.residual == "plain":
            hidden |= {"hc_streams", "hc_sinkhorn_iters", "hc_eps"}
        fields = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in hidden]
        used = {kind.section for kind in self.kinds()}
        for section in self.sections:
            if type(section) in used:
                idle = getattr(section, "unused", lambda s: ())(self)
                fields += [(f"{section.key}.{f.name}", getattr(section, f.name)) for f in dataclasses.fields(section)
                           if f.name not in idle]
        return fields

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)
