"""The stored layout of a model: the layers' tensors (`layers.layout`) with a quantized model's
quantized weights as their parts (`weights.quant`), each tensor's dtype, and what loading
allocates. The one place that knows both the layers and the stored formats."""
from __future__ import annotations

import math

import torch

from hebrus.layers import layout as layers
from hebrus.layers.layout import float_shapes, quantized   # with what follows: the layout a load is handed
from hebrus.layers.spec import ModelSpec
from hebrus.weights.quant import QUANTIZED_DTYPES, folded, is_part, part_dtype, stored_shapes
from hebrus.weights.table import FLOAT_DTYPES

# safetensors dtype names a file may store integer weights (the hash constants) in: those int64
# holds exactly.
INTEGER_DTYPES = ("I8", "I16", "I32", "I64", "U8", "U16", "U32")


def parameter_shapes(s: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The stored tensors and their shapes: a quantized model's quantized weights as their parts."""
    return stored_shapes(float_shapes(s), quantized(s), s.quantization)


def as_layers_read(s: ModelSpec, params: dict, matmul) -> dict:
    """`params` as the stages take them: a quantized model's parts folded into `Quantized`
    weights multiplied by `matmul` (the op table's `quantized_linear`)."""
    return folded(params, s.quantization, float_shapes(s), quantized(s), matmul)


def storage_dtype(name: str, dtype: torch.dtype) -> torch.dtype | None:
    """A stored tensor's dtype in a model of `dtype`: a quantized weight's codes and zero points
    as stored (None), its scales float32; a float weight's as `layers.layout.float_dtype` says."""
    if is_part(name):
        return torch.float32 if name.endswith(".qscale") else None
    return layers.float_dtype(name, dtype)


def stored_dtypes(name: str) -> tuple[str, ...]:
    """The safetensors dtypes a Hebrus checkpoint may store `name` in."""
    for suffix, allowed in QUANTIZED_DTYPES.items():
        if name.endswith(suffix):
            return allowed
    return INTEGER_DTYPES if layers.integer(name) else FLOAT_DTYPES


def load_bytes(s: ModelSpec, dtype: torch.dtype = torch.float32, skip=None) -> int:
    """An upper bound on what loading `s` in `dtype` allocates, from the config alone: every
    parameter in its storage dtype (the loader reads into these final buffers), plus the
    largest tensor twice at 8 bytes (its file tensors and the tensor built from them, while a
    transformed tensor is made), plus per rotary width the float64 build of its tables (angles,
    cos, sin and the cast copy: 4 × 8 bytes per [max_context, width] entry)."""
    shapes = {n: shape for n, shape in parameter_shapes(s).items() if skip is None or not skip(n)}   # skip: left in files
    params = sum(math.prod(shape) * _itemsize(s, name, dtype) for name, shape in shapes.items())
    largest = max(math.prod(shape) for shape in shapes.values())
    return params + 16 * largest + 32 * s.max_context * sum(layers.rotary_widths(s))


def _itemsize(s: ModelSpec, name: str, dtype: torch.dtype) -> int:
    kept = storage_dtype(name, dtype)
    return (part_dtype(name, s.quantization) if kept is None else kept).itemsize
