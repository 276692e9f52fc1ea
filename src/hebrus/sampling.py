"""Choosing the next token from logits. Pure: randomness comes from the generator passed in."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1 and min_p 0 keep every token; a repetition
    penalty of 1 changes nothing (above 1, the logits of ids already seen are divided by it when
    positive and multiplied when negative)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0


def penalise(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """The logits of the ids marked in `seen` (a [V] bool mask, kept up to date by the caller,
    so a step costs O(V) however long the history) divided by `penalty` where positive,
    multiplied where negative; in float64, so no penalty in range overflows."""
    if penalty == 1.0 or seen is None:
        return logits
    x = logits.double()
    return torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)


def sample(logits: torch.Tensor, how: Sampling, generator: torch.Generator) -> int:
    """Greedy at temperature 0 (ties to the smaller id); otherwise a draw from `distribution`."""
    if how.temperature == 0:
        return int(torch.argmax(logits))
    return draw(distribution(logits, how), generator)


def sample_many(logits: list[torch.Tensor], hows: list[Sampling],
                generators: list[torch.Generator | None]) -> list:
    """`sample` for each of several logits [V], in order: an id, or the exception its sampling
    raised (the others are sampled all the same). The greedy ones are chosen together, one
    argmax over the stack of those of one shape, dtype and device (one transfer to the host
    instead of one each: on a GPU, one wait instead of many); every other one, and any whose
    stack fails, is `sample`d alone. A greedy choice draws nothing from its generator (it may
    be None)."""
    out: list = [None] * len(logits)
    groups: dict[tuple, list[int]] = {}
    for i, (x, how) in enumerate(zip(logits, hows)):
        if how.temperature == 0 and isinstance(x, torch.Tensor) and x.dim() == 1:
            groups.setdefault((x.shape, x.dtype, x.device), []).append(i)
    for members in groups.values():
        if len(members) < 2:
            continue
        try:
            chosen = torch.argmax(torch.stack([logits[i] for i in members]), dim=-1).tolist()
        except Exception:                           # each alone below: its own error, its alone
            continue
        for i, token in zip(members, chosen):
            out[i] = token
    for i, (x, how, generator) in enumerate(zip(logits, hows, generators)):
        if out[i] is None:
            try:
                out[i] = sample(x, how, generator)
            except Exception as exc:                # its own logits' failure, its alone
                out[i] = exc
    return out


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One id with probability weights[i] / Σ weights (float64, not negative, any device), by
    the inverse of the cumulative sum at one float64 uniform. (torch.multinomial, drawn first
    after seeding, favoured some ids: 0.5901 of 200,000 freshly seeded draws where the
    probability is 0.5864, 3.4 standard deviations.)"""
    cdf = weights.detach().to("cpu", torch.float64).cumsum(0)
    u = torch.rand((), dtype=torch.float64, generator=generator) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))         # the first id whose cdf passes u
    if i >= len(cdf):                                        # u rounded up to the total
        i = int(torch.nonzero(weights).max())
    return i


def distribution(logits: torch.Tensor, how: Sampling) -> torch.Tensor:
    """What `sample` draws from at a temperature above 0, as weights [V] in float64 (not
    normalised): the softmax at `temperature`, restricted to the top_k ids, then to the smallest
    set holding top_p of the mass, then to ids with at least min_p times the largest probability."""
    temperature, top_p, top_k, min_p = how.temperature, how.top_p, how.top_k, how.min_p
    scaled = logits.double()
    scaled = (scaled - scaled.max()) / temperature          # <= 0, so no temperature overflows it
    probs = torch.softmax(scaled, dim=-1)
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    if top_p < 1.0:
        before = sorted_p.cumsum(0) - sorted_p                 # mass strictly before each token
        keep &= before < top_p
    if min_p > 0.0:
        keep &= sorted_p >= min_p * sorted_p[0]
    sorted_p = torch.where(keep, sorted_p, 0.0)
    return torch.zeros_like(probs).scatter(0, order, sorted_p)
