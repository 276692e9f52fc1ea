"""Choosing the next token from logits. Pure: randomness comes from the generator passed in."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from hebrus.uploads import upload


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1 and min_p 0 keep every token; a repetition
    penalty of 1 changes nothing (above 1, the logits of ids already seen are divided by it when
    positive and multiplied when negative); presence and frequency penalties of 0 change nothing
    (otherwise each id's logit goes down by the presence penalty once it has been generated, and
    by the frequency penalty times the number of times it has been)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def counts_output(self) -> bool:
        """Whether choosing needs the count of each id generated so far (`counted`)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def penalise(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """The logits of the ids marked in `seen` (a [V] bool mask, kept up to date by the caller,
    so a step costs O(V) however long the history) divided by `penalty` where positive,
    multiplied where negative; in float64, so no penalty in range overflows."""
    if penalty == 1.0 or seen is None:
        return logits
    x = logits.double()
    return torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)


def counted(logits: torch.Tensor, counts: torch.Tensor | None, how: Sampling) -> torch.Tensor:
    """`logits` less `how`'s presence penalty where an id's count in `counts` ([V], the ids
    generated so far, kept up to date by the caller) is above 0, and less its frequency penalty
    times the count; in float64."""
    if counts is None or not how.counts_output:
        return logits
    return logits.double() - how.frequency_penalty * counts - how.presence_penalty * (counts > 0)


def constrained(logits: torch.Tensor, masks: list[torch.Tensor]) -> torch.Tensor:
    """`logits` [B, V] (or [V] with one mask) with every token its row's mask does not allow at
    -inf: `masks[b]` the bits of a constraint (`state.constraint.Constraint.mask`), all of them
    moved to the logits' device in one copy and applied there in one call (`masked`; on CUDA
    one kernel, `ops.cuda.masks`)."""
    one = logits.dim() == 1
    rows = logits[None] if one else logits
    words = max(m.numel() for m in masks)
    # one copy on the host, into page-locked memory where the logits are on a GPU: the copy to
    # the device then needs no staging copy of its own (the host allocator keeps the block until
    # that copy is done)
    whole = all(m.numel() == words for m in masks)
    packed = (torch.empty if whole else torch.zeros)((len(masks), words), dtype=torch.int32, pin_memory=rows.is_cuda)
    if whole:
        torch.stack(masks, out=packed)
    else:
        for b, m in enumerate(masks):
            packed[b, :m.numel()] = m
    out = _applied(rows.device.type)(rows, packed.to(rows.device, non_blocking=True))
    return out[0] if one else out


def masked(rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """`rows` [B, V] with every token whose bit in `words` [B, W] (int32, on the rows' device:
    token i is bit i % 32 of word i // 32; tokens past 32·W not allowed) is clear at -inf, as a
    new tensor. The readable twin of `ops.cuda.masks.masked`."""
    allowed = (words[:, :, None] & _bits(rows.device)).reshape(len(words), -1) != 0
    V = rows.shape[-1]
    if allowed.shape[1] < V:                    # tokens past the mask's words: not allowed
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]))
    return torch.where(allowed[:, :V], rows, float("-inf"))     # (three kernels on a device: and, !=, where)


@functools.lru_cache(maxsize=None)
def _applied(device_type: str):
    """What applies masks on a device of this type: one Triton kernel on CUDA where Triton is
    there, else `masked`."""
    if device_type == "cuda":
        try:
            from hebrus.ops.cuda import masks as cuda_masks          # Triton
            return cuda_masks.masked
        except ImportError:
            pass
    return masked


@functools.lru_cache(maxsize=None)
def _bits(device: torch.device) -> torch.Tensor:
    """[32] int32: bit j of a mask word set alone (bit 31 is the sign bit), on `device`."""
    return torch.tensor([1 << j if j < 31 else -(1 << 31) for j in range(32)], dtype=torch.int32, device=device)


def sample(logits: torch.Tensor, how: Sampling, generator: torch.Generator) -> int:
    """Greedy at temperature 0 (ties to the smaller id); otherwise a draw from `distribution`."""
    if how.temperature == 0:
        return int(torch.argmax(logits))
    return draw(distribution(logits, how), generator)


