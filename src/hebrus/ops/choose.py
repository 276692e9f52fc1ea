"""Discrete choices: the top k of each row of scores, and how near that choice came to a tie.

scores [T, N]; an entry of -inf may not be chosen. Ties go to the smaller index (a stable sort),
so a choice is a deterministic function of the scores.
"""
from __future__ import annotations

import torch


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k highest scores of each row, best first, ties to the smaller index  -> [T, k]."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


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
