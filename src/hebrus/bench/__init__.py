"""`hebrus bench`: prefill and decode speed, measured side by side in one run.

At each context length it prefills that many tokens and then decodes, twice over: with normal
(transactional) sessions, and with an in-place variant that runs the same stages against one
bank written in place (no second bank, no seal, no validation, no status word; it exists only
here, to price the guarantee). The two take turns, so drift in machine speed hits both alike.
Beside them, the same run measures what the device can do at all: its copy bandwidth (the floor
for a decode step is the bytes it must read: `decode_bytes`) and its matrix throughput in the
model's dtype (the roofline for prefill: `prefill_flops_per_token`).
"""
from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from hebrus.bench.inplace import InPlaceBatch, InPlaceSession, _InPlaceContext, _InPlaceLanes
from hebrus.bench.limits import copy_bandwidth, decode_bytes, matmul_flops, prefill_flops_per_token
from hebrus.bench.shapes import SHAPES, random_checkpoint
from hebrus.state.owners import BANKED, bank_bytes
from hebrus.bench.timing import WARM_STEPS, _point, transformers_point

__all__ = ["SHAPES", "WARM_STEPS", "InPlaceBatch", "InPlaceSession", "_InPlaceContext", "_InPlaceLanes",
           "copy_bandwidth", "decode_bytes", "matmul_flops", "prefill_flops_per_token", "random_checkpoint",
           "run", "table"]


def run(model, label: str, contexts: list[int], steps: int, rounds: int, chunk: int | None,
        progress=None, decode: str = "auto", compare: Path | None = None, on_point=None,
        batches: tuple[int, ...] = (1,)) -> dict:
    """The measurement, as a JSON-ready dict: a point per context and batch size, prompts fed
    in chunks of `chunk` (None: the model's `prefill_chunk`). `compare`: a checkpoint folder of
    the same weights to time transformers on as well (batch 1). `on_point(report)` sees the
    report after each point."""
    device = model.device
    chunk = model.prefill_chunk if chunk is None else chunk
    bandwidth = copy_bandwidth(device, 2**30 if device.type == "cuda" else 2**27)
    flops = matmul_flops(device, model.dtype, 8192 if device.type == "cuda" else 1024)
    params = sum(p.numel() for _, p in model.named_parameters())
    gen = torch.Generator().manual_seed(0)
    prompts = {c: torch.randint(0, model.spec.vocab_size, (c,), generator=gen).tolist() for c in contexts}
    points = []

    def report() -> dict:
        return _report(model, label, bandwidth, flops, params, steps, rounds, chunk, decode, points)

    todo = [(c, b) for c in contexts for b in batches]
    for i, (context, batch) in enumerate(todo):
        point = _point(model, prompts[context], steps, rounds, chunk, decode, batch)
        floor = decode_bytes(model, context, batch) / bandwidth
        tx_decode, ip_decode = point.decode_s_per_step["transactional"], point.decode_s_per_step["in-place"]
        entry = {
            "context": context, "batch": batch,
            "decode_ms_per_step": tx_decode * 1e3, "decode_in_place_ms_per_step": ip_decode * 1e3,
            "decode_tokens_per_s": batch / tx_decode,
            "decode_ratio_transactional_over_in_place": tx_decode / ip_decode,
            "decode_floor_ms_per_step": floor * 1e3, "decode_fraction_of_floor": floor / tx_decode,
            "graph_captures": point.captures, "ops_per_step": point.ops,
        }
        if point.join_leave_captures is not None:
            entry["join_leave_captures"] = point.join_leave_captures
        if point.prefill_s_per_token is not None:
            roofline = flops / prefill_flops_per_token(model, context, chunk)             # tokens per second
            tx_prefill, ip_prefill = point.prefill_s_per_token["transactional"], point.prefill_s_per_token["in-place"]
            entry.update({
                "prefill_tokens_per_s": 1 / tx_prefill, "prefill_in_place_tokens_per_s": 1 / ip_prefill,
                "prefill_ratio_transactional_over_in_place": tx_prefill / ip_prefill,
                "prefill_roofline_tokens_per_s": roofline, "prefill_fraction_of_roofline": (1 / tx_prefill) / roofline,
            })
        points.append(entry)
        if on_point is not None:
            on_point(report())
        if progress is not None:
            progress(i + 1, len(todo), f"context {context}, batch {batch}")
    if compare is not None:          # after every hebrus point: its second copy of the weights affects nothing
        for point in points:
            if point["batch"] != 1:
                continue
            hf = transformers_point(compare, prompts[point["context"]], steps, rounds, device, model.dtype)
            point["transformers"] = hf
            if "error" not in hf:
                point["prefill_speedup_over_transformers"] = hf["prefill_s_per_token"] * point["prefill_tokens_per_s"]
                point["decode_speedup_over_transformers"] = hf["decode_s_per_step"] * 1e3 / point["decode_ms_per_step"]
            if on_point is not None:
                on_point(report())
    return report()


