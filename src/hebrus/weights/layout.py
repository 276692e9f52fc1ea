"""The tensor names, shapes and stored dtypes of a Hebrus checkpoint (docs/checkpoint.md), from a
config, and what loading that config allocates.

This table is the single source of truth: initialisation draws from it and the loader checks
files against it.
"""
from __future__ import annotations

import math

import torch

from hebrus.config import HebrusConfig


def parameter_shapes(c: HebrusConfig) -> dict[str, tuple[int, ...]]:
    V, D, n, LP = c.vocab_size, c.hidden_size, c.hc_streams, c.ple_width
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (V, D), "ple.unigram.weight": (V, LP)}
    for m, buckets in zip(range(2, c.ple_ngram + 1), c.ple_buckets):
        shapes[f"ple.ngram.{m}.weight"] = (buckets, LP)
    shapes["ple.hash_constants"] = (c.ple_ngram - 1, c.ple_ngram)
    shapes["ple.conv.weight"] = (LP, c.ple_conv_kernel)
    for layer, kind in enumerate(c.layer_types):
        shapes.update(_layer_shapes(c, f"layers.{layer}.", kind))
    shapes.update({"head_hc.fn": (n, n * D), "head_hc.base": (n,), "head_hc.scale": (1,),
                   "norm.weight": (D,)})
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def _layer_shapes(c: HebrusConfig, p: str, kind: str) -> dict[str, tuple[int, ...]]:
    D, n, P = c.hidden_size, c.hc_streams, c.ple_dim
    E, I, Is = c.moe_experts, c.moe_intermediate, c.moe_shared_intermediate
    s: dict[str, tuple[int, ...]] = {}
    for hc in ("mixer_hc", "ffn_hc"):
        s.update({f"{p}{hc}.fn": (c.hc_mix_dim, n * D), f"{p}{hc}.base": (c.hc_mix_dim,),
                  f"{p}{hc}.scale": (3,)})
    s[f"{p}mixer_norm.weight"] = (D,)
    s[f"{p}ffn_norm.weight"] = (D,)
    s.update(_gdn_shapes(c, p + "gdn.") if kind == "gdn" else _qsa_shapes(c, p + "qsa."))
    s.update({
        f"{p}moe.router.weight": (E, D),
        f"{p}moe.experts.gate_up": (E, 2 * I, D),
        f"{p}moe.experts.down": (E, D, I),
        f"{p}moe.shared.gate_proj.weight": (Is, D),
        f"{p}moe.shared.up_proj.weight": (Is, D),
        f"{p}moe.shared.down_proj.weight": (D, Is),
        f"{p}moe.shared_gate.weight": (1, D),
        f"{p}ple.gate.weight": (P, D),
        f"{p}ple.down.weight": (D, P),
        f"{p}ple.norm.weight": (D,),
    })
    return s


def _gdn_shapes(c: HebrusConfig, p: str) -> dict[str, tuple[int, ...]]:
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


def _qsa_shapes(c: HebrusConfig, p: str) -> dict[str, tuple[int, ...]]:
    D, Hq, Hkv, dh = c.hidden_size, c.qsa_heads, c.qsa_kv_heads, c.qsa_head_dim
    Hi, di = c.qsa_index_heads, c.qsa_index_dim
    return {
        f"{p}q_proj.weight": (Hq * dh, D),
        f"{p}gate_proj.weight": (Hq * dh, D),
        f"{p}k_proj.weight": (Hkv * dh, D),
        f"{p}v_proj.weight": (Hkv * dh, D),
        f"{p}q_norm.weight": (dh,),
        f"{p}k_norm.weight": (dh,),
        f"{p}o_proj.weight": (D, Hq * dh),
        f"{p}index_q.weight": (Hi * di, D),
        f"{p}index_k.weight": (di, D),
        f"{p}index_k_norm.weight": (di,),
        f"{p}index_k_norm.bias": (di,),
        f"{p}index_w.weight": (Hi, D),
    }


def storage_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """Hash constants are int64; hyper-connection and GDN decay parameters stay in at least
    float32; everything else is in the model dtype."""
    if name == "ple.hash_constants":
        return torch.int64
    if "_hc." in name or name.startswith("head_hc.") or name.endswith(("A_log", "dt_bias")):
        return torch.float64 if dtype == torch.float64 else torch.float32
    return dtype


# safetensors dtype names a file may store: weights in a float type, the hash constants in an
# integer type that int64 holds exactly.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
INTEGER_DTYPES = ("I8", "I16", "I32", "I64", "U8", "U16", "U32")


def stored_dtypes(name: str) -> tuple[str, ...]:
    return INTEGER_DTYPES if name == "ple.hash_constants" else FLOAT_DTYPES


def parameter_count(c: HebrusConfig) -> int:
    return sum(math.prod(s) for name, s in parameter_shapes(c).items() if name != "ple.hash_constants")


def rotary_widths(c: HebrusConfig) -> set[int]:
    """The widths the model builds rotary tables for (one [max_context, width] cos/sin pair each)."""
    return {c.qsa_head_dim, c.qsa_index_dim} if "qsa" in c.layer_types else set()


def load_bytes(c: HebrusConfig) -> int:
    """An upper bound on what loading `c` allocates, from the config alone: every parameter
    twice at 8 bytes (the tensor read from the file and its copy in the model's dtype are alive
    together), and per rotary width the float64 build of its tables (angles, cos, sin and the
    cast copy: 4 × 8 bytes per [max_context, width] entry)."""
    params = sum(math.prod(shape) for shape in parameter_shapes(c).values())
    return 16 * params + 32 * c.max_context * sum(rotary_widths(c))
