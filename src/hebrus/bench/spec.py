"""`hebrus bench --spec`: speculative decoding against plain decoding, and what a fork costs.

A repetitive workload (`workload`): random seed ids and the model's own continuation of them,
said twice, then the seed again; then greedy decoding
of `new` tokens, plain (one token per transaction, CUDA graphs where the model runs them) and
speculative (prompt lookup; a draft model if given), rounds taking turns so drift hits all
alike. Reported per variant: tokens/s, the median over rounds; how many drafted tokens were kept
of those proposed; tokens per verifying chunk; and whether the output equals plain decoding's.
Then a fork of a session holding each context: its median time, and the first step after it
(which copies the row logs it writes) beside the next.
"""
from __future__ import annotations

import statistics
import time

import torch

from hebrus import speculate
from hebrus.bench.limits import sync
from hebrus.sampling import Sampling


SEED_TEXT = b"First Citizen:\nBefore we proceed any further, hear me speak.\n\n"


def workload(model, seed_tokens: int = 64, passage: int = 192, repeats: int = 2, seed: int = 0) -> list[int]:
    """A repetitive prompt: seed ids (a line of English for a byte-level model, else random
    ids), then the model's own greedy continuation of them (`passage` tokens), the two said
    `repeats` times, then the seed once more; what follows is most likely the continuation
    again (prompt lookup's best case: a text rewritten or quoted)."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(SEED_TEXT) if model.spec.vocab_size == 256 else \
        torch.randint(0, model.spec.vocab_size, (seed_tokens,), generator=gen).tolist()
    said = ids + list(model.session().generate(ids, max_new_tokens=passage))
    return said * repeats + ids


def decode_point(model, prompt: list[int], new: int, rounds: int, drafters: dict, draft_tokens: int,
                 progress=None) -> list[dict]:
    """Rows for plain decoding and each drafter ("lookup" or a draft model), timed in turns."""
    variants = {"plain": None, **drafters}
    times = {name: [] for name in variants}
    outputs, kept_counts = {}, {name: [] for name in variants}
    nothing = torch.tensor([], dtype=torch.int64)
    for r in range(rounds + 1):                      # round 0 warms up (graphs, compiled ops)
        for name, how in variants.items():
            s = model.session()
            s.prefill(prompt)
            counted = []
            if how is None:
                tokens = s.generate([], max_new_tokens=new)
            else:                                    # generate's own path, with its chunks recorded
                drafter = speculate.drafter(how, model, prompt, new + draft_tokens, model.prefill_chunk)
                tokens = speculate.speculative(s, nothing, new, Sampling(), frozenset(), prompt, None,
                                               model.prefill_chunk, drafter, draft_tokens, record=counted)
            sync(model.device)
            t = time.perf_counter()
            out = list(tokens)
            sync(model.device)
            elapsed = time.perf_counter() - t
            if r:
                times[name].append(elapsed)
                kept_counts[name] += counted
            outputs[name] = out
            if progress is not None:
                progress(r * len(variants) + list(variants).index(name) + 1, (rounds + 1) * len(variants))
    rows = []
    plain = statistics.median(times["plain"])
    for name in variants:
        seconds = statistics.median(times[name])
        chunks = kept_counts[name]
        proposed = sum(length - 1 for length, _ in chunks)
        kept = sum(k - 1 for _, k in chunks)
        same = outputs[name] == outputs["plain"]
        first_difference = None if same else next(
            (i for i, (a, b) in enumerate(zip(outputs[name], outputs["plain"])) if a != b), None)
        rows.append({
            "variant": name, "tokens": new, "tokens_per_s": new / seconds, "speedup_over_plain": plain / seconds,
            "drafted": proposed, "drafts_kept": kept,
            "acceptance": kept / proposed if proposed else None,
            "tokens_per_verify_chunk": sum(k for _, k in chunks) / len(chunks) if chunks else None,
            "verify_chunks": len(chunks) // rounds if rounds else len(chunks),
            "output_equals_plain": same, "first_difference_at": first_difference,
        })
    return rows


def fork_points(model, contexts: list[int], repeats: int = 50) -> list[dict]:
    """At each context: a fork's median time, the first step after it, and the step after that."""
    rows = []
    for context in contexts:
        s = model.session(decode="eager")
        ids = torch.randint(0, model.spec.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
        s.prefill(ids)
        forks, firsts, nexts = [], [], []
        for _ in range(repeats):
            sync(model.device)
            t = time.perf_counter()
            fork = s.fork()
            sync(model.device)
            forks.append(time.perf_counter() - t)
            t = time.perf_counter()
            fork.feed([1])
            sync(model.device)
            firsts.append(time.perf_counter() - t)
            t = time.perf_counter()
            fork.feed([2])
            sync(model.device)
            nexts.append(time.perf_counter() - t)
            del fork
        rows.append({"context": context, "fork_ms": statistics.median(forks) * 1e3,
                     "first_step_after_fork_ms": statistics.median(firsts) * 1e3,
                     "next_step_ms": statistics.median(nexts) * 1e3})
    return rows


def table(report: dict) -> str:
    lines = [f"# speculative decoding: {report['model']} on {report['device']} ({report['dtype']}, {report['mode']})",
             "", f"prompt: {report['prompt_tokens']} tokens (seed ids: English bytes for a byte-level model, else "
             f"random; the model's own continuation of them; both said twice, then the seed again); {report['new']} new tokens, greedy; up to "
             f"{report['draft_tokens']} drafted per chunk", "",
             "| variant | tokens/s | × plain | drafts kept | tokens per chunk | output = plain |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for row in report["decode"]:
        acceptance = "–" if row["acceptance"] is None else \
            f"{row['drafts_kept']}/{row['drafted']} ({row['acceptance']:.0%})"
        per_chunk = "–" if row["tokens_per_verify_chunk"] is None else f"{row['tokens_per_verify_chunk']:.2f}"
        same = "yes" if row["output_equals_plain"] else f"the first {row['first_difference_at']} tokens"
        lines.append(f"| {row['variant']} | {row['tokens_per_s']:.1f} | {row['speedup_over_plain']:.2f}× | "
                     f"{acceptance} | {per_chunk} | {same} |")
    if report["fork"]:
        lines += ["", "| context | fork ms | first step after ms | next step ms |", "| ---: | ---: | ---: | ---: |"]
        for row in report["fork"]:
            lines.append(f"| {row['context']} | {row['fork_ms']:.3f} | {row['first_step_after_fork_ms']:.3f} | "
                         f"{row['next_step_ms']:.3f} |")
        if len(report["fork"]) > 1:
            lines.append(f"\nfork time, longest over shortest context: {report['fork_ratio']:.2f}×")
    return "\n".join(lines) + "\n"
