"""Why the tiny bfloat16 model's graph decode strays from its eager decode (the GPU test
`test_graph_decode_matches_eager`): the test's run again, step by step, with the distances of
the graph, planned and eager routes' logits from each other and from the float32 twin, whether
the graph's stored routes (experts) equal eager's so far, and how near a tie eager's closest
choice at that position was (its margin at the site's scale, from a `Recorder`).

With `--quantize` the weights are quantized as they load (the GPU test of a quantized model's
graph decode); `--inputs test` feeds that test's prompt and tokens (3..39, then 0..11) instead
of random ones; `--without OP,...` adds a column: the graph route of a model built without those
ops of the kinds' tables (e.g. attention.lanes, attention.rotate, gdn.lanes), against float32.

    python benchmarks/diag/graph_flips.py [--steps 30] [--quantize FORMAT] [--inputs random|test]
        [--without OP,...] [--out DIR]"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import hebrus
from hebrus.bound import BOUNDS
from hebrus.layers.replay import Recorder


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _ids(n, vocab, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quantize", help="quantize the weights as they load (int8, int4, fp8, ...)")
    parser.add_argument("--inputs", choices=("random", "test"), default="random")
    parser.add_argument("--without", help="comma-separated ops the extra column's model is built without")
    parser.add_argument("--out", default="/tmp")
    args = parser.parse_args()
    model = hebrus.load("tiny", device="cuda", dtype="bfloat16", mode="fast", quantize=args.quantize)
    wide = model.with_dtype(torch.float32) if args.quantize else hebrus.load("tiny", device="cuda", mode="fast")
    without = None
    if args.without:
        from hebrus.layers import kernels as table
        every = table.kind_ops
        table.kind_ops = lambda *a: {k: v for k, v in every(*a).items() if k not in args.without.split(",")}
        without = hebrus.load("tiny", device="cuda", dtype="bfloat16", mode="fast", quantize=args.quantize)
        table.kind_ops = every
    recorder = Recorder(inner=model.kernels.choose)
    sessions = {"graph": model.session(decode="graph"), "planned": model.session(decode="planned"),
                "eager": model.with_mode("fast", recorder).session(decode="eager"),
                "float32": wide.session(decode="eager")}
    if without is not None:
        sessions["without"] = without.session(decode="graph")
    vocab = model.spec.vocab_size
    prompt, tokens = (list(range(3, 40)), list(range(12))) if args.inputs == "test" else \
        (_ids(10, vocab, 1), _ids(args.steps, vocab, 2))
    for s in sessions.values():
        s.feed(prompt)
    lines = [f"tiny bfloat16{' ' + args.quantize if args.quantize else ''}, {args.inputs} inputs"
             f"{'; without ' + args.without if args.without else ''}",
             "step | graph~f32 | eager~f32 | graph~eager | planned~graph | routes graph=eager | closest margin (site)"
             + (" | without~f32" if without is not None else "")]
    for step, t in enumerate(tokens):
        got = {name: s.feed([t]).float() for name, s in sessions.items()}
        position = sessions["eager"].frontier - 1
        scales = recorder.scales()
        here = [(c.gap / scales[site], site) for (site, p), c in recorder.log.items() if p == position]
        margin, site = min(here) if here else (float("inf"), "-")
        same = torch.equal(sessions["graph"].image.value("routes"), sessions["eager"].image.value("routes"))
        lines.append(f"{step} | {_rel(got['graph'], got['float32']):.4f} | {_rel(got['eager'], got['float32']):.4f} | "
                     f"{_rel(got['graph'], got['eager']):.4f} | {_rel(got['planned'], got['graph']):.2e} | {same} | "
                     f"{margin:.2e} ({site})" + (f" | {_rel(got['without'], got['float32']):.4f}" if without else ""))
    lines.append(f"bfloat16 Bound.margin {BOUNDS[torch.bfloat16].margin}")
    text = "\n".join(lines)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = f"graph-flips{'-' + args.quantize if args.quantize else ''}{'-without' if args.without else ''}.txt"
    (Path(args.out) / name).write_text(text + "\n")


if __name__ == "__main__":
    main()
