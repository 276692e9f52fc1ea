"""How a quantized model stores its quantized weights, and the model-level steps: quantizing a
model's parameters, and folding stored parts back into `ops.quant.Quantized` weights for the
layers.

Which weights are quantized is the layer kinds' declaration (`quantized`), handed to every
function here as a set of names: the large projections. Embeddings, the output head, norms,
routers, the indexer, the hyper-connection maps, PLE tables and convolutions stay in the model's
dtype: they are small, or read a row at a time, or steer discrete choices. A quantized weight
`X.weight` (or an expert stack `X`) is stored as `X.qweight` (the codes), `X.qscale` (float32
scales) and, for int4 with zero points, `X.qzero`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hebrus.errors import InvalidInput
from hebrus.ops.quant import BLOCK, FORMATS, FP8, GROUP, Quantized, check_scales, dense, quantize
from hebrus.weights.table import NamesTable, Source

PARTS = (".qweight", ".qscale", ".qzero")
QUANTIZED_DTYPES = {".qweight": ("I8", "U8", "F8_E4M3"), ".qscale": ("F32",), ".qzero": ("U8",)}   # safetensors
QUANT_FORMATS = ("int8", "int4", "int4-zp", "fp8")       # what `quantize=` takes


@dataclass(frozen=True)
class Quantization:
    format: str                     # one of ops.quant.FORMATS
    group: int = 0                  # int4: inputs per group; fp8: block side (0: the format's default)
    zero_point: bool = False        # int4: a zero point per group (else symmetric)

    def __post_init__(self):
        if self.format not in FORMATS:
            raise InvalidInput(f"unknown quantization format {self.format!r}; formats are: {', '.join(FORMATS)}")
        if self.group == 0:
            object.__setattr__(self, "group", BLOCK if self.format == "fp8" else GROUP)
        if not isinstance(self.group, int) or isinstance(self.group, bool) or not 2 <= self.group <= 4096 \
                or self.group % 2:
            raise InvalidInput(f"quantization group must be an even integer from 2 to 4096, got {self.group!r}")
        if not isinstance(self.zero_point, bool):
            raise InvalidInput(f"zero_point must be true or false, got {self.zero_point!r}")
        if self.zero_point and self.format != "int4":
            raise InvalidInput("zero points are an int4 option")

    @classmethod
    def parse(cls, value: "str | Quantization") -> "Quantization":
        """"int8", "int4", "int4-zp" (with zero points), "fp8", or a Quantization."""
        if isinstance(value, Quantization):
            return value
        if value == "int4-zp":
            return cls("int4", zero_point=True)
        if not isinstance(value, str) or value not in QUANT_FORMATS:
            raise InvalidInput(f"quantize must be one of {', '.join(QUANT_FORMATS)}, got {value!r}")
        return cls(value)

    @property
    def name(self) -> str:
        return "int4-zp" if self.zero_point else self.format

    def __str__(self) -> str:
        how = {"int8": "per output channel", "fp8": f"e4m3, {self.group} × {self.group} blocks",
               "int4": f"groups of {self.group}, " + ("zero points" if self.zero_point else "symmetric")}
        return f"{self.format} ({how[self.format]})"

    def to_config(self) -> dict[str, Any]:
        """As `quantization_config` in config.json (fp8 in the layout Qwen's FP8 checkpoints use)."""
        if self.format == "fp8":
            return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [self.group, self.group]}
        return {"quant_method": "hebrus", "format": self.format, "group_size": self.group,
                "zero_point": self.zero_point}

    @classmethod
    def from_config(cls, data: Any) -> "Quantization":
        """From config.json's `quantization_config`; InvalidInput for anything else than the two
        methods, with fields of their types (the caller names the file)."""
        if not isinstance(data, dict):
            raise InvalidInput("quantization_config must be an object")
        method = data.get("quant_method")
        if method == "fp8":
            block = data.get("weight_block_size", [BLOCK, BLOCK])
            if data.get("fmt", "e4m3") != "e4m3" or not isinstance(block, list) or len(block) != 2 \
                    or block[0] != block[1] or not _whole(block[0]):
                raise InvalidInput(f"fp8 checkpoints are read in e4m3 with square weight blocks, "
                                   f"got fmt={data.get('fmt')!r}, weight_block_size={block!r}")
            return cls("fp8", block[0])
        if method == "hebrus":
            group, zero_point = data.get("group_size", GROUP), data.get("zero_point", False)
            if not _whole(group) or not isinstance(zero_point, bool):
                raise InvalidInput(f"quantization_config needs group_size a positive integer and zero_point "
                                   f"true or false, got {group!r} and {zero_point!r}")
            return cls(data.get("format"), group, zero_point)
        raise InvalidInput(f"quantization method {method!r} is not supported (hebrus: "
                           f"int8/int4; fp8 with weight blocks)")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def base(name: str) -> str:
    """`X.weight` -> `X`, an expert stack's name as it is."""
    return name.removesuffix(".weight")


