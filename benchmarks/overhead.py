"""What does the transaction cost? Transactional sessions against an in-place variant.

The in-place variant (`hebrus.bench.InPlaceSession`) runs the same stages against a context that
reads and writes one bank in place: no second bank, no seal, no validation, no injection point, no
status word. It exists only to measure the guarantee; no session can become one.

    python benchmarks/overhead.py [--preset small] [--mode fast] [--rounds 5] [--threads N] [--out DIR [--force]]

Both variants run in one process: each round prefills both (alternating which goes first), then
decodes with the two taking turns step by step. Reported: medians over rounds of time per token,
and their ratio, printed; with `--out DIR` also written there as
`overhead-<preset>-<mode>-<device>.{json,md}` (files already there are replaced only with `--force`).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

import hebrus
from hebrus.bench import InPlaceSession as InPlace


def _sync(t: torch.Tensor) -> None:
    """The in-place variant never waits for the device; time both to completion."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def _round(variants, prompt, decode, flip):
    """One round: prefill each variant (one chunk), then decode with the two variants taking
    turns step by step, so that drift in machine speed hits both alike."""
    names = list(variants)[::-1] if flip else list(variants)
    sessions = {name: variants[name]() for name in names}
    out = {name: {"prefill": 0.0, "decode": 0.0} for name in names}
    logits = {}
    for name in names:
        t = time.perf_counter()
        logits[name] = sessions[name].feed(prompt)
        _sync(logits[name])
        out[name]["prefill"] = (time.perf_counter() - t) / len(prompt)
    for step in range(decode):
        order = names if step % 2 == 0 else names[::-1]
        for name in order:
            token = int(torch.argmax(logits[name]))
            t = time.perf_counter()
            logits[name] = sessions[name].feed([token])
            _sync(logits[name])
            out[name]["decode"] += (time.perf_counter() - t) / decode
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--mode", default="fast", choices=["exact", "fast"])
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--out", metavar="DIR", help="also write the report's .json and .md into DIR")
    parser.add_argument("--force", action="store_true", help="replace the report's files in --out if they exist")
    args = parser.parse_args()
    stem = f"overhead-{args.preset}-{args.mode}-{torch.device(args.device).type}"
    if args.out and not args.force and any((Path(args.out) / f"{stem}{x}").exists() for x in (".json", ".md")):
        parser.error(f"{Path(args.out) / stem}.json or .md exists: another --out, or --force to replace them")
    if args.threads:
        torch.set_num_threads(args.threads)

    model = hebrus.load(args.preset, mode=args.mode, device=args.device)
    prompt = torch.randint(0, model.spec.vocab_size, (args.prefill,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    variants = {"transactional": model.session, "in-place": lambda: InPlace(model)}
    _round(variants, prompt[:32], 4, flip=False)                       # warm up both paths
    _check_same_result(variants, prompt)

    times = {name: {"prefill": [], "decode": []} for name in variants}
    for r in range(args.rounds):
        result = _round(variants, prompt, args.decode, flip=r % 2 == 1)
        for name, t in result.items():
            times[name]["prefill"].append(t["prefill"])
            times[name]["decode"].append(t["decode"])
        print(f"round {r + 1}/{args.rounds}  " + "  ".join(
            f"{name}: prefill {t['prefill'] * 1e3:6.3f} decode {t['decode'] * 1e3:7.3f} ms/token"
            for name, t in result.items()), flush=True)

    report = _report(args, model, times)
    report["injection_point_ns_per_stage"] = _injection_point_cost(model)
    print(_markdown(report))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / f"{stem}.md").write_text(_markdown(report))


def _injection_point_cost(model, calls: int = 200_000) -> float:
    """Nanoseconds one call of the injection point takes with nothing armed."""
    from hebrus import faults
    name = model.stage_names[-1]
    t = time.perf_counter()
    for _ in range(calls):
        faults.after(name, None)
    return (time.perf_counter() - t) / calls * 1e9


def _check_same_result(variants, prompt):
    a, b = variants["transactional"](), variants["in-place"]()
    if not torch.equal(a.feed(prompt[:40]), b.feed(prompt[:40])):
        raise SystemExit("the two variants disagree; the measurement would be meaningless")


def _report(args, model, times):
    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    ratio = {k: med["transactional"][k] / med["in-place"][k] for k in ("prefill", "decode")}
    return {
        "preset": args.preset, "mode": args.mode, "device": _device_name(model.device), "dtype": "float32",
        "prefill_tokens": args.prefill, "decode_steps": args.decode, "rounds": args.rounds,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
        "parameters": sum(math.prod(t.shape) for _, t in model.named_parameters()),
        "stages": len(model.stages),
        "median_ms_per_token": {n: {k: v * 1e3 for k, v in m.items()} for n, m in med.items()},
        "ratio_transactional_over_in_place": ratio,
        "target": 1.05,
        "raw_ms_per_token": {n: {k: [x * 1e3 for x in v] for k, v in t.items()} for n, t in times.items()},
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def _markdown(r) -> str:
    m, ratio = r["median_ms_per_token"], r["ratio_transactional_over_in_place"]
    lines = [
        f"# Transaction overhead: {r['preset']} preset, {r['mode']} mode, {r['device']} "
        f"({r['threads']} CPU threads, torch {r['torch']})",
        "",
        f"Median of {r['rounds']} alternating rounds; prefill is one {r['prefill_tokens']}-token chunk, "
        f"decode is {r['decode_steps']} one-token chunks.",
        "",
        "| | transactional ms/token | in-place ms/token | ratio (target ≤ 1.05) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for k in ("prefill", "decode"):
        lines.append(f"| {k} | {m['transactional'][k]:.3f} | {m['in-place'][k]:.3f} | {ratio[k]:.3f} |")
    if "injection_point_ns_per_stage" in r:
        ns = r["injection_point_ns_per_stage"]
        lines += ["", f"Injection point with nothing armed: {ns:.0f} ns per stage, "
                      f"{ns * r['stages'] / 1e3:.1f} µs per chunk of {r['stages']} stages "
                      f"({ns * r['stages'] / 1e6 / m['transactional']['decode'] * 100:.3f}% of a decode step)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
