"""Quantized weights: the formats, quantizing a float weight, and the matrix product over a
quantized one.

A weight W [..., out, in] (the leading dimensions, if any, index experts) is stored as a
`Quantized`: integer or fp8 codes and float32 scales, from which W is rebuilt as

  int8  per output channel, symmetric:   W[o, i] = q[o, i] · s[o]                     q ∈ [-127, 127]
  int4  groups of `group` inputs:        W[o, i] = (q[o, i] − z[o, g]) · s[o, g],      g = i // group,
                                         q ∈ [0, 15]; symmetric: z = 8; with zero points: z ∈ [0, 15]
                                         two codes a byte, the even input in the low nibble
  fp8   e4m3 in blocks of block×block:   W[o, i] = q[o, i] · s[o // block, i // block]

(the fp8 layout is that of Qwen's FP8 checkpoints, whose `weight_scale_inv` is s). A row, group
or block of zeros gets the scale 1 (and none underflows to 0), so every scale of a finite weight
is finite and positive; a weight whose scales are not is refused where it is loaded
(`check_scales`).

`linear(x, w)` is F.linear for a float weight; for a quantized one, the kernel the model's op
table gave it, or `rebuilt_linear`: the weight rebuilt in x's dtype, then multiplied, the
readable twin of every quantized kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from hebrus.errors import InvalidInput

FORMATS = ("int8", "int4", "fp8")
GROUP = 128           # int4: inputs per scale
BLOCK = 128           # fp8: rows and columns per scale
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass(frozen=True)
class Quantized:
    format: str                       # one of FORMATS
    qweight: torch.Tensor             # int8 [..., out, in]; uint8 [..., out, ceil(in/2)]; fp8 [..., out, in]
    scale: torch.Tensor               # float32 [..., out]; [..., out, groups]; [..., ceil(out/B), ceil(in/B)]
    zero: torch.Tensor | None = None  # int4 with zero points: uint8 [..., out, groups]
    inputs: int = 0                   # `in` (int4 packs two a byte, so qweight does not say it)
    group: int = GROUP                # int4: inputs per group; fp8: the block side
    matmul: Callable | None = field(default=None, compare=False)   # (x, self) -> x Wᵀ; None: `rebuilt_linear`

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.qweight.shape[:-1], self.inputs)

    @property
    def nbytes(self) -> int:
        parts = (self.qweight, self.scale) + ((self.zero,) if self.zero is not None else ())
        return sum(t.numel() * t.element_size() for t in parts)

    def __getitem__(self, index) -> "Quantized":
        """One expert of a stack (an index into the leading dimension)."""
        return Quantized(self.format, self.qweight[index], self.scale[index],
                         None if self.zero is None else self.zero[index], self.inputs, self.group, self.matmul)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W rebuilt (in float32, then rounded once to `dtype`)."""
        if self.format == "int8":
            w = self.qweight.float() * self.scale.unsqueeze(-1)
        elif self.format == "int4":
            q = unpack_int4(self.qweight, self.inputs).float()
            zero = 8.0 if self.zero is None else _expand(self.zero.float(), self.group, -1, self.inputs)
            w = (q - zero) * _expand(self.scale, self.group, -1, self.inputs)
        elif self.format == "fp8":
            out = self.qweight.shape[-2]
            scale = _expand(_expand(self.scale, self.group, -1, self.inputs), self.group, -2, out)
            w = self.qweight.float() * scale
        else:
            raise ValueError(f"unknown format {self.format!r}")
        return w.to(dtype)


def linear(x: torch.Tensor, w: torch.Tensor | Quantized) -> torch.Tensor:
    """x @ Wᵀ, W float or quantized (through the weight's own `matmul`, which the model's op
    table chose, or `rebuilt_linear`)."""
    if isinstance(w, Quantized):
        return (w.matmul or rebuilt_linear)(x, w)
    return F.linear(x, w)


class Products:
    """x Wᵢᵀ for several weights of one input x. `together` (fast mode): each run of weights that
    lie one after another in one storage (`laid_together`: float rows, or a quantized weight's
    codes, scales and zero points, as `layers.layout.side_by_side` lays them) is one product,
    each result a slice of its columns (a Qwen3.5 GDN's quantized q/k/v and z one, its float b and
    a another); otherwise one product each, the readable twin (exact mode's)."""

    def __init__(self, *weights, together: bool = False, linear=linear):
        """`linear(x, W) -> x Wᵀ`: the op table's product (`Kernels.linear`)."""
        self.weights, self.linear = weights, linear
        self.runs = _runs(weights) if together else [(w, None) for w in weights]
        # the whole group as one weight, where it is one run (SwiGLU's gate and up: `mlp.swiglu`)
        self.together = self.runs[0][0] if together and len(self.runs) == 1 and len(weights) > 1 else None
        self.sizes = self.runs[0][1] if self.together is not None else None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.together is not None:                   # one run: a fast-mode step's usual case
            return self.linear(x, self.together).split(self.sizes, dim=-1)
        out = []
        for w, sizes in self.runs:
            y = self.linear(x, w)
            out.extend(y.split(sizes, dim=-1) if sizes is not None else (y,))
        return tuple(out)


