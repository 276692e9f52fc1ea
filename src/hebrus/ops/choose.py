"""Discrete choices: the top k of each row of scores, and how near that choice came to a tie.

scores [T, N]; an entry of -inf may not be chosen. Ties go to the smaller index (a stable sort),
so a choice is a deterministic function of the scores.
"""
from __future__ import annotations

import torch


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k highest scores of each row, best first, ties to the smaller index  -> [T, k].
    On the CPU, over long rows of 32-bit or narrower scores, a selection on packed keys
    (`top_k_packed`); otherwise, and as its readable twin, a stable sort (`top_k_sorted`). Both
    return the same indices. (On an H200 the sort is the faster: 34 µs against 116 µs on a row
    of 128K, benchmarks/results/cuda-h200/qsa-layer-h200.txt.)"""
    if scores.shape[-1] >= PACK_FROM and scores.dtype in PACKABLE and scores.device.type == "cpu":
        return top_k_packed(scores, k)
    return top_k_sorted(scores, k)


def top_k_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`top_k` as the definition reads: the first k of a stable descending sort."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


PACK_FROM = 2048        # row length from which a selection beats a full sort (measured on a CPU)
PACKABLE = (torch.float32, torch.bfloat16, torch.float16)
LOW = 2**32 - 1


def top_k_packed(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`top_k` as one selection (no full sort) over distinct int64 keys: the high 32 bits order
    like the score, the low 32 bits like the index reversed, so equal scores rank the smaller
    index first and the order is total. Scores are taken as float32 (exact for every packable
    dtype); -0.0 counts as +0.0 and every NaN as the largest value, as the sort has them."""
    x = scores.float() + 0.0                                  # -0.0 + 0.0 is +0.0
    x = torch.where(torch.isnan(x), float("nan"), x)          # one NaN, positive: above +inf
    bits = x.view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()     # negative floats: lower bits flipped
    index = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    keys = ordered * 2**32 + (LOW - index)
    return torch.topk(keys, k, dim=-1).indices


def gaps(scores: torch.Tensor, k: int, ordered: bool) -> torch.Tensor:
    """How far each row's top-k choice is from a tie, in the scores' own units  -> [T] float64.

    With v₁ ≥ v₂ ≥ … ≥ v_n the row's finite scores:
      a set (ordered=False):          v_k − v_{k+1}; +inf when n ≤ k (nothing to leave out)
      a ranked list (ordered=True):   min over i ≤ min(k, n−1) of vᵢ − v_{i+1}; +inf when n ≤ 1
    0 is an exact tie, decided by index. A perturbation δ of the scores can change the choice
    only if gap ≤ 2 max |δ|: the pair that swaps is at least `gap` apart.
    """
    v = torch.sort(scores.double(), dim=-1, descending=True).values
    v = torch.cat([v, v.new_full((v.shape[0], 1), float("-inf"))], dim=-1)
    steps = (v[:, :-1] - v[:, 1:]).nan_to_num(nan=float("inf"), posinf=float("inf"))   # -inf − -inf: none
    return steps[:, :k].amin(-1) if ordered else steps[:, k - 1]
