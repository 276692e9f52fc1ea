"""Why the tiny bfloat16 model's graph decode strays from its eager decode (the GPU test
`test_graph_decode_matches_eager`): the test's run again, step by step, with the distances of
the graph, planned and eager routes' logits from each other and from the float32 twin, whether
the graph's stored routes (experts) equal eager's so far, and how near a tie eager's closest
choice at that position was (its margin at the site's scale, from a `Recorder`).

    python benchmarks/diag/graph_flips.py [--steps 30] [--out DIR]"""
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
    parser.add_argument("--out", default="/tmp")
    args = parser.parse_args()
    model = hebrus.load("tiny", device="cuda", dtype="bfloat16", mode="fast")
    wide = hebrus.load("tiny", device="cuda", mode="fast")
    recorder = Recorder(inner=model.kernels.choose)
    sessions = {"graph": model.session(decode="graph"), "planned": model.session(decode="planned"),
                "eager": model.with_mode("fast", recorder).session(decode="eager"),
                "float32": wide.session(decode="eager")}
    vocab = model.spec.vocab_size
    for s in sessions.values():
        s.feed(_ids(10, vocab, 1))
    lines = ["step | graph~f32 | eager~f32 | graph~eager | planned~graph | routes graph=eager | closest margin (site)"]
    for step, t in enumerate(_ids(args.steps, vocab, 2)):
        got = {name: s.feed([t]).float() for name, s in sessions.items()}
        position = sessions["eager"].frontier - 1
        scales = recorder.scales()
        here = [(c.gap / scales[site], site) for (site, p), c in recorder.log.items() if p == position]
        margin, site = min(here) if here else (float("inf"), "-")
        same = torch.equal(sessions["graph"].image.value("routes"), sessions["eager"].image.value("routes"))
        lines.append(f"{step} | {_rel(got['graph'], got['float32']):.4f} | {_rel(got['eager'], got['float32']):.4f} | "
                     f"{_rel(got['graph'], got['eager']):.4f} | {_rel(got['planned'], got['graph']):.2e} | {same} | "
                     f"{margin:.2e} ({site})")
    lines.append(f"bfloat16 Bound.margin {BOUNDS[torch.bfloat16].margin}")
    text = "\n".join(lines)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "graph-flips.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