def _runs(weights) -> list[tuple]:
    """`weights` cut into runs that lie together, in order: (the run as one weight, its members'
    widths), or (a weight alone, None)."""
    return [(laid_together(run), [w.shape[-2] for w in run]) if len(run) > 1 else (run[0], None)
            for run in runs_of(weights, lambda run: laid_together(run) is not None)]


def runs_of(items, joinable) -> list:
    """`items` cut, in order, into the longest runs (slices) each of which `joinable(run)` holds
    for (a run of one always does)."""
    runs, at = [], 0
    while at < len(items):
        end = at + 1
        while end < len(items) and joinable(items[at:end + 1]):
            end += 1
        runs.append(items[at:end])
        at = end
    return runs


def laid_together(weights):
    """The one weight whose rows are `weights` one after another, when they lie so: float
    matrices [out_i, in] (one dtype and device) as rows of one storage, in order; or quantized
    ones of one format, group and width whose codes, scales and zero points each lie so (fp8:
    every one but the last a whole number of blocks of rows, so the blocks of scales line up).
    None otherwise."""
    if len(weights) < 2:
        return None
    if all(isinstance(w, Quantized) for w in weights):
        first = weights[0]
        if any((w.format, w.inputs, w.group, w.zero is None, w.matmul) != (first.format, first.inputs, first.group,
                                                                           first.zero is None, first.matmul)
               or w.qweight.dim() != 2 for w in weights):
            return None
        if first.format == "fp8" and any(w.qweight.shape[0] % w.group for w in weights[:-1]):
            return None
        parts = [rows_together([w.qweight for w in weights]), rows_together([w.scale for w in weights]),
                 None if first.zero is None else rows_together([w.zero for w in weights])]
        if parts[0] is None or parts[1] is None or (first.zero is not None and parts[2] is None):
            return None
        return Quantized(first.format, parts[0], parts[1], parts[2], first.inputs, first.group, first.matmul)
    if not all(type(w) is torch.Tensor and w.dim() == 2 and w.is_floating_point() for w in weights):
        return None
    return rows_together(weights)


def rows_together(tensors) -> torch.Tensor | None:
    """The one tensor whose rows (first dimension) are `tensors`' one after another, when they lie
    so in one storage (contiguous, one dtype and device, the same other dimensions); else None."""
    first = tensors[0]
    if any(type(t) is not torch.Tensor or t.dim() == 0 for t in tensors):
        return None
    at = first.storage_offset()
    for t in tensors:
        if (t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.storage_offset() != at
                or t.dtype != first.dtype or t.shape[1:] != first.shape[1:] or not t.is_contiguous()):
            return None
        at += t.numel()
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    return first.as_strided(shape, first.stride())


def rebuilt_linear(x: torch.Tensor, w: Quantized) -> torch.Tensor:
    """W rebuilt in x's dtype, then F.linear: the readable twin of every quantized kernel."""
    return F.linear(x, w.dequantize(x.dtype))


