"""The model's own tensors (docs/checkpoint.md): names, shapes, the kind each belongs to, and
their random initialisation, generated from the spec and the kinds' declarations. This is the
single source of truth: a Hebrus checkpoint stores exactly these names, every family's names
table builds them, and a quantized model stores the kinds' `quantized` weights as their parts
(`weights.quant`, composed with this in `models.layout`).

Initialisation is deterministic and seeded and makes every component do something: projections
N(0, 1/fan_in), norm weights 1, the embedding N(0, 1), and what each kind's `init` draws (gates
and decays in their unsaturated range, hash constants)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hebrus.layers import hyper
from hebrus.layers.kind import CPU32, KINDS, Kind, check_unique, normal
from hebrus.layers.spec import ModelSpec
from hebrus.ops.quant import rows_together, runs_of


@dataclass(frozen=True)
class Weight:
    name: str
    shape: tuple[int, ...]
    kind: Kind | None               # None: the frame's (embedding, residual, norms, head)
    leaf: str                       # its name within the kind (what the kind declares)


def layout(s: ModelSpec) -> list[Weight]:
    """Every weight in order: the embedding, each branch's own, then layer by layer the
    residual's maps, the two norms, the mixer's, the ffn's and each branch's term; what mixers
    and ffns keep once per model; the head's residual, norm and output projection."""
    V, D = s.vocab_size, s.hidden_size
    out = [Weight("embed.weight", (V, D), None, "embed.weight")]
    for name in s.branches:
        out += _model_wide(s, KINDS[name])
    for layer, kinds in s.layer_kinds():
        p = f"layers.{layer}."
        frame = hyper.sublayer_weights(s, p + "mixer_hc") | hyper.sublayer_weights(s, p + "ffn_hc")
        frame |= {p + "mixer_norm.weight": (D,), p + "ffn_norm.weight": (D,)}
        out += [Weight(name, shape, None, name) for name, shape in frame.items()]
        for kind in kinds:
            prefix = f"{p}{kind.name}."
            out += [Weight(name, shape, kind, name.removeprefix(prefix))
                    for name, shape in kind.weights(s, prefix).items()]
    for kind in s.kinds():
        if kind.role != "branch":
            out += _model_wide(s, kind)
    head = hyper.head_weights(s) | {"norm.weight": (D,)} | ({} if s.tie_embeddings else {"lm_head.weight": (V, D)})
    out += [Weight(name, shape, None, name) for name, shape in head.items()]
    check_unique(((w.name, w.kind) for w in out), "weight", "named")
    return out


def _model_wide(s: ModelSpec, kind: Kind) -> list[Weight]:
    weights = kind.model_weights(s)
    outside = [name for name in weights if not name.startswith(kind.name + ".")]
    if outside:
        raise TypeError(f"layer kind {kind.name!r} names model-wide weights outside {kind.name}.*: {outside[:3]}")
    return [Weight(name, shape, kind, name.removeprefix(kind.name + ".")) for name, shape in weights.items()]


def side_by_side(s: ModelSpec, params: dict) -> None:
    """Lay the weights that a kind multiplies by one input (`Kind.side_by_side`) together, in
    place in `params`, so fast mode makes one product of them (`ops.quant.Products`) and no
    weight is held twice: each run of a group's members stored alike (float matrices of one
    dtype; quantized weights, whose codes, scales and zero points each lie so, fp8's in whole
    blocks of rows but the last) in one tensor a part, rows one member after another, each
    member's entry a view of its rows (each copied once, its own tensor let go). A quantized
    model's group may hold two runs (a GDN's quantized q/k/v and z, then its float b and a). A
    run laid so already, alone in its storage, is not copied again (a model in another mode
    shares it); a member left alone that is a view of a larger tensor (a group laid before some
    were quantized) gets its own copy, so that tensor is let go."""
    block = s.quantization.group if s.quantization is not None else 0
    for layer, kinds in s.layer_kinds():
        for kind in kinds:
            for group in kind.side_by_side:
                members = [_parts(f"layers.{layer}.{kind.name}.{leaf}", params) for leaf in group]
                for run in runs_of(members, lambda run: _joinable(run, params, block)):
                    _lay(run, params)


def _parts(name: str, params: dict) -> tuple[str, ...]:
    """A weight's entries in `params`: its own name, or a quantized weight's parts."""
    if name in params:
        return (name,)
    stem = name.removesuffix(".weight")
    return tuple(stem + part for part in (".qweight", ".qscale", ".qzero") if stem + part in params)


