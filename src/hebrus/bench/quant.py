"""`hebrus bench --quant`: what quantized weights cost in quality and give in speed.

Quality: the trained `shakespeare` model's validation loss (nats per byte over the validation
text in consecutive windows, each from the empty state, as its recipe measures it) in each
format against the float model. Speed: `bench.run` on a model quantized in each format beside
the float one (decode tokens/s against each one's own floor: the quantized bytes a step reads),
and the KL divergence of each format's next-token distribution from the float model's at the
end of a fixed set of prompts.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from hebrus import bench, training
from hebrus.errors import InvalidInput
from hebrus.progress import ProgressBar
from hebrus.weights.quant import QUANT_FORMATS

QUALITY_TARGETS = {"int8": 0.005, "fp8": 0.005, "int4": 0.03, "int4-zp": 0.03}     # loss increase allowed
# × the float decode tok/s: one session's, and at any larger batch each format at least the float's
SPEED_TARGETS = {"int8": 1.4, "int4": 2.0, "int4-zp": 2.0, "fp8": 1.5}
BATCH_TARGET = 1.0
VAL = Path("recipes/shakespeare/data/val.bin")


def validation_loss(model, val: torch.Tensor, context: int, progress=None) -> float:
    """Mean nats per predicted byte over `val` (uint8) in consecutive windows of `context` + 1."""
    params = dict(model.named_parameters())
    total, count = 0.0, 0
    starts = range(0, len(val) - 1, context)
    with torch.no_grad():
        for i, start in enumerate(starts):
            ids = val[start:start + context + 1].long().to(model.device)
            if len(ids) < 2:
                break
            n = len(ids) - 1
            total += float(training.losses(model.spec, params, ids).lm) * n
            count += n
            if progress is not None:
                progress(i + 1, len(starts))
    return total / count


def quality(model, formats: list[str], val: torch.Tensor, context: int, progress=None) -> list[dict]:
    """The float model's validation loss, then each format's and its relative increase."""
    base = validation_loss(model, val, context, progress)
    rows = [{"format": "float", "val_nats_per_byte": base, "increase": 0.0}]
    for f in formats:
        loss = validation_loss(model.quantized(f), val, context, progress)
        rows.append({"format": f, "val_nats_per_byte": loss, "increase": loss / base - 1,
                     "target": QUALITY_TARGETS.get(f)})
    return rows


def divergence(reference, model, prompts: list[list[int]]) -> float:
    """Mean KL(reference ‖ model) of the next-token distributions after each prompt, nats."""
    total = 0.0
    for ids in prompts:
        p = torch.log_softmax(reference.session().feed(ids).float(), -1)
        q = torch.log_softmax(model.session().feed(ids).float(), -1)
        total += float((p.exp() * (p - q)).sum())
    return total / len(prompts)


def prompts(vocab: int, count: int = 8, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (64 * (i + 1),), generator=g).tolist() for i in range(count)]


def speed_table(rows: list[dict]) -> str:
    lines = ["| format | weight bytes | context | batch | decode ms/step | tok/s | × float | target | floor ms "
             "| of floor | KL vs float | graphs captured |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        kl = "–" if r.get("kl") is None else f"{r['kl']:.2e}"
        target = "" if r.get("target") is None else f"≥ {r['target']:.1f}×"
        lines.append(f"| {r['format']} | {r['weight_bytes']:,} | {r['context']} | {r['batch']} | "
                     f"{r['decode_ms_per_step']:.2f} | {r['decode_tokens_per_s']:,.0f} | {r['speedup']:.2f}× | "
                     f"{target} | {r['decode_floor_ms_per_step']:.3f} | {r['decode_fraction_of_floor']:.1%} | {kl} | "
                     f"{r['graph_captures']} |")
    return "\n".join(lines) + "\n"


def quality_table(rows: list[dict], context: int, count: int) -> str:
    lines = [f"Validation: {count:,} bytes in windows of {context}.", "",
             "| format | nats/byte | increase | target |", "| --- | ---: | ---: | ---: |"]
    for r in rows:
        target = "" if r.get("target") is None else f"≤ {r['target']:.1%}"
        lines.append(f"| {r['format']} | {r['val_nats_per_byte']:.4f} | {r['increase']:+.2%} | {target} |")
    return "\n".join(lines) + "\n"


def speed_rows(format: str, report: dict, float_points: dict, weight_bytes: int, kl: float | None) -> list[dict]:
    rows = []
    for p in report["points"]:
        base = float_points.get((p["context"], p["batch"]))
        rows.append({"format": format, "weight_bytes": weight_bytes, "context": p["context"], "batch": p["batch"],
                     "decode_ms_per_step": p["decode_ms_per_step"], "decode_tokens_per_s": p["decode_tokens_per_s"],
                     "speedup": (p["decode_tokens_per_s"] / base) if base else 1.0,
                     "decode_floor_ms_per_step": p["decode_floor_ms_per_step"],
                     "decode_fraction_of_floor": p["decode_fraction_of_floor"], "kl": kl,
                     "graph_captures": p["graph_captures"], "ops_per_step": p["ops_per_step"],
                     "target": None if format == "float" else
                     SPEED_TARGETS.get(format) if p["batch"] == 1 else BATCH_TARGET})
    return rows


def command(args, contexts: list[int], batches: tuple[int, ...], load) -> int:
    """`hebrus bench --quant`: quality on the trained model (skipped without its validation
    file, with a note), speed and divergence on `--model`. `load(name, quantize)` loads a model
    as the other bench commands do. Writes --json and --table after every part."""
    if args.val_context < 1 or args.val_bytes < 0:
        raise InvalidInput("--val-context must be at least 1 and --val-bytes at least 0")
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in QUANT_FORMATS]
    if unknown or not formats:
        raise InvalidInput(f"--formats takes a comma-separated list of {', '.join(QUANT_FORMATS)}, got {args.formats!r}")
    report: dict = {"formats": formats}

    def write() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        if args.table:
            Path(args.table).write_text("".join(report.get(k, "") for k in ("quality_table", "speed_table")))

    val_path = Path(args.val)
    if val_path.is_file():
        val = torch.frombuffer(bytearray(val_path.read_bytes()), dtype=torch.uint8)
        if args.val_bytes:
            val = val[:args.val_bytes]
        trained = load("shakespeare", None)
        rows = quality(trained, formats, val, args.val_context, ProgressBar("validation", unit="window"))
        report.update(quality=rows, quality_table=quality_table(rows, args.val_context, len(val)) + "\n")
        print(report["quality_table"])
        write()
    else:
        print(f"(quality skipped: {val_path} is not there; python recipes/shakespeare/prepare.py writes it)",
              file=sys.stderr)
    base = load(args.model, None)
    room = base.spec.max_context - args.decode_steps
    kept = [c for c in contexts if c <= room]
    if not kept:
        raise InvalidInput(f"no context leaves room for {args.decode_steps} decode steps within {base.spec.max_context}")
    probe = prompts(base.spec.vocab_size, count=4)
    rows, float_points = [], {}
    for f in [None, *formats]:
        model = base if f is None else base.quantized(f)
        got = bench.run(model, f or "float", kept, args.decode_steps, args.rounds, args.chunk, decode=args.decode,
                        batches=batches)
        if f is None:
            float_points = {(p["context"], p["batch"]): p["decode_tokens_per_s"] for p in got["points"]}
            report["float_report"] = got
        kl = None if f is None else divergence(base, model, probe)
        weight_bytes = sum(p.numel() * p.element_size() for _, p in model.named_parameters())
        rows += speed_rows(f or "float", got, float_points, weight_bytes, kl)
        report.update(speed=rows, speed_table=speed_table(rows), device=got["device"], commit=got["commit"],
                      date=got["date"], model=args.model)
        write()
        del model
    print(report["speed_table"], end="")
    return 0
