"""The model's own tensor names and shapes (docs/checkpoint.md), from its spec, and what loading
allocates.

This table is the single source of truth: initialisation draws from it, a Hebrus checkpoint
stores exactly these names, and every family's names table (`hebrus.models`) builds them.
"""
from __future__ import annotations

import math

import torch

from hebrus.config import HebrusConfig
from hebrus.layers.spec import ModelSpec


def spec_of(c: ModelSpec | HebrusConfig) -> ModelSpec:
    """A spec, or a Hebrus config's spec: the functions here take either."""
    return c if isinstance(c, ModelSpec) else c.spec()


def parameter_shapes(c: ModelSpec | HebrusConfig) -> dict[str, tuple[int, ...]]:
    """The stored tensors and their shapes: a quantized model's quantized weights as their parts
    (`weights.quant`)."""
    c = spec_of(c)
    shapes = float_shapes(c)
    if c.quantization is None:
        return shapes
    from hebrus.weights.quant import part_shapes, quantizable
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        out.update(part_shapes(name, shape, c.quantization) if quantizable(name) else {name: shape})
    return out


def float_shapes(c: ModelSpec | HebrusConfig) -> dict[str, tuple[int, ...]]:
    """Every weight unquantized, as the layers use it."""
    c = spec_of(c)
    V, D, n = c.vocab_size, c.hidden_size, c.hc_streams
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (V, D)}
    if c.ple_dim:
        LP = c.ple_width
        shapes["ple.unigram.weight"] = (V, LP)
        for m, buckets in zip(range(2, c.ple_ngram + 1), c.ple_buckets):
            shapes[f"ple.ngram.{m}.weight"] = (buckets, LP)
        shapes["ple.hash_constants"] = (c.ple_ngram - 1, c.ple_ngram)
        shapes["ple.conv.weight"] = (LP, c.ple_conv_kernel)
    for layer in range(c.num_layers):
        shapes.update(_layer_shapes(c, layer))
    if c.residual == "hyper":
        shapes.update({"head_hc.fn": (n, n * D), "head_hc.base": (n,), "head_hc.scale": (1,)})
    shapes["norm.weight"] = (D,)
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def _layer_shapes(c: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    D, n, P, p = c.hidden_size, c.hc_streams, c.ple_dim, f"layers.{layer}."
    s: dict[str, tuple[int, ...]] = {}
    if c.residual == "hyper":
        for hc in ("mixer_hc", "ffn_hc"):
            s.update({f"{p}{hc}.fn": (c.hc_mix_dim, n * D), f"{p}{hc}.base": (c.hc_mix_dim,),
                      f"{p}{hc}.scale": (3,)})
    s[f"{p}mixer_norm.weight"] = (D,)
    s[f"{p}ffn_norm.weight"] = (D,)
    mixer, ffn = c.mixers[layer], c.ffns[layer]
    if mixer == "gdn":
        s.update(_gdn_shapes(c, p + "gdn."))
    elif mixer in ("qsa", "attention"):
        s.update(_attention_shapes(c, f"{p}{mixer}.", mixer))
    else:
        raise ValueError(f"unknown mixer {mixer!r}")
    if ffn == "moe":
        s.update(_moe_shapes(c, p + "moe."))
    elif ffn == "mlp":
        s.update(_mlp_shapes(D, c.mlp_intermediate, p + "mlp."))
    else:
        raise ValueError(f"unknown feed-forward kind {ffn!r}")
    if P:
        s.update({f"{p}ple.gate.weight": (P, D), f"{p}ple.down.weight": (D, P), f"{p}ple.norm.weight": (D,)})
    return s


def _mlp_shapes(D: int, inner: int, p: str) -> dict[str, tuple[int, ...]]:
    return {f"{p}gate_proj.weight": (inner, D), f"{p}up_proj.weight": (inner, D), f"{p}down_proj.weight": (D, inner)}


def _moe_shapes(c: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
    D, E, I, Is = c.hidden_size, c.moe_experts, c.moe_intermediate, c.moe_shared_intermediate
    s = {f"{p}router.weight": (E, D), f"{p}experts.gate_up": (E, 2 * I, D), f"{p}experts.down": (E, D, I)}
    if Is:
        s.update(_mlp_shapes(D, Is, p + "shared."))
        s[f"{p}shared_gate.weight"] = (1, D)
    return s


def _gdn_shapes(c: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
    D, Hv, dv = c.hidden_size, c.gdn_value_heads, c.gdn_value_dim
    return {
        f"{p}in_proj_qkv.weight": (c.gdn_conv_dim, D),
        f"{p}in_proj_z.weight": (Hv * dv, D),
        f"{p}in_proj_b.weight": (Hv, D),
        f"{p}in_proj_a.weight": (Hv, D),
        f"{p}conv.weight": (c.gdn_conv_dim, c.gdn_conv_kernel),
        f"{p}A_log": (Hv,),
        f"{p}dt_bias": (Hv,),
        f"{p}norm.weight": (dv,),
        f"{p}out_proj.weight": (D, Hv * dv),
    }


def _attention_shapes(c: ModelSpec, p: str, kind: str) -> dict[str, tuple[int, ...]]:
    D, Hq, Hkv, dh = c.hidden_size, c.attn_heads, c.attn_kv_heads, c.attn_head_dim
    s = {
        f"{p}q_proj.weight": (Hq * dh, D),
        f"{p}gate_proj.weight": (Hq * dh, D),
        f"{p}k_proj.weight": (Hkv * dh, D),
        f"{p}v_proj.weight": (Hkv * dh, D),
        f"{p}q_norm.weight": (dh,),
        f"{p}k_norm.weight": (dh,),
        f"{p}o_proj.weight": (D, Hq * dh),
    }
    if kind == "qsa":
        Hi, di = c.index_heads, c.index_dim
        s.update({
            f"{p}index_q.weight": (Hi * di, D),
            f"{p}index_k.weight": (di, D),
            f"{p}index_k_norm.weight": (di,),
            f"{p}index_k_norm.bias": (di,),
            f"{p}index_w.weight": (Hi, D),
        })
    return s


def storage_dtype(name: str, dtype: torch.dtype) -> torch.dtype | None:
    """Hash constants are int64; hyper-connection parameters, GDN decay parameters and norm
    weights stay in at least float32 (a norm weight is a scale near 1, which a 16-bit type
    rounds coarsely); a quantized weight's codes and zero points stay as stored (None) and its
    scales in float32; everything else is in the model dtype."""
    if name.endswith((".qweight", ".qzero")):
        return None
    if name.endswith(".qscale"):
        return torch.float32
    if name == "ple.hash_constants":
        return torch.int64
    if "_hc." in name or name.startswith("head_hc.") or name.endswith(("A_log", "dt_bias", "norm.weight")):
        return torch.float64 if dtype == torch.float64 else torch.float32
    return dtype


# safetensors dtype names a file may store: weights in a float type, the hash constants in an
# integer type that int64 holds exactly.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
INTEGER_DTYPES = ("I8", "I16", "I32", "I64", "U8", "U16", "U32")


QUANTIZED_DTYPES = {".qweight": ("I8", "U8", "F8_E4M3"), ".qscale": ("F32",), ".qzero": ("U8",)}


def stored_dtypes(name: str) -> tuple[str, ...]:
    for suffix, allowed in QUANTIZED_DTYPES.items():
        if name.endswith(suffix):
            return allowed
    return INTEGER_DTYPES if name == "ple.hash_constants" else FLOAT_DTYPES


def parameter_count(c: ModelSpec | HebrusConfig) -> int:
    return sum(math.prod(s) for name, s in float_shapes(c).items() if name != "ple.hash_constants")


def rotary_widths(c: ModelSpec) -> set[int]:
    """The widths the model builds rotary tables for (one [max_context, width] cos/sin pair each)."""
    widths = {c.rotary_dim} if c.has_attention else set()
    return widths | ({c.index_dim} if "qsa" in c.mixers else set())


def load_bytes(c: ModelSpec | HebrusConfig, dtype: torch.dtype = torch.float32, skip=None) -> int:
    """An upper bound on what loading `c` in `dtype` allocates, from the config alone: every
    parameter in its storage dtype (the loader reads into these final buffers), plus the
    largest tensor twice at 8 bytes (its file tensors and the tensor built from them, while a
    transformed tensor is made), plus per rotary width the float64 build of its tables (angles,
    cos, sin and the cast copy: 4 × 8 bytes per [max_context, width] entry)."""
    c = spec_of(c)
    shapes = {n: s for n, s in parameter_shapes(c).items() if skip is None or not skip(n)}     # skip: left in files
    params = sum(math.prod(shape) * _itemsize(c, name, dtype) for name, shape in shapes.items())
    largest = max(math.prod(shape) for shape in shapes.values())
    return params + 16 * largest + 32 * c.max_context * sum(rotary_widths(c))


def _itemsize(c: ModelSpec, name: str, dtype: torch.dtype) -> int:
    kept = storage_dtype(name, dtype)
    if kept is None:
        from hebrus.weights.quant import part_dtype
        kept = part_dtype(name, c.quantization)
    return kept.itemsize
