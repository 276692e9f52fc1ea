"""How far is fast mode from exact mode, once exact's discrete choices are replayed?

For random prompts (short ones and long ones) and random chunkings, per dtype: one exact run
that records every choice (`hebrus.layers.replay.Recorder`), then each chunking in fast mode twice:
with exact's choices replayed (the verified promise: continuous error within the dtype's
tolerance, flips only at near-ties) and on its own (what a fast session really does: a flip at
a near-tie sends the rest of that token's computation down another path).

    python benchmarks/fast_bound.py [--preset tiny] [--dtypes float32,bfloat16,float64,float16]
        [--short 40] [--long 2] [--long-length 1024] [--threads 1] [--seed 0] [--text FILE] [--out DIR [--force]]

Prints its report; with `--out DIR` also writes fast-bound-<device>.{json,md} there
(fast-bound-<preset>-<device> for other presets; files already there are replaced only with `--force`). One thread by default: on a shared 2-core machine
two threads spin against other processes and the timing becomes noise (the errors do not care).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

import hebrus
from hebrus import bound

KEEP_FLIPS = 20          # flips written to the JSON: those with the largest margins


def _split(n: int, rng: random.Random, largest: int) -> list[int]:
    sizes = []
    while n:
        sizes.append(min(n, rng.randint(1, largest)))
        n -= sizes[-1]
    return sizes


def cases(args, vocab: int, rng: random.Random) -> list[tuple[list[int], list[list[int]]]]:
    """(tokens, chunkings): whole, one random split into small chunks, one into larger ones."""
    out = []
    lengths = [rng.randint(2, 160) for _ in range(args.short)] + [args.long_length] * args.long
    text = Path(args.text).read_bytes() if args.text else None
    for n in lengths:
        if text is None:
            tokens = [rng.randrange(vocab) for _ in range(n)]
        else:                           # a window of the text at a random offset
            at = rng.randrange(len(text) - n)
            tokens = list(text[at:at + n])
        out.append((tokens, [[n], _split(n, rng, 13), _split(n, rng, max(2, n // 3))]))
    return out


def errors(fast, exact, fast_logits, exact_logits) -> tuple[float, str, int]:
    """Largest relative error over floating owners and the logits (where), and how many rows of
    `routes` differ."""
    owners = bound.owner_errors(fast, exact)
    routes = int((fast.image.rows("routes") != exact.image.rows("routes")).flatten(1).any(-1).sum())
    owners["logits"] = bound.relative_error(fast_logits, exact_logits)
    where = max((name for name in owners if name != "routes"), key=owners.get)
    return owners[where], where, routes


class Tally:
    """Everything measured for one dtype."""

    def __init__(self, bound: bound.Bound):
        self.bound = bound
        self.errors: list[float] = []            # per replayed run: owners and logits
        self.score_errors: list[float] = []      # per replayed run: chooser scores
        self.worst = {"error": (0.0, ""), "scores": (0.0, ""), "unreplayed": (0.0, "")}
        self.flips: list[dict] = []
        self.choices, self.ties, self.closest = 0, 0, (float("inf"), "")
        self.unreplayed = {"runs": 0, "over_tolerance": 0, "with_route_differences": 0, "greedy_differs": 0}
        self.tokens = 0

    def exact(self, recorder, label: str) -> None:
        base = bound.Replayed.of(recorder)
        self.choices += len(recorder.log)
        self.ties += base.ties
        self.closest = min(self.closest, (base.closest, f"{base.closest_where} ({label})"))

    def replayed(self, err: float, where: str, replayer, scales: dict, run: str) -> None:
        one = bound.Replayed()
        one.add(err, where, replayer, scales)
        self.errors.append(err)
        self.score_errors.append(one.score_error)
        self._worst("error", err, f"{where} ({run})")
        self._worst("scores", one.score_error, f"{one.score_where} ({run})")
        self.flips += [{"site": f.site, "position": f.position, "exact": list(f.recorded), "fast": list(f.own),
                        "margin": margin, "run": run} for margin, f in one.flips]

    def own(self, err: float, where: str, route_rows: int, greedy_differs: bool) -> None:
        u = self.unreplayed
        u["runs"] += 1
        u["over_tolerance"] += err > self.bound.tolerance
        u["with_route_differences"] += route_rows > 0
        u["greedy_differs"] += greedy_differs
        self._worst("unreplayed", err, where)

    def _worst(self, key: str, value: float, where: str) -> None:
        if value > self.worst[key][0]:
            self.worst[key] = (value, where)

    def result(self, seconds: float) -> dict:
        largest_flip = max((f["margin"] for f in self.flips), default=None)
        passed = (max(self.worst["error"][0], self.worst["scores"][0]) <= self.bound.tolerance
                  and all(f["margin"] <= self.bound.margin for f in self.flips))
        return {"bound": {"tolerance": self.bound.tolerance, "margin": self.bound.margin},
                "runs": len(self.errors), "tokens": self.tokens, "seconds": round(seconds, 1),
                "replayed": {"passed": passed, "error": self.worst["error"], "scores": self.worst["scores"],
                             "error_quantiles": _quantiles(self.errors),
                             "score_quantiles": _quantiles(self.score_errors),
                             "flips": len(self.flips), "largest_flip_margin": largest_flip,
                             "flips_by_site": _count(f["site"].split(".")[-1] for f in self.flips)},
                "exact_choices": {"count": self.choices, "ties": self.ties, "closest_near_tie": self.closest},
                "unreplayed": dict(self.unreplayed, error=self.worst["unreplayed"]),
                "flips_nearest_the_bound": sorted(self.flips, key=lambda f: -f["margin"])[:KEEP_FLIPS]}


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {f"p{q}": ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] for q in (50, 90, 99)}


def run_case(model, tokens, chunkings, label: str, tally: Tally) -> None:
    ref, ref_logits, recorder = bound.record(model, tokens)
    tally.exact(recorder, label)
    scales = recorder.scales()
    for sizes in chunkings:
        run = f"{label}, chunks {_describe(sizes)}"
        s, logits, replayer = bound.replay(model, recorder, tokens, sizes)
        err, where, _ = errors(s, ref, logits, ref_logits)
        tally.replayed(err, where, replayer, scales, run)
        own, own_logits = bound.run_chunks(model.with_mode("fast"), tokens, sizes)
        err, where, rows = errors(own, ref, own_logits, ref_logits)
        tally.own(err, f"{where} ({run})", rows, int(torch.argmax(own_logits)) != int(torch.argmax(ref_logits)))
        tally.tokens += len(tokens)


def _describe(sizes: list[int]) -> str:
    return f"{len(sizes)} chunk(s)" + (f", largest {max(sizes)}" if len(sizes) > 1 else f" of {sizes[0]}")


def measure(args, dtype: str, rng: random.Random) -> dict:
    model = hebrus.load(args.preset, dtype=dtype, device=args.device)
    tally = Tally(bound.BOUNDS[model.dtype])
    started = time.perf_counter()
    for i, (ids, chunkings) in enumerate(cases(args, model.config.vocab_size, rng)):
        run_case(model, ids, chunkings, f"prompt {i}, {len(ids)} tokens", tally)
    return tally.result(time.perf_counter() - started)


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def report(results: dict, meta: dict) -> str:
    source = f"windows of {Path(meta['text']).name}" if meta.get("text") else "random"
    lines = [f"# Fast mode against exact mode: {meta['preset']}, {meta['device']} "
             f"({meta['threads']} thread(s), torch {meta['torch']})", "",
             f"Per dtype: {meta['short']} {source} prompts of 2–160 tokens and {meta['long']} of "
             f"{meta['long_length']} tokens, each in 3 chunkings (one chunk, chunks of ≤ 13, chunks of "
             f"≤ n/3); seed {meta['seed']}. Owners and logits: error relative to the largest magnitude of "
             "the tensor. Scores and margins: relative to the largest score magnitude at the site "
             "(`hebrus.layers.replay`).",
             "", "With exact's choices replayed (what `hebrus verify --mode fast` checks):", "",
             "| dtype | runs | tokens | max error (p99) | max score error | bound | flips "
             "| largest flip margin (bound) | closest near-tie | exact ties | passed | s |",
             "| --- | ---: | ---: | --- | --- | --- | ---: | --- | --- | ---: | --- | ---: |"]
    for dtype, r in results.items():
        rep, b, ex = r["replayed"], r["bound"], r["exact_choices"]
        flip = "–" if rep["largest_flip_margin"] is None else f"{rep['largest_flip_margin']:.1e}"
        lines.append(f"| {dtype} | {r['runs']} | {r['tokens']} | {rep['error'][0]:.1e} "
                     f"({rep['error_quantiles']['p99']:.1e}) | {rep['scores'][0]:.1e} | {b['tolerance']:.2g} | "
                     f"{rep['flips']} | {flip} ({b['margin']:.2g}) | {ex['closest_near_tie'][0]:.1e} | "
                     f"{ex['ties']} of {ex['count']} | {'yes' if rep['passed'] else 'NO'} | {r['seconds']} |")
    lines += ["", "Fast mode on its own (choices not replayed):", "",
              "| dtype | max error | runs over the bound | runs with other routes "
              "| last-token argmax differs |",
              "| --- | --- | ---: | ---: | ---: |"]
    for dtype, r in results.items():
        u = r["unreplayed"]
        lines.append(f"| {dtype} | {u['error'][0]:.1e} | {u['over_tolerance']} of {u['runs']} | "
                     f"{u['with_route_differences']} | {u['greedy_differs']} |")
    lines += ["", "Where:", ""]
    for dtype, r in results.items():
        rep = r["replayed"]
        lines.append(f"- {dtype}: max error {rep['error'][1]}; scores {rep['scores'][1]}; flips by site "
                     f"{rep['flips_by_site'] or '{}'}; unreplayed {r['unreplayed']['error'][1]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="a preset or checkpoint folder (default tiny)")
    p.add_argument("--text", help="prompts are random windows of this file's bytes (byte models), not random ids")
    p.add_argument("--dtypes", default="float32,bfloat16,float64,float16")
    p.add_argument("--short", type=int, default=40, help="short prompts per dtype")
    p.add_argument("--long", type=int, default=2, help="long prompts per dtype")
    p.add_argument("--long-length", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", metavar="DIR", help="also write the report's .json and .md into DIR")
    p.add_argument("--force", action="store_true", help="replace the report's files in --out if they exist")
    args = p.parse_args()
    device = torch.device(args.device).type
    name = f"fast-bound-{device}" if args.preset == "tiny" else f"fast-bound-{Path(args.preset).name}-{device}"
    if args.out and not args.force and any((Path(args.out) / f"{name}{x}").exists() for x in (".json", ".md")):
        p.error(f"{Path(args.out) / name}.json or .md exists: another --out, or --force to replace them")
    torch.set_num_threads(args.threads)
    results = {}
    for dtype in args.dtypes.split(","):
        results[dtype] = measure(args, dtype, random.Random(args.seed))
        print(f"{dtype}: {results[dtype]['seconds']} s", flush=True)
    keys = ("preset", "text", "short", "long", "long_length", "threads", "seed", "device")
    meta = {k: getattr(args, k) for k in keys}
    meta.update(torch=torch.__version__, machine=platform.machine())
    print(report(results, meta))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        (out / f"{name}.md").write_text(report(results, meta))


if __name__ == "__main__":
    main()
