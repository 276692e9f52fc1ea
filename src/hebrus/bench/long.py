"""`hebrus bench --long`: sparse attention at long context against dense attention.

Two random-weight models of a shape (SHAPES: the `small` preset's, or `wide`, the same with K/V
rows four times as wide) with a context limit of LONG_CONTEXT:
the Hebrus model (its attention layers are QSA: each query attends to the top_k rows its indexer
picks), and the same model with those layers replaced by gated attention over every row (the
`attention` mixer, fused SDPA / flash kernels on a GPU). Both are measured by `bench.run` at each
context; the comparison reports each one's decode step time against its own at the shortest
context, and dense over sparse at each context beside the ratio of their byte floors (what each
step must read at least, `bench.limits.decode_bytes`): sparse attention pays for itself as far as
dense ÷ QSA comes near that ratio (the target: at least FLOOR_SHARE of it). `layer_point` times
one attention layer's work for one query over a full context (indexer scores, selection and
attention over the pick, or attention over every row) against the bytes that work must read.
"""
from __future__ import annotations

import time

import torch

from hebrus.bench.limits import sync
from hebrus.layers.attention import AttentionMixer
from hebrus.layers.layout import init_parameters
from hebrus.models.hebrus import preset
from hebrus.models.layout import storage_dtype
from hebrus.runtime import Model, _place

LONG_CONTEXT = 131072 + 4096       # a 128K prompt leaves room for the decode steps
CONTEXTS = (1024, 8192, 32768, 131072)
# shape -> what it changes in the small preset: `wide` has as many K/V heads as query heads (8 of
# 64: a K/V row of 2,048 bytes a layer in 16 bits, against small's 512), so dense attention reads
# far more than the indexer's keys: at 128K the byte floors are 29.2 and 213 µs at 4.1 TB/s (7.3x),
# where small's are 28.5 and 65.1 (2.28x)
SHAPES = {"small": {}, "wide": {"qsa_kv_heads": 8}}
FLOOR_SHARE = 0.8      # the target: dense ÷ QSA at least this share of the ratio of their floors


def long_models(device: torch.device, dtype: torch.dtype, mode: str = "fast",
                shape: str = "small") -> dict[str, Model]:
    """{"qsa": the shape at LONG_CONTEXT, "dense": the same with full attention}."""
    config = preset("small").replace(max_context=LONG_CONTEXT, **SHAPES[shape])
    sparse = Model(config, config.init_parameters(), device=device, dtype=dtype, mode=mode)
    spec = config.spec()
    spec = spec.replace(mixers=tuple("attention" if kind == "qsa" else kind for kind in spec.mixers))
    params = {name: _place(name, t, device, storage_dtype(name, dtype))
              for name, t in init_parameters(spec, config.init_seed).items()}
    dense = Model._placed(config, spec, params, device, dtype, mode)
    return {"qsa": sparse, "dense": dense}