def _joinable(members: list[tuple[str, ...]], params: dict, block: int) -> bool:
    first = members[0]
    if not first or any(len(m) != len(first) for m in members):
        return False
    for i in range(len(first)):
        ts = [params[m[i]] for m in members]
        if not all(type(t) is torch.Tensor and t.dim() >= 1 and t.dtype == ts[0].dtype and t.device == ts[0].device
                   and t.shape[1:] == ts[0].shape[1:] for t in ts):
            return False
    if len(first) == 1:                         # float matrices
        return all(params[m[0]].dim() == 2 and params[m[0]].is_floating_point() for m in members)
    fp8 = params[first[0]].dtype == torch.float8_e4m3fn
    return not fp8 or all(params[m[0]].shape[0] % block == 0 for m in members[:-1])


def _lay(run: list[tuple[str, ...]], params: dict) -> None:
    """One run's members laid together, part by part (or a member alone given its own copy)."""
    for i in range(len(run[0])):
        names = [m[i] for m in run]
        ts = [params[n] for n in names]
        held = sum(t.numel() * t.element_size() for t in ts)
        if rows_together(ts) is not None and ts[0].untyped_storage().nbytes() == held:
            continue                                          # laid so already, alone in its storage
        if len(ts) == 1:
            params[names[0]] = ts[0].clone()
            continue
        whole, at = torch.cat(ts), 0
        for name, t in zip(names, ts):
            params[name], at = whole[at:at + t.shape[0]], at + t.shape[0]


def float_shapes(s: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every weight unquantized, as the layers use it."""
    return {w.name: w.shape for w in layout(s)}


def quantized(s: ModelSpec) -> set[str]:
    """The weights a quantized model stores quantized: those its kinds declare."""
    return {w.name for w in layout(s) if w.kind is not None and w.leaf in w.kind.quantized}


def kind_of(name: str) -> tuple[Kind | None, str]:
    """The kind a weight's name belongs to and its name within the kind, read from the name as
    the layout writes it (`layers.{l}.{kind}.{leaf}`, or `{kind}.{leaf}` for a kind's
    model-wide weights); (None, name) for the frame's."""
    parts = name.split(".", 3)
    if parts[0] == "layers" and len(parts) == 4 and parts[2] in KINDS:
        return KINDS[parts[2]], parts[3]
    if len(parts) > 1 and parts[0] in KINDS:
        return KINDS[parts[0]], name.split(".", 1)[1]
    return None, name


def integer(name: str) -> bool:
    """Whether a weight is integer (int64): its kind's `integer` (hash constants)."""
    kind, leaf = kind_of(name)
    return kind is not None and leaf in kind.integer


def float_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """A float weight's dtype in a model of `dtype`: hyper-connection parameters, norm weights
    (a scale near 1, which a 16-bit type rounds coarsely) and its kind's `wide` weights (decays)
    in at least float32; integer weights int64; everything else `dtype`."""
    kind, leaf = kind_of(name)
    if kind is not None and leaf in kind.integer:
        return torch.int64
    wide = "_hc." in name or name.startswith("head_hc.") or name.endswith("norm.weight")
    if wide or (kind is not None and leaf in kind.wide):
        return torch.float64 if dtype == torch.float64 else torch.float32
    return dtype


def parameter_count(s: ModelSpec) -> int:
    return sum(math.prod(w.shape) for w in layout(s) if not integer(w.name))


def rotary_widths(s: ModelSpec) -> set[int]:
    """The widths the model builds rotary tables for (one [max_context, width] cos/sin pair each)."""
    return set().union(*(kind.rotary_widths(s) for kind in s.kinds()))


# ---- initialisation ------------------------------------------------------------------------

def init_parameters(s: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 (int64 for integer weights) tensors on the CPU, keyed by the model's own names,
    drawn in layout order from one generator seeded with `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return {w.name: _draw(w, gen) for w in layout(s)}


def _draw(w: Weight, gen: torch.Generator) -> torch.Tensor:
    if w.kind is None:                                  # the frame's: only the residual's draw its own
        drawn = hyper.init(w.name.rsplit(".", 1)[-1], w.shape, gen) if "_hc." in w.name else None
    else:
        drawn = w.kind.init(w.leaf, w.shape, gen)
    return default_draw(w.name, w.shape, gen) if drawn is None else drawn


def default_draw(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Norm weights 1, the embedding N(0, 1), projections N(0, 1/fan_in) (fan_in: the last dim)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, **CPU32)
    if name == "embed.weight":
        return normal(shape, 1.0, gen)
    return normal(shape, 1.0 / math.sqrt(shape[-1]), gen)
