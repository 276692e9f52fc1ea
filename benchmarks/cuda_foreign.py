"""Imported families on CUDA: parity with transformers' CPU float32 reference and `verify`.

Usage (on the GPU machine): python benchmarks/cuda_foreign.py FOLDER OUT.md
FOLDER holds one checkpoint per family, each with `reference.pt` written on the CPU by
`python benchmarks/cuda_foreign.py --prepare FOLDER` (transformers' prompt logits, cache states,
greedy tokens and their logits). No transformers needed on the GPU machine.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
DEVICE = os.environ.get("HEBRUS_DEVICE", "cuda")


def prepare(folder: Path) -> None:
    from foreign import FAMILIES, build, reference_run
    for family in sorted(FAMILIES):
        target, model = build(family, folder / family)
        ids = torch.randint(0, model.config.vocab_size, (23,), generator=torch.Generator().manual_seed(1)).tolist()
        prompt, states, tokens, steps = reference_run(model, ids, 32)
        torch.save({"ids": ids, "prompt": prompt, "states": states, "tokens": tokens,
                    "steps": torch.stack(steps)}, target / "reference.pt")


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max())


def check(folder: Path, lines: list[str]) -> None:
    import hebrus
    from hebrus import verify
    ref = torch.load(folder / "reference.pt")
    ids = ref["ids"]
    for dtype, modes in ((torch.float32, ("exact", "fast")), (torch.bfloat16, ("fast",))):
        for mode in modes:
            model = hebrus.load(folder, device=DEVICE, dtype=dtype, mode=mode)
            worst, digests = {}, set()
            for chunks in ([23], [7, 16], [1] * 23):
                s, at = model.session(), 0
                for size in chunks:
                    logits = s.feed(ids[at:at + size])
                    at += size
                    worst["prompt logits"] = max(worst.get("prompt logits", 0), rel(logits, ref["prompt"][at - 1]))
                for name, theirs in ref["states"].items():
                    ours = s.image.value(name)
                    theirs = theirs[:, 1:] if name.endswith("gdn.conv") else theirs
                    kind = name.split(".", 2)[2]
                    worst[kind] = max(worst.get(kind, 0), rel(ours, theirs))
                digests.add(s.digest())
            s = model.session()
            s.prefill(ids, chunk_size=8)
            greedy = []
            for step in range(32):
                worst["decode logits"] = max(worst.get("decode logits", 0), rel(s.logits, ref["steps"][step]))
                greedy.append(int(torch.argmax(s.logits)))
                s.feed([ref["tokens"][step]])
            started = time.perf_counter()
            results = verify.run(model)
            failed = [r for r in results if not r.passed]
            dt = str(dtype).removeprefix("torch.")
            errors = ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
            lines.append(f"| {folder.name} | {dt} | {mode} | {errors} | {greedy == ref['tokens']} | "
                         f"{len(digests) == 1} | {len(results) - len(failed)}/{len(results)} "
                         f"({time.perf_counter() - started:.1f} s) |")
            for r in failed:
                lines.append(f"|  |  |  | verify failed: {r.name}: {r.detail} |  |  |  |")


def main() -> None:
    if sys.argv[1] == "--prepare":
        prepare(Path(sys.argv[2]))
        return
    folder, out = Path(sys.argv[1]), Path(sys.argv[2])
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    lines = [f"device: {name}, torch {torch.__version__}", "",
             "| family | dtype | mode | largest relative error against transformers (CPU, float32) | "
             "greedy tokens equal | one digest over chunkings (exact mode promises it) | verify |",
             "|---|---|---|---|---|---|---|"]
    for family in sorted(p for p in folder.iterdir() if (p / "reference.pt").exists()):
        check(family, lines)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
