"""Imported models against transformers, in numbers: the largest relative error (over the
tensor's largest magnitude) per family, mode and compared quantity, for hebrus float32 against
transformers float32, and for each of them against hebrus float64 (the closest to exact math
available: transformers keeps norms and the delta rule in float32 even in a float64 model).

Run: python benchmarks/foreign_parity.py [--out FILE]  (needs transformers; tests/foreign.py
builds the models, 23 prompt tokens, 32 greedy steps; exact mode is fed one token at a
time, fast mode in chunks of 8; DeepSeek-V4's state is compared owner by owner with
transformers' cache in float64, `foreign.v4_cache_pairs`)."""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import hebrus  # noqa: E402
from foreign import FAMILIES, build, float64_everywhere, in_float64, reference_run, v4_cache_pairs  # noqa: E402

STEPS = 32
V4_IDS = torch.randint(0, 101, (23,), generator=torch.Generator().manual_seed(3)).tolist()   # ends inside its windows


METRIC = "max"


def rel(a, b) -> float:
    """max |a - b| / max |b| (METRIC "max"), or ||a - b|| / ||b|| over the whole tensor ("norm")."""
    a, b = a.double(), b.double()
    if METRIC == "norm":
        return float((a - b).norm() / b.norm())
    return float((a - b).abs().max() / b.abs().max())


def per_row(a, b) -> float:
    """The largest relative error of a row (one position's logits) over the rows."""
    return max(rel(x, y) for x, y in zip(a, b))


def measure(family: str, folder: Path, model) -> list[str]:
    ids = torch.randint(0, model.config.vocab_size, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt, states, tokens, step_logits = reference_run(model, ids, STEPS)
    truth = hebrus.load(folder, dtype=torch.float64).session()
    truth_prompt = torch.stack([truth.feed([t]) for t in ids])
    truth_states = {name: truth.image.value(name).clone() for name in states}
    with float64_everywhere():
        wide_prompt, wide_states, wide_tokens, wide_steps = reference_run(in_float64(model), ids, STEPS)
    worst = max([per_row(truth_prompt, wide_prompt)] +
                [rel(truth_states[n], v[:, 1:] if n.endswith(("gdn.conv", "kda.conv")) else v) for n, v in wide_states.items()])
    for step in range(STEPS):
        worst = max(worst, rel(truth.logits, wide_steps[step]))
        truth.feed([wide_tokens[step]])
    rows = [f"| {family} | float64 | everything: logits, states, 32 decode steps | {worst:.2e} "
            f"(hebrus f64 vs transformers f64 throughout) | | |"]
    if family == "deepseek_v4":     # its state against transformers' cache, owner by owner (float64)
        found: dict[str, float] = {}
        for quantity, mine, theirs in v4_cache_pairs(folder, model, V4_IDS):
            found[quantity] = max(found.get(quantity, 0.0), rel(mine, theirs))
        rows += [f"| {family} | float64 | {quantity} (against transformers' cache) | {error:.2e} | | |"
                 for quantity, error in found.items()]
    for mode in ("exact", "fast"):
        session = hebrus.load(folder, mode=mode).session()
        # exact: one token at a time (every position's logits); fast: chunks of 8, its batched path
        size = 1 if mode == "exact" else 8
        ends = [min(at + size, len(ids)) - 1 for at in range(0, len(ids), size)]
        ours = torch.stack([session.feed(ids[at:at + size]) for at in range(0, len(ids), size)])
        found = {"prompt logits": (per_row(ours, prompt[ends]), per_row(ours, truth_prompt[ends]),
                                   per_row(prompt[ends], truth_prompt[ends]))}
        for name, theirs in states.items():
            kind = name.split(".", 2)[2]
            mine, exact = session.image.value(name), truth_states[name]
            if kind in ("gdn.conv", "kda.conv"):
                theirs = theirs[:, 1:]
            errors = (rel(mine, theirs), rel(mine, exact), rel(theirs, exact))
            old = found.get(kind, (0, 0, 0))
            found[kind] = tuple(max(a, b) for a, b in zip(old, errors))
        greedy, worst = [], 0.0
        for step in range(STEPS):
            worst = max(worst, rel(session.logits, step_logits[step]))
            greedy.append(int(torch.argmax(session.logits)))
            session.feed([tokens[step]])
        found["decode logits (32 steps)"] = (worst, float("nan"), float("nan"))
        for quantity, (a, b, c) in found.items():
            rows.append(f"| {family} | {mode} | {quantity} | {a:.2e} | {b:.2e} | {c:.2e} |")
        rows.append(f"| {family} | {mode} | greedy tokens identical | {greedy == tokens} | | |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--metric", choices=("max", "norm"), default="max",
                        help="max: max |error| / max |reference|; norm: ||error|| / ||reference||")
    args = parser.parse_args()
    global METRIC
    METRIC = args.metric
    lines = ["| family | mode | quantity | hebrus f32 vs transformers f32 | hebrus f32 vs hebrus f64 | "
             "transformers f32 vs hebrus f64 |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for family in sorted(FAMILIES):
            folder, model = build(family, Path(tmp) / family)
            lines += measure(family, folder, model)
    text = "\n".join(lines).replace("nan", "-")
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