def _report(model, label, bandwidth, flops, params, steps, rounds, chunk, decode, points) -> dict:
    device = model.device
    return {
        "model": label, "family": model.spec.family, "parameters": params, "device": _device_name(device),
        "dtype": str(model.dtype).removeprefix("torch."), "mode": model.mode, "torch": torch.__version__,
        "decode": model.session(decode=decode).decode,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": _commit(),
        "copy_bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": flops, "decode_steps": steps,
        "rounds": rounds, "prefill_chunk": chunk, "warm_decode_steps": WARM_STEPS,
        "ops_counted": ("kernels the profiler sees in one step" if device.type == "cuda"
                        else "operations one step dispatches, views aside"),
        # a session's state: what each token of context adds (appended owners), and what it holds
        # whatever its length (both banks of the banked owners)
        "state_bytes_per_token": sum(o.nbytes for o in model.owners if o.kind != BANKED),
        "state_bytes_per_session": bank_bytes(model.owners),
        "points": list(points),
    }


def _state(report: dict) -> str:
    """A session's state bytes, where the report has them (those before it do not)."""
    if "state_bytes_per_token" not in report:
        return ""
    return (f"; a session's state: {report['state_bytes_per_token']:,} bytes a token of context and "
            f"{report['state_bytes_per_session']:,} bytes whatever its length")


def table(report: dict) -> str:
    """The report as a Markdown table."""
    lines = [
        f"# hebrus bench: {report['model']} ({report['family']}, {_count(report['parameters'])} parameters), "
        f"{report['device']}, {report['dtype']}, {report['mode']} mode, {report.get('decode', 'eager')} decode",
        "",
        f"{report['date']}, commit {report['commit']}, torch {report['torch']}; copy bandwidth "
        f"{report['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (read + write), matrix "
        f"{report['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s; medians of {report['rounds']} rounds, "
        f"{report['decode_steps']} decode steps, prefill in chunks of {report['prefill_chunk']}"
        f"{'; ops/step: ' + report['ops_counted'] if 'ops_counted' in report else ''}"
        f"{_state(report)}.",
        "",
    ]
    compared = any("transformers" in p for p in report["points"])
    head = ("| context | batch | prefill tok/s | tx / in-place | of roofline | decode ms/step | decode tok/s "
            "| tx / in-place | floor ms | of floor | ops/step | captures | on join/leave |")
    if compared:
        head += " transformers prefill tok/s | decode ms/step | speed-up prefill | decode |"
    lines += [head, "|" + " ---: |" * (head.count("|") - 1)]
    for p in report["points"]:
        prefill = (f"{p['prefill_tokens_per_s']:,.0f} | {p['prefill_ratio_transactional_over_in_place']:.3f} | "
                   f"{p['prefill_fraction_of_roofline']:.1%}" if "prefill_tokens_per_s" in p else "– | – | –")
        line = (f"| {p['context']} | {p['batch']} | {prefill} | {p['decode_ms_per_step']:.2f} | "
                f"{p.get('decode_tokens_per_s', p['batch'] * 1e3 / p['decode_ms_per_step']):,.0f} | "
                f"{p['decode_ratio_transactional_over_in_place']:.3f} | "
                f"{p['decode_floor_ms_per_step']:.3f} | {p['decode_fraction_of_floor']:.1%} | "
                f"{p.get('ops_per_step') or '–'} | {p.get('graph_captures', '–')} | {p.get('join_leave_captures', '–')} |")
        hf = p.get("transformers")
        if hf is not None and "error" not in hf:
            line += (f" {1 / hf['prefill_s_per_token']:,.0f} | {hf['decode_s_per_step'] * 1e3:.2f} | "
                     f"{p['prefill_speedup_over_transformers']:.2f}x | {p['decode_speedup_over_transformers']:.2f}x |")
        elif compared:
            line += " – | – | – | – |"
        lines.append(line)
    errors = {p["transformers"]["error"] for p in report["points"] if "error" in p.get("transformers", {})}
    lines += [f"\ntransformers could not run: {e}" for e in sorted(errors)]
    return "\n".join(lines) + "\n"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def _commit() -> str:
    """The commit measured: $HEBRUS_COMMIT if set (a copied working tree's .git may be stale),
    else git's HEAD."""
    if os.environ.get("HEBRUS_COMMIT"):
        return os.environ["HEBRUS_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=5)
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
