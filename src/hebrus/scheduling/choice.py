"""A turn's tokens: each request's next token from its logits, after its penalties, its
constraint's mask (the masks of every request of one dtype and device applied in one call:
`sampling.constrained`) and its sampling, drawn together (`sampling.sample_many`, each request
from its own generator); the log probabilities asked for, in one pass and one transfer. Requests
in, tokens (or what failed each one) out: what the scheduler does with them is its own."""
from __future__ import annotations

import torch

from hebrus.sampling import constrained, counted, penalise, sample_many
from hebrus.state.constraint import masks
from hebrus.uploads import upload


def tokens(requests: list, limits: dict) -> list:
    """Each of `requests` (a `scheduling.scheduler.Request` with its logits, sampling and
    generator) -> its token, or the exception that failed it alone (its masks could not be
    made, it has nothing left to sample from). `limits`: request id -> the constraint its token
    must keep to (none of them finished)."""
    logits = [counted(penalise(r.logits, r.seen, r.sampling.repetition_penalty), r.counts, r.sampling)
              for r in requests]
    groups: dict[tuple, list[int]] = {}            # a penalty's logits are float64: a group of their own
    for i, r in enumerate(requests):
        if r.id in limits:
            groups.setdefault((logits[i].dtype, logits[i].device), []).append(i)
    for members in groups.values():
        try:
            rows = constrained(torch.stack([logits[i] for i in members]),
                               masks([limits[requests[i].id] for i in members]))
        except Exception as exc:                # the masks failed: these requests alone fail
            for i in members:
                logits[i] = exc
            continue
        for i, row in zip(members, rows.unbind(0)):
            logits[i] = row
    failed = {i for i, x in enumerate(logits) if isinstance(x, BaseException)}
    chosen = sample_many([x if i not in failed else torch.zeros(0) for i, x in enumerate(logits)],
                         [r.sampling for r in requests], [r.generator for r in requests])
    for i in failed:
        chosen[i] = logits[i]
    return chosen


def logprobs(chosen: list[tuple]) -> dict[int, tuple[float, list[tuple[int, float]]]]:
    """Request id -> (the log probability of its chosen token, its `logprobs` likeliest tokens
    with theirs), under the model's own distribution (its logits before any penalty, mask or
    temperature), for every (request, token) of `chosen` in one pass and one transfer."""
    if not chosen:
        return {}
    rows = torch.log_softmax(torch.stack([r.logits for r, _ in chosen]).float(), dim=-1)
    ids = upload([t for _, t in chosen], torch.int64, rows.device)
    picked = rows.gather(1, ids[:, None])[:, 0]
    k = max(r.logprobs for r, _ in chosen)
    top = rows.topk(k, dim=-1) if k else None
    picked = picked.tolist()
    values, indices = (top.values.tolist(), top.indices.tolist()) if top is not None else ([[]] * len(chosen),) * 2
    return {r.id: (p, list(zip(i[:r.logprobs], v[:r.logprobs])))
            for (r, _), p, v, i in zip(chosen, picked, values, indices)}