def sample_many(logits: list[torch.Tensor], hows: list[Sampling],
                generators: list[torch.Generator | None]) -> list:
    """`sample` for each of several logits [V], in order: an id, or the exception its sampling
    raised (the others are sampled all the same). Those of one shape, dtype and device are
    chosen together: the greedy ones by one argmax over their stack, the others by one
    `distributions` and one `draws` over theirs, each from its own generator; so a step of many
    requests waits for the device once per group instead of once each, and every choice is the
    one `sample` makes alone (each row is computed as it is alone). Any whose group fails is
    `sample`d alone. A greedy choice draws nothing from its generator (it may be None)."""
    out: list = [None] * len(logits)
    groups: dict[tuple, list[int]] = {}
    for i, (x, how) in enumerate(zip(logits, hows)):
        if isinstance(x, torch.Tensor) and x.dim() == 1:
            groups.setdefault((x.shape, x.dtype, x.device, how.temperature == 0), []).append(i)
    for (*_, greedy), members in groups.items():
        if len(members) < 2:
            continue
        try:
            stacked = torch.stack([logits[i] for i in members])
            chosen = (torch.argmax(stacked, dim=-1).tolist() if greedy else
                      draws(distributions(stacked, [hows[i] for i in members]), [generators[i] for i in members]))
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
    """One id with probability weights[i] / Σ weights (float64, not negative, any device): `draws`
    of one row."""
    return draws(weights[None], [generator])[0]


def draws(weights: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
    """An id per row of weights [B, V] (float64, not negative, any device) with probability
    weights[b, i] / Σ weights[b], by the inverse of the row's cumulative sum at one float64
    uniform from its own generator (a CPU generator); the rows' ids come to the host in one
    transfer. (torch.multinomial, drawn first after seeding, favoured some ids: 0.5901 of
    200,000 freshly seeded draws where the probability is 0.5864, 3.4 standard deviations.)"""
    weights = weights.detach().to(torch.float64)
    cdf = weights.cumsum(-1)
    u = upload([torch.rand((), dtype=torch.float64, generator=g).item() for g in generators], torch.float64,
               cdf.device)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]    # the first id past u
    last = torch.where(weights != 0, torch.arange(weights.shape[1], device=weights.device), -1).amax(-1)
    return torch.where(picked < weights.shape[1], picked, last).tolist()      # u rounded up to the total


def distribution(logits: torch.Tensor, how: Sampling) -> torch.Tensor:
    """What `sample` draws from at a temperature above 0, as weights [V] in float64 (not
    normalised): `distributions` of one row."""
    return distributions(logits[None], [how])[0]


def distributions(logits: torch.Tensor, hows: list[Sampling]) -> torch.Tensor:
    """Weights [B, V] in float64 (not normalised), row b what `hows[b]` draws from: the softmax
    at its temperature (above 0), restricted to its top_k ids, then to the smallest set holding
    its top_p of the mass, then to ids with at least min_p times the largest probability. Every
    operation works row by row, so a row's weights are what it gets alone."""
    B, V = logits.shape
    device = logits.device
    temperature = _column([h.temperature for h in hows], device)
    scaled = logits.double()
    scaled = (scaled - scaled.amax(-1, keepdim=True)) / temperature     # <= 0, so no temperature overflows it
    probs = torch.softmax(scaled, dim=-1)
    if all((h.top_k or V) >= V and h.top_p >= 1.0 for h in hows):      # no row needs the ids in order
        # what `by_order` gives these rows without sorting them (a sort of the vocabulary for each
        # row was most of a sampled step's host time): min_p against each row's largest
        min_p = _column([h.min_p for h in hows], device)
        return torch.where((min_p <= 0.0) | (probs >= min_p * probs.amax(-1, keepdim=True)), probs, 0.0)
    return by_order(probs, hows)


def _column(values: list[float], device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """[B, 1] on `device`: a value per row (queued without a wait for the device: `upload`)."""
    return upload(values, dtype, device)[:, None]


def by_order(probs: torch.Tensor, hows: list[Sampling]) -> torch.Tensor:
    """`distributions`' filters on probabilities [B, V] (float64), each row's ids sorted by
    probability: its top_k, then its top_p of the mass, then its min_p of the largest."""
    B, V = probs.shape
    device = probs.device
    top_p, min_p = _column([h.top_p for h in hows], device), _column([h.min_p for h in hows], device)
    top_k = _column([h.top_k or V for h in hows], device, torch.int64)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep = torch.arange(V, device=device)[None, :] < top_k
    before = sorted_p.cumsum(-1) - sorted_p                             # mass strictly before each token
    keep &= (before < top_p) | (top_p >= 1.0)
    keep &= (min_p <= 0.0) | (sorted_p >= min_p * sorted_p[:, :1])
    sorted_p = torch.where(keep, sorted_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)
