"""`hebrus bench --tensor-parallel N`: the model split over N ranks against the same model in
one process, in one run: prefill tokens/s at each context and decode ms/step (both eager, the
one route a tensor-parallel model steps by), rounds taking turns, medians reported."""
from __future__ import annotations

import statistics
import time

import torch

from hebrus.bench.limits import sync


def _round(model, prompt: list[int], steps: int, chunk: int) -> tuple[float, float]:
    """One session: (seconds to prefill `prompt`, seconds per decode step over `steps` steps)."""
    s = model.session(decode="eager")
    sync(model.device)
    start = time.perf_counter()
    s.prefill(prompt, chunk_size=chunk)
    sync(model.device)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for t in range(steps):
        s.feed([prompt[t % len(prompt)]])
    sync(model.device)
    return prefill, (time.perf_counter() - start) / steps


def run(plain, split, contexts: list[int], steps: int, rounds: int, chunk: int | None, progress=None) -> dict:
    """Both models at each context: a warm-up round each, then `rounds` rounds taking turns. On
    the CPU the model in one process computes with every thread the ranks share between them."""
    gen = torch.Generator().manual_seed(0)
    points = []
    for n, context in enumerate(contexts):
        if progress:
            progress(n, len(contexts), f"context {context}")
        prompt = torch.randint(0, plain.spec.vocab_size, (context,), generator=gen).tolist()
        size = chunk or plain.prefill_chunk
        times: dict[str, list] = {"plain": [], "split": []}
        for r in range(rounds + 1):
            for name, model in (("plain", plain), ("split", split)):
                shared = torch.get_num_threads()
                if name == "plain":
                    torch.set_num_threads(split.host_threads)
                try:
                    measured = _round(model, prompt, steps, size)
                finally:
                    torch.set_num_threads(shared)
                if r:
                    times[name].append(measured)
        medians = {name: (statistics.median(p for p, _ in ts), statistics.median(d for _, d in ts))
                   for name, ts in times.items()}
        points.append({"context": context,
                       "prefill_tok_s": {name: context / m[0] for name, m in medians.items()},
                       "decode_ms": {name: m[1] * 1e3 for name, m in medians.items()},
                       "prefill_ratio": medians["plain"][0] / medians["split"][0],
                       "decode_ratio": medians["split"][1] / medians["plain"][1]})
    if progress:
        progress(len(contexts), len(contexts), "done")
    return {"points": points}


def table(report: dict) -> str:
    world = report["world"]
    lines = [f"# {report['model']}: {world} ranks against one process ({report['device']}, {report['dtype']}, "
             f"{report['mode']} mode, eager steps, {report['rounds']} rounds, {report['date']}, {report['commit']})",
             "",
             f"| context | prefill tok/s, one | prefill tok/s, {world} ranks | {world} ranks ÷ one | "
             f"decode ms/step, one | decode ms/step, {world} ranks | {world} ranks ÷ one |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in report["points"]:
        lines.append(f"| {p['context']} | {p['prefill_tok_s']['plain']:,.0f} | {p['prefill_tok_s']['split']:,.0f} | "
                     f"{p['prefill_ratio']:.3f} | {p['decode_ms']['plain']:.3f} | {p['decode_ms']['split']:.3f} | "
                     f"{p['decode_ratio']:.3f} |")
    lines.append("")
    lines.append("prefill ratio: tokens/s over ranks ÷ in one process (above 1: faster); decode ratio: ms/step over "
                 "ranks ÷ in one process (above 1: slower)")
    return "\n".join(lines) + "\n"
