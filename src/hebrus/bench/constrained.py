"""`hebrus bench --constrained`: decoding under a JSON schema against the same decoding free.

At each batch size, that many sessions of one prompt step together (`Batch`, greedy: the CUDA
graphs where the model runs them), once with every session constrained by SCHEMA (the masks of
the step applied on the device in one call, each session's constraint advanced by its flip) and
once free; rounds take turns, so drift hits both alike. The values after a step's tokens and
their masks are made on a thread while the step runs (`state.constraint.ahead`). A session whose output completes the
schema starts it again, so every step is constrained. Reported: milliseconds per step, the
median over rounds, and constrained over free.
"""
from __future__ import annotations

import statistics
import time

import torch

from hebrus.batching import Batch
from hebrus.bench.limits import sync
from hebrus.sampling import constrained
from hebrus.state.constraint import ahead, masks
from hebrus.text.grammar import Grammar

# a list of records: long enough that a model writes many tokens of it, with strings, integers,
# nesting and required keys, so the mask is rarely trivial
SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "count": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "count", "tags"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}


class Vocabulary:
    """A made-up vocabulary of `size` ids for a random-weight shape that has no tokenizer of its
    own: the 256 bytes, then distinct words of letters and a leading space or not (2 to 9 bytes,
    as a byte-level BPE's mostly are), the last id the end of text. What a mask costs depends on
    the vocabulary's size and the words' bytes, not on where they came from."""

    def __init__(self, size: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        letters = b"etaoinshrdlucmfwypvbgkqjxz"
        words, seen = [bytes([i]) for i in range(256)], set()
        while len(words) < size - 1:
            n = int(torch.randint(2, 10, (), generator=gen))
            picks = torch.randint(0, len(letters), (n,), generator=gen).tolist()
            word = (b" " if n % 3 else b"") + bytes(letters[i] for i in picks)
            if word not in seen:
                seen.add(word)
                words.append(word)
        self.token_bytes = words + [b"<|end|>"]
        self.stop_ids = (size - 1,)


def workload(model) -> tuple:
    """(SCHEMA's constraint at its start over `model`'s vocabulary, the prompt every session is
    fed): the model's tokenizer, or a made-up `Vocabulary` of its size where it has only bytes
    and more ids; a line of the trained text for a byte model, else 64 random ids."""
    words = model.tokenizer if model.spec.vocab_size <= 256 or model.tokenizer.name != "bytes" \
        else Vocabulary(model.spec.vocab_size)
    start = Grammar.json(SCHEMA).start(words, model.spec.vocab_size)
    prompt = list(b"ROMEO:\n") if model.spec.vocab_size == 256 else \
        torch.randint(0, model.spec.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    return start, prompt


def points(model, batches: tuple[int, ...], steps: int, rounds: int, progress=None) -> list[dict]:
    start, prompt = workload(model)
    rows, done, total = [], 0, len(batches) * (rounds + 1) * 2
    for width in batches:
        times = {"free": [], "constrained": []}
        for r in range(rounds + 1):                     # round 0 warms up (graphs, compiled ops)
            for name in times:
                seconds = _run(model, prompt, width, steps, start if name == "constrained" else None)
                if r:
                    times[name].append(seconds)
                done += 1
                if progress is not None:
                    progress(done, total)
        free, bound = statistics.median(times["free"]), statistics.median(times["constrained"])
        rows.append({"batch": width, "steps": steps, "free_ms_per_step": free / steps * 1e3,
                     "constrained_ms_per_step": bound / steps * 1e3, "constrained_over_free": bound / free})
    return rows


def _run(model, prompt: list[int], width: int, steps: int, start) -> float:
    sessions = [model.session() for _ in range(width)]
    logits = torch.stack([s.feed(prompt) for s in sessions])
    if start is not None:
        for s in sessions:
            s.constrain(start)
    batch = Batch(sessions)
    sync(model.device)
    began = time.perf_counter()
    for _ in range(steps):
        if start is not None:
            for s in sessions:
                if s.constraint.finished:
                    s.constrain(start)
            logits = constrained(logits, masks([s.constraint for s in sessions]))
        tokens = logits.argmax(-1).tolist()
        made = ahead([(s.constraint, t) for s, t in zip(sessions, tokens)]) if start is not None else None
        results = batch.feed(tokens)
        if made is not None:
            made.join()
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        logits = torch.stack(results)
    sync(model.device)
    return time.perf_counter() - began


def table(report: dict) -> str:
    lines = [f"constrained decoding ({report['model']}, {report['device']}): a JSON schema against free, greedy",
             "", "| batch | steps | free ms/step | constrained ms/step | constrained ÷ free |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for r in report["points"]:
        lines.append(f"| {r['batch']} | {r['steps']} | {r['free_ms_per_step']:.2f} | "
                     f"{r['constrained_ms_per_step']:.2f} | {r['constrained_over_free']:.3f} |")
    return "\n".join(lines) + "\n"
