"""Plot the training curves of both models: validation (Macbeth) and training loss against tokens.

    python recipes/shakespeare/plot.py [--results recipes/shakespeare/results]   # needs matplotlib

Reads curve-hebrus.json and curve-dense.json, writes curve.png beside them.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, colour in (("hebrus", "tab:blue"), ("dense", "tab:orange")):
        curve = json.loads((args.results / f"curve-{name}.json").read_text())
        tokens = [row["tokens"] / 1e6 for row in curve]
        ax.plot(tokens, [row["val"] for row in curve], "-o", color=colour, ms=3, label=f"{name}: validation (Macbeth)")
        ax.plot(tokens, [row["train"] for row in curve], ":", color=colour, label=f"{name}: training (last batch)")
    ax.axhline(1.40, color="grey", lw=0.8, ls="--", label="target 1.40")
    ax.set_xlabel("tokens trained (millions of bytes)")
    ax.set_ylabel("nats per byte")
    ax.set_ylim(1.0, 3.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Shakespeare bytes: Hebrus vs dense, 9.39M parameters each")
    fig.tight_layout()
    fig.savefig(args.results / "curve.png")


if __name__ == "__main__":
    main()
