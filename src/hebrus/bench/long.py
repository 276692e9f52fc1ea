"""`hebrus bench --long`: sparse attention at long context against dense attention.

Two random-weight models of the `small` preset's shape with a context limit of LONG_CONTEXT:
the Hebrus model (its attention layers are QSA: each query attends to the top_k rows its indexer
picks), and the same model with those layers replaced by gated attention over every row (the
`attention` mixer, fused SDPA / flash kernels on a GPU). Both are measured by `bench.run` at each
context; the comparison reports each one's decode step time against its own at the shortest
context, and dense over sparse at each context.
"""
from __future__ import annotations

import torch

from hebrus.config import preset
from hebrus.runtime import Model, _place
from hebrus.weights.init import init_parameters
from hebrus.weights.layout import storage_dtype

LONG_CONTEXT = 131072 + 4096       # a 128K prompt leaves room for the decode steps
CONTEXTS = (1024, 8192, 32768, 131072)


def long_models(device: torch.device, dtype: torch.dtype, mode: str = "fast") -> dict[str, Model]:
    """{"qsa": the small shape at LONG_CONTEXT, "dense": the same with full attention}."""
    config = preset("small").replace(max_context=LONG_CONTEXT)
    sparse = Model(config, init_parameters(config), device=device, dtype=dtype, mode=mode)
    spec = config.spec()
    spec = spec.replace(mixers=tuple("attention" if kind == "qsa" else kind for kind in spec.mixers))
    params = {name: _place(name, t, device, storage_dtype(name, dtype))
              for name, t in init_parameters(spec, seed=config.init_seed).items()}
    dense = Model._placed(config, spec, params, device, dtype, mode)
    return {"qsa": sparse, "dense": dense}


def comparison(reports: dict[str, dict]) -> list[dict]:
    """Per context (batch 1): decode ms per step of each model, each against its own at the
    shortest context, and dense over qsa; prefill tokens/s of each."""
    by = {name: {p["context"]: p for p in r["points"] if p["batch"] == 1} for name, r in reports.items()}
    contexts = sorted(set(by["qsa"]) & set(by["dense"]))
    rows = []
    for c in contexts:
        q, d = by["qsa"][c], by["dense"][c]
        rows.append({
            "context": c,
            "qsa_decode_ms": q["decode_ms_per_step"], "dense_decode_ms": d["decode_ms_per_step"],
            "qsa_over_shortest": q["decode_ms_per_step"] / by["qsa"][contexts[0]]["decode_ms_per_step"],
            "dense_over_qsa": d["decode_ms_per_step"] / q["decode_ms_per_step"],
            "qsa_prefill_tokens_per_s": q.get("prefill_tokens_per_s"),
            "dense_prefill_tokens_per_s": d.get("prefill_tokens_per_s"),
        })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| context | QSA decode ms | vs shortest | dense decode ms | dense ÷ QSA | QSA prefill tok/s "
             "| dense prefill tok/s |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        prefill = [f"{v:,.0f}" if v is not None else "–"
                   for v in (r["qsa_prefill_tokens_per_s"], r["dense_prefill_tokens_per_s"])]
        lines.append(f"| {r['context']} | {r['qsa_decode_ms']:.2f} | {r['qsa_over_shortest']:.2f}x | "
                     f"{r['dense_decode_ms']:.2f} | {r['dense_over_qsa']:.2f}x | {prefill[0]} | {prefill[1]} |")
    return "\n".join(lines) + "\n"