def comparison(reports: dict[str, dict]) -> list[dict]:
    """Per context (batch 1): decode ms per step of each model, each against its own at the
    shortest context, and dense over qsa beside the ratio of the bytes their steps must read (each
    report's floor times the copy bandwidth it measured, so two measurements' noise stays out of
    the ratio) and dense ÷ QSA as a share of it (the target: FLOOR_SHARE); prefill tokens/s of
    each."""
    bandwidth = {name: r["copy_bandwidth_bytes_per_s"] for name, r in reports.items()}
    by = {name: {p["context"]: p for p in r["points"] if p["batch"] == 1} for name, r in reports.items()}
    contexts = sorted(set(by["qsa"]) & set(by["dense"]))
    rows = []
    for c in contexts:
        q, d = by["qsa"][c], by["dense"][c]
        dense_over_qsa = d["decode_ms_per_step"] / q["decode_ms_per_step"]
        floors_ratio = ((d["decode_floor_ms_per_step"] * bandwidth["dense"])
                        / (q["decode_floor_ms_per_step"] * bandwidth["qsa"]))
        rows.append({
            "context": c,
            "qsa_decode_ms": q["decode_ms_per_step"], "dense_decode_ms": d["decode_ms_per_step"],
            "qsa_over_shortest": q["decode_ms_per_step"] / by["qsa"][contexts[0]]["decode_ms_per_step"],
            "dense_over_qsa": dense_over_qsa,
            "qsa_floor_ms": q["decode_floor_ms_per_step"], "dense_floor_ms": d["decode_floor_ms_per_step"],
            "floors_ratio": floors_ratio, "share_of_floors_ratio": dense_over_qsa / floors_ratio,
            "qsa_prefill_tokens_per_s": q.get("prefill_tokens_per_s"),
            "dense_prefill_tokens_per_s": d.get("prefill_tokens_per_s"),
        })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| context | QSA decode ms | vs shortest | dense decode ms | dense ÷ QSA | floors µs (QSA, dense) "
             f"| floors' ratio | ≥ {FLOOR_SHARE} of it | QSA prefill tok/s | dense prefill tok/s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: | ---: | ---: |"]
    for r in rows:
        prefill = [f"{v:,.0f}" if v is not None else "–"
                   for v in (r["qsa_prefill_tokens_per_s"], r["dense_prefill_tokens_per_s"])]
        met = "yes" if r["share_of_floors_ratio"] >= FLOOR_SHARE else "no"
        lines.append(f"| {r['context']} | {r['qsa_decode_ms']:.2f} | {r['qsa_over_shortest']:.2f}x | "
                     f"{r['dense_decode_ms']:.2f} | {r['dense_over_qsa']:.2f}x | {r['qsa_floor_ms'] * 1e3:.1f}, "
                     f"{r['dense_floor_ms'] * 1e3:.1f} | {r['floors_ratio']:.2f}x | {met} | {prefill[0]} | "
                     f"{prefill[1]} |")
    return "\n".join(lines) + "\n"


def layer_table(points: list[dict]) -> str:
    lines = ["| model | layer | context | µs per query | bytes needed | floor µs | over floor |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for p in points:
        lines.append(f"| {p['model']} | {p['layer']} | {p['context']} | {p['seconds'] * 1e6:.1f} | "
                     f"{p['bytes_needed']:,} | {p['floor_seconds'] * 1e6:.2f} | {p['over_floor']:.1f}x |")
    return "\n".join(lines) + "\n"


def layer_point(model: Model, context: int, bandwidth: float, reps: int = 50) -> dict:
    """One decode query at position context-1 through the first attention layer of `model`, over
    `context` random rows: seconds per call (on CUDA, a captured graph replayed `reps` times, as
    a decode step runs it) and the bytes it must read at least: every index key and the picked
    K/V rows (QSA), or every K and V row (dense). `bandwidth` counts a copy's bytes read plus
    written, the memory's total rate, so a kernel that reads N bytes needs N / bandwidth."""
    stage = next(s for s in model.stages if isinstance(s, AttentionMixer))
    attn, device, dtype = stage.attn, model.device, model.dtype
    g = torch.Generator(device="cpu").manual_seed(context)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    k_rows, v_rows, q = rand(context, attn.hkv, attn.dh), rand(context, attn.hkv, attn.dh), rand(1, attn.hq, attn.dh)
    positions = torch.tensor([context - 1], device=device)
    item = torch.empty((), dtype=dtype).element_size()
    if attn.indexed:
        index_rows, qi, iw = rand(context, attn.di), rand(1, attn.hi, attn.di), rand(1, attn.hi)
        picked = min(attn.top_k, context)
        needed = context * attn.di * item + picked * 2 * attn.hkv * attn.dh * item

        def call():
            return attn._pick_and_attend(qi, iw, q, (index_rows, k_rows, v_rows), context - 1, positions)
    else:
        needed = context * 2 * attn.hkv * attn.dh * item

        def call():
            return attn.attend(q, k_rows, v_rows, positions)
    seconds = _time_calls(call, device, reps)
    floor = needed / bandwidth
    return {"context": context, "layer": stage.name, "seconds": seconds, "bytes_needed": needed,
            "floor_seconds": floor, "over_floor": seconds / floor}


def _time_calls(call, device: torch.device, reps: int) -> float:
    """Mean seconds per call over `reps` calls after a warm-up; on CUDA one graph
    of the call is captured and replayed (no launch gaps, as in a captured decode step)."""
    call()
    sync(device)
    if device.type == "cuda":
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            call()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        call = graph.replay
        call()
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        call()
    sync(device)
    return (time.perf_counter() - t) / reps