def dense(w, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A weight or row log as a float tensor: a quantized one (`Quantized`, `QuantizedRows`)
    rebuilt (in `dtype`, default its own), a float one as it is."""
    if isinstance(w, Quantized):
        return w.dequantize(dtype or torch.float32)
    return w.dequantize(dtype) if isinstance(w, QuantizedRows) else w


def quantize(w: torch.Tensor, format: str, group: int | None = None, zero_point: bool = False) -> Quantized:
    """W [..., out, in] (any float dtype) in `format`; `group`: int4's group or fp8's block side
    (default GROUP, BLOCK); `zero_point`: int4 with a zero point per group (else symmetric)."""
    w = w.detach().float()
    inputs = w.shape[-1]
    if format == "int8":
        scale = _scale(w.abs().amax(-1), 127.0)
        q = torch.round(w / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return Quantized("int8", q, scale, inputs=inputs)
    if format == "int4":
        group = group or GROUP
        grouped = _groups(w, group)                                    # [..., out, groups, group]
        if zero_point:
            low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
            scale = _scale(high - low, 15.0)
            zero = torch.round(-low / scale).clamp(0, 15)
        else:
            scale = _scale(grouped.abs().amax(-1), 7.0)
            zero = torch.full_like(scale, 8.0)
        z, s = _expand(zero, group, -1, inputs), _expand(scale, group, -1, inputs)
        q = torch.round(w / s + z).clamp(0, 15).to(torch.uint8)
        return Quantized("int4", pack_int4(q), scale, zero.to(torch.uint8) if zero_point else None, inputs, group)
    if format == "fp8":
        group = group or BLOCK
        out = w.shape[-2]
        padded = F.pad(w, (0, -inputs % group, 0, -out % group))
        blocks = padded.unflatten(-1, (-1, group)).unflatten(-3, (-1, group))   # [..., out/B, B, in/B, B]
        scale = _scale(blocks.abs().amax(dim=(-3, -1)), FP8_MAX)               # [..., out/B, in/B]
        full = _expand(_expand(scale, group, -1, inputs), group, -2, out)
        q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return Quantized("fp8", q, scale, inputs=inputs, group=group)
    raise ValueError(f"unknown format {format!r}; formats are: {', '.join(FORMATS)}")


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in t, for any dtype (fp8 e4m3 has no infinity and no isfinite: its NaN
    is every bit but the sign set)."""
    if t.dtype == FP8:
        return not bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    if not t.is_floating_point():
        return True
    # a finite sum has no NaN or infinity in it (one pass, nothing allocated); a sum that
    # overflowed from finite values is told apart by the elementwise check
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def check_scales(name: str, scale: torch.Tensor) -> str | None:
    """Why a weight's scales are unusable (None if they are fine): each must be finite and > 0."""
    if not bool(torch.isfinite(scale).all()):
        return f"{name}: its scales hold NaN or infinite values"
    if not bool((scale > 0).all()):
        return f"{name}: its scales must be positive (a zero scale loses the weight)"
    return None


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 15], [..., n] -> bytes [..., ceil(n/2)]: code 2j in the low nibble of byte j."""
    if q.shape[-1] % 2:
        q = F.pad(q, (0, 1))
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack_int4`: bytes [..., ceil(n/2)] -> codes [..., n] (uint8)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)[..., :n]


def _scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """amax / top, with 1 where amax is 0 (nothing to scale) and at least float32's smallest
    normal where amax / top would underflow to 0 (a scale is never 0); a NaN or infinite amax
    stays so, for the checks to see."""
    amax = amax.float()
    tiny = torch.finfo(torch.float32).tiny
    return torch.where(amax == 0, torch.ones_like(amax), (amax / top).clamp(min=tiny))


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    """[..., n] -> [..., ceil(n/group), group], the last group padded with zeros."""
    pad = -w.shape[-1] % group
    return F.pad(w, (0, pad)).unflatten(-1, (-1, group))


def _expand(per_group: torch.Tensor, group: int, dim: int, size: int) -> torch.Tensor:
    """Each entry along `dim` repeated `group` times, cut to `size`."""
    return per_group.repeat_interleave(group, dim=dim).narrow(dim, 0, size)


CACHE_DTYPES = {"int8": torch.int8, "fp8": FP8}      # a quantized cache's code dtypes
CACHE_FORMATS = tuple(CACHE_DTYPES)
_TOP = {"int8": 127.0, "fp8": FP8_MAX}                # the largest code


def check_cache_format(kv_cache) -> None:
    """InvalidInput unless `kv_cache` is None or one of CACHE_FORMATS."""
    if kv_cache is not None and kv_cache not in CACHE_FORMATS:
        raise InvalidInput(f"kv_cache must be one of {', '.join(CACHE_FORMATS)} or None, got {kv_cache!r}")


def quantize_rows(x: torch.Tensor, format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache rows x [..., d] -> (codes [..., d], float32 scales [...]): one scale per row (per
    head of a K/V row), its largest magnitude over the code range; 1 for a row of zeros. A
    non-finite row gets a non-finite scale, which the stage's finite checks see."""
    dtype, top = CACHE_DTYPES[format], _TOP[format]
    amax = x.detach().float().abs().amax(-1)
    scale = _scale(amax, top)
    scaled = x.float() / scale.unsqueeze(-1)
    codes = scaled.round().clamp(-top, top).to(dtype) if format == "int8" else scaled.clamp(-top, top).to(dtype)
    return codes, scale


@dataclass(frozen=True)
class QuantizedRows:
    """A row log's codes and per-row scales, read as rows of `dtype`: indexing by a tensor of
    row numbers gathers those rows' codes and rebuilds only them (attention over picked rows)."""
    codes: torch.Tensor          # [S, ..., d]
    scale: torch.Tensor          # [S, ...]
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        return (self.codes[rows].float() * self.scale[rows]).to(self.dtype)

    @classmethod
    def of(cls, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> "QuantizedRows":
        """From a log's codes and its scales log (one scale per row, or per head of a row)."""
        return cls(codes, scale if scale.dim() == codes.dim() else scale.unsqueeze(-1), dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.codes.float() * self.scale).to(dtype or self.dtype)
