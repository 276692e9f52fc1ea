"""What a layer kind declares, and the registry that holds every kind.

A kind is one module of `layers/` holding a subclass of `Kind`: its section of the spec, its
stage, its weights, its owners, which of its weights may be stored quantized, how its random
weights are drawn, and what a token costs it. Defining the class checks that every declaration
is there (a kind that forgets one fails at import, naming it) and registers it under its name;
`layers/__init__.py` imports each kind's module, one line a kind. The owner table, the tensor
layout, quantization, initialisation, the stage list and the bench's limits are loops over
this registry; an unknown kind fails in one place, the spec's check.

Roles: a "mixer" and an "ffn" fill one layer's two sublayers (the spec's `mixers` and `ffns`);
a "branch" runs beside the layers (the spec's `branches`): a stage of its own after the
embedding, and a term added to every feed-forward sublayer's output.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

ROLES = ("mixer", "ffn", "branch")
SHARDS = ("split", "whole", "no")         # how a kind's layer lies over tensor-parallel ranks
KINDS: dict[str, "Kind"] = {}

# What every kind declares, and what a branch adds.
DECLARATIONS = ("name", "role", "section", "quantized", "weights", "owners", "init", "stage", "cost")
BRANCH_DECLARATIONS = ("layer_term",)


@dataclass(frozen=True)
class Cost:
    """What one token at `position` costs one layer of a kind, besides one multiply-add per
    element of each weight it uses (for the bench's floor and roofline)."""
    shares: dict[str, float] = field(default_factory=dict)  # weight -> fraction a token uses (absent: 1)
    lookups: tuple[str, ...] = ()       # weights a token reads one row of, multiplying nothing
    rows: dict[str, int] = field(default_factory=dict)      # appended owner -> rows read (absent: every row)
    flops: float = 0.0                  # beyond the weights': attention's scores and sums


class Kind:
    """The declarations, each documented here; a kind defines every one of them.

    name: str                   how the spec names it ("gdn")
    role: str                   one of ROLES
    section: type | None        its dimensions, a frozen dataclass found in the spec by its type
                                (`spec.section(Section)`); kinds may share one; None: no dimensions
    quantized: tuple[str, ...]  its weights (relative names) stored quantized in a quantized model
    weights(s, prefix)          {name: shape} of its weights in one layer, names starting with
                                `prefix` ("layers.3.gdn.")
    owners(s, prefix, dtype, state_dtype)
                                [OwnerSpec] it keeps per layer (banked or appended, with dtypes)
    init(leaf, shape, gen)      a random tensor for its weight `leaf` (the name after the prefix),
                                or None for the default draw (`layers.layout.default_draw`)
    stage(s, params, layer, kernels, shared)
                                mixers: the layer's mixer stage; ffns: the feed-forward function
                                the ffn stage calls (`layers.sublayer.FeedForward`); branches:
                                the stage run after the embedding. `shared` is a dict the model's
                                kinds may keep what several layers share in (rotary tables).
                                Weights arrive as the layers read them: a quantized one as an
                                `ops.quant.Quantized`, multiplied through `ops.quant.linear`.
                                Its `run(txn, step)` reads and writes state through `txn`
                                (`state.context.StepContext`) and learns what the step is from
                                `step` (`state.step.StepBatch`): N sessions' chunks, their
                                tokens one tensor [T, ...] (`step.bounds` say whose); banked
                                state reads as the value for one session, [N, ...] for several;
                                a mixer or ffn is a `sublayer.Sublayer` whose `framed(step,
                                body, state)` runs its body (normed input h -> output y) inside
                                the residual frame through `sublayer.scan`, which gives it one
                                session's chunk (exact mode: token by token) or several
                                sessions' single tokens (`step.one_each`, row i session i's);
                                a step that keeps values (`step.keeps`: after every token
                                of a prefix transaction, or after each of `step.marks`;
                                `scan` hands them back stacked, written with `write_each`); a planned
                                step (positions on the device only; rows written through
                                `step.put`). Values for later stages go in the step's fields
                                (`streams` and `pending`, which `framed` keeps; `terms`). It
                                makes no host sync.
    cost(s, position)           a `Cost`
    layer_term(s, params, layer, kernels)   branches only: the term its ffn sublayers add,
                                called as `term(h, its value's slice for the layer)`

    Optional, with defaults: `model_weights(s)` and `model_owners(s, dtype, state_dtype)` for
    what a kind keeps once per model (weights named under the kind's name, "ple.conv.weight";
    owners too, but for the routes, "routes"); `wide` and `integer`, its weights stored in at
    least float32 and in int64; `outputs`, its weights that write into the residual stream
    (training starts them small); `keeps_rows`, whether its owners are K/V rows a kv-cache format
    applies to; `rotary_widths(s)`; `ops(mode, device, dtype)`, ops of its own, a fast one or its
    twin chosen once with the model and reaching its stage as `kernels.ops[name]`. A range check
    of its own is a bit of `layers.checks.Check`. `side_by_side`: groups of its weights (leaf
    names) multiplied by one input, which every model lays in one tensor and fast mode multiplies
    in one product a group (`layers.layout.side_by_side`, `ops.quant.Products`).

    The section is a frozen dataclass with `key` (its name in `hebrus info`) and
    `problems(spec)` (what is wrong, as text), optionally `unused(spec)` (fields not in use).
    A base class that is not itself a kind is defined with `register=False`.

    Tensor parallelism (`layers.shard`): `shards` says how a kind's layer is laid over ranks:
    "split" (its heads or inner width divided among them: each rank holds its part of every
    weight and owner, and its output is a partial sum the frame adds up across ranks), "whole"
    (every rank holds all of it and computes the same), or "no" (not yet: a model with it
    refuses `tensor_parallel`, naming the kind). A kind that splits declares
    `shard_section(section, world)` (its section as each of `world` ranks holds it; a
    `ValueError` says why it cannot be divided so) and `shard_weight(s, leaf, weight, rank,
    world)` (rank `rank`'s part of its whole weight `leaf` in a model of spec `s`).
    """

    name: ClassVar[str]
    role: ClassVar[str]
    section: ClassVar[type | None]
    quantized: ClassVar[tuple[str, ...]]
    wide: ClassVar[tuple[str, ...]] = ()
    integer: ClassVar[tuple[str, ...]] = ()
    outputs: ClassVar[tuple[str, ...]] = ()
    keeps_rows: ClassVar[bool] = False
    side_by_side: ClassVar[tuple[tuple[str, ...], ...]] = ()
    shards: ClassVar[str] = "no"

    def __init_subclass__(cls, register: bool = True, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if register:
            _register(cls)

    def model_weights(self, s) -> dict[str, tuple[int, ...]]:
        return {}

    def model_owners(self, s, dtype: torch.dtype, state_dtype: torch.dtype) -> list:
        return []

    def rotary_widths(self, s) -> set[int]:
        """The widths it builds rotary tables for (each a [max_context, width] cos/sin pair)."""
        return set()

    def ops(self, mode: str, device, dtype) -> dict:
        """Ops of its own for a model of `mode` on `device` in `dtype`, by name."""
        return {}

    def shard_section(self, section, world: int):
        """Its section as each of `world` ranks holds it (kinds that split)."""
        return section

    def shard_weight(self, s, leaf: str, weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """Rank `rank`'s part of its weight `leaf` (kinds that split; whole otherwise)."""
        return weight


def _register(cls: type) -> None:
    wanted = DECLARATIONS + (BRANCH_DECLARATIONS if getattr(cls, "role", None) == "branch" else ())
    missing = [name for name in wanted if not hasattr(cls, name)]
    if missing:
        raise TypeError(f"layer kind {cls.__module__}.{cls.__name__} does not declare: {', '.join(missing)} "
                        f"(every kind declares {', '.join(DECLARATIONS)}; see hebrus.layers.kind)")
    if cls.shards not in SHARDS:
        raise TypeError(f"layer kind {cls.name!r} shards {cls.shards!r}; kinds shard as one of {', '.join(SHARDS)}")
    if cls.role not in ROLES:
        raise TypeError(f"layer kind {cls.name!r} has role {cls.role!r}; roles are {', '.join(ROLES)}")
    section = cls.section
    if section is not None and not (dataclasses.is_dataclass(section) and hasattr(section, "key")
                                    and callable(getattr(section, "problems", None))):
        raise TypeError(f"layer kind {cls.name!r}: its section {getattr(section, '__name__', section)!r} must be "
                        f"a dataclass with a `key` and `problems(spec)`")
    if cls.name in KINDS and _origin(type(KINDS[cls.name])) != _origin(cls):
        raise TypeError(f"two layer kinds are named {cls.name!r}: {type(KINDS[cls.name]).__module__} "
                        f"and {cls.__module__}")
    KINDS[cls.name] = cls()


def _origin(cls: type) -> tuple[str, str]:
    """Where a class is defined: a module run again (a reload) defines the same kind again."""
    return cls.__module__, cls.__qualname__


def kind_ops(mode: str, device, dtype) -> dict:
    """Every kind's own ops for a model of `mode` on `device` in `dtype` (`Kind.ops`)."""
    ops: dict = {}
    for kind in KINDS.values():
        for name, op in kind.ops(mode, device, dtype).items():
            if ops.setdefault(name, op) is not op:          # kinds that share a module may share ops
                raise TypeError(f"two layer kinds declare different ops named {name!r}")
    return ops


# Random draws for `init`: float32 on the CPU, whatever torch's defaults are set to.
CPU32 = {"dtype": torch.float32, "device": "cpu"}


def normal(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, **CPU32) * std


def uniform(shape: tuple[int, ...], lo: float, hi: float, gen: torch.Generator) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(shape, generator=gen, **CPU32)


# Parts of weights, for the kinds' `shard_weight`.
def divided(what: str, count: int, world: int) -> int:
    """count / world, or a ValueError saying what does not divide (for `shard_section`)."""
    if count % world:
        raise ValueError(f"its {what} ({count}) do not divide among {world} ranks")
    return count // world


def spans(weight: torch.Tensor, dim: int, *ranges: tuple[int, int]) -> torch.Tensor:
    """The index ranges of `weight` along `dim`, one after another, in a tensor of their own."""
    index = torch.cat([torch.arange(a, b) for a, b in ranges])
    return weight.index_select(dim, index.to(weight.device))


def own(rank: int, size: int, offset: int = 0) -> tuple[int, int]:
    """Rank `rank`'s range of `size` entries a rank, from `offset` (for `spans`)."""
    return offset + rank * size, offset + (rank + 1) * size


def check_unique(entries, what: str, verb: str) -> None:
    """Refuse a name two of (name, kind or None for the frame) `entries` give: two kinds (or a
    kind and the frame) naming one owner or weight would be merged silently."""
    seen: dict[str, str] = {}
    for name, kind in entries:
        by = kind.name if kind is not None else "the frame"
        if name in seen:
            raise TypeError(f"{what} {name!r} is {verb} by both {seen[name]} and {by}")
        seen[name] = by


def kinds_of(role: str) -> tuple[str, ...]:
    return tuple(name for name, kind in KINDS.items() if kind.role == role)