def is_part(name: str) -> bool:
    return name.endswith(PARTS)


def part_shapes(name: str, shape: tuple[int, ...], q: Quantization) -> dict[str, tuple[int, ...]]:
    """The stored parts of the weight `name` of `shape` [..., out, in]."""
    *lead, out, inputs = shape
    b, groups = base(name), -(-inputs // q.group)
    if q.format == "int8":
        return {b + ".qweight": shape, b + ".qscale": (*lead, out)}
    if q.format == "int4":
        parts = {b + ".qweight": (*lead, out, -(-inputs // 2)), b + ".qscale": (*lead, out, groups)}
        if q.zero_point:
            parts[b + ".qzero"] = (*lead, out, groups)
        return parts
    return {b + ".qweight": shape, b + ".qscale": (*lead, -(-out // q.group), groups)}


def stored_shapes(shapes: dict[str, tuple[int, ...]], quantized: set[str], q: Quantization | None
                  ) -> dict[str, tuple[int, ...]]:
    """The stored tensors and their shapes, from the float layout: each of the `quantized`
    weights as its parts."""
    if q is None:
        return dict(shapes)
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        out.update(part_shapes(name, shape, q) if name in quantized else {name: shape})
    return out


def part_dtype(name: str, q: Quantization) -> torch.dtype:
    if name.endswith(".qscale"):
        return torch.float32
    if name.endswith(".qzero"):
        return torch.uint8
    return {"int8": torch.int8, "int4": torch.uint8, "fp8": FP8}[q.format]


def quantize_params(params: dict[str, torch.Tensor], q: Quantization, quantized: set[str]
                    ) -> dict[str, torch.Tensor]:
    """The parameters with each of the `quantized` weights replaced by its stored parts."""
    out = {}
    for name, t in params.items():
        if name not in quantized:
            out[name] = t
            continue
        got = quantize(t, q.format, q.group, q.zero_point)
        b = base(name)
        out[b + ".qweight"], out[b + ".qscale"] = got.qweight, got.scale
        if got.zero is not None:
            out[b + ".qzero"] = got.zero
    return out


def folded(params: dict[str, Any], q: Quantization | None, shapes: dict[str, tuple[int, ...]],
           quantized: set[str], matmul=None) -> dict[str, Any]:
    """The parameters as the layers read them: each of the `quantized` weights' parts folded into
    one `Quantized` under the weight's own name (`shapes`: the float layout's shapes), multiplied
    by `matmul` (the op table's choice; None: `ops.quant.rebuilt_linear`)."""
    if q is None:
        return params
    out = {name: t for name, t in params.items() if not is_part(name)}
    for name, shape in shapes.items():
        if name in quantized:
            b = base(name)
            out[name] = Quantized(q.format, params[b + ".qweight"], params[b + ".qscale"], params.get(b + ".qzero"),
                                  shape[-1], q.group, matmul)
    return out


def check_parts(params: dict[str, torch.Tensor], q: Quantization | None, where: str = "") -> None:
    """Refuse scales that are not finite and positive, int4 zero points past 15 and int8 codes
    of -128 (`where`, when given, starts the message: the checkpoint folder)."""
    if q is None:
        return
    lead = f"{where}: " if where else ""
    for name, t in params.items():
        problem = None
        if name.endswith(".qscale"):
            problem = check_scales(name, t)
        elif name.endswith(".qzero") and bool((t > 15).any()):
            problem = f"{name}: int4 zero points must lie in 0..15"
        elif name.endswith(".qweight") and t.dtype == torch.int8 and bool((t == -128).any()):
            problem = f"{name}: int8 codes must lie in -127..127"
        if problem:
            raise InvalidInput(lead + problem)


def restrict_dtypes(table, q: Quantization) -> None:
    """Each stored part admits its format's dtype only (an int4 code read as int8 would shift
    its sign in)."""
    stored = {torch.int8: "I8", torch.uint8: "U8", FP8: "F8_E4M3", torch.float32: "F32"}
    allowed = table.dtypes

    def dtypes(name: str) -> tuple[str, ...]:
        if is_part(name):
            return (stored[part_dtype(name, q)],)
        return allowed(name)
    table.dtypes = dtypes


SCALE_SUFFIX = "_scale_inv"        # an fp8 file tensor's block scales, beside it (`X.weight_scale_inv`)


def quantized_table(table, q: Quantization, shapes: dict[str, tuple[int, ...]], quantized: set[str],
                    on_disk: set[str]):
    """A foreign family's names table for a quantized spec, from its float table: where a file
    holds a weight in fp8 with block scales beside it, a weight the model keeps quantized takes
    the codes and scales as they are (a weight built from several file tensors, or split from
    one, is rebuilt and quantized again; with blocks that align, to the same codes); a weight the
    model keeps in float is rebuilt from them; a quantized weight stored in float is quantized as
    it loads (`shapes`: the float layout's)."""
    out = NamesTable(dict(table.shapes), {}, table.ignored)

    def stored(file: str) -> bool:
        return file + SCALE_SUFFIX in on_disk

    def scales_of(file: str) -> str:
        """The file tensor's scales, listed with the shape its blocks give."""
        if len(table.shapes[file]) < 2:
            raise InvalidInput(f"{file}{SCALE_SUFFIX}: block scales beside a tensor of "
                               f"{len(table.shapes[file])} dimensions (only matrices are stored in fp8)")
        *lead, rows, cols = table.shapes[file]
        out.shapes[file + SCALE_SUFFIX] = (*lead, -(-rows // q.group), -(-cols // q.group))
        return file + SCALE_SUFFIX

    def rebuilt(src) -> Source:
        """The float weight from the source's file tensors, each fp8 one rebuilt from its scales."""
        files = src.names + tuple(scales_of(f) for f in src.names if stored(f))

        def build(*tensors):
            codes, scales, parts = tensors[:len(src.names)], iter(tensors[len(src.names):]), []
            for f, t in zip(src.names, codes):
                if stored(f):
                    scale = next(scales).float()
                    problem = check_scales(f + SCALE_SUFFIX, scale)
                    if problem:
                        raise InvalidInput(problem)
                    t = dense(Quantized("fp8", t, scale, None, t.shape[-1], q.group), torch.float32)
                parts.append(t)
            return src.build(*parts)
        return Source(files, build)

    for name, src in table.sources.items():
        if name not in quantized:
            out.sources[name] = rebuilt(src) if any(stored(f) for f in src.names) else src
            continue
        b = base(name)
        if q.format == "fp8" and src.is_copy and stored(src.names[0]) and tuple(table.shapes[src.names[0]]) == shapes[name]:
            out.sources[b + ".qweight"] = Source(src.names)
            out.sources[b + ".qscale"] = Source((scales_of(src.names[0]),), lambda s: s.float())    # checked at load
            continue
        whole = rebuilt(src) if any(stored(f) for f in src.names) else src
        fields = {".qweight": "qweight", ".qscale": "scale"} | ({".qzero": "zero"} if q.zero_point else {})
        for suffix, field in fields.items():       # each part quantizes the weight again: loads are rare
            out.sources[b + suffix] = Source(whole.names, lambda *t, build=whole.build, field=field: getattr(
                quantize(build(*t), q.format, q.group, q.zero_point), field))

    def dtypes(name: str) -> tuple[str, ...]:
        if name.endswith(SCALE_SUFFIX):
            return ("F32", "BF16")
        if stored(name):
            return ("F8_E4M3",)
        return table.dtypes(name)
    out.dtypes = dtypes
    return out
