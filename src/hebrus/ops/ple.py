"""Per-layer embedding lookups: hashed n-gram buckets over the token history."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def ngram_buckets(ids: torch.Tensor, history: torch.Tensor, constants: torch.Tensor,
                  buckets: tuple[int, ...]) -> list[torch.Tensor]:
    """ids [T] int64, history [N-1] int64 (the ids before this chunk, oldest first, PAD-filled).

    hash_m(t) = (XOR_{j<m} id_{t-j} · c[m-2, j]) mod B_m in int64 with wrap-around, for m = 2..N.
    Returns one [T] int64 tensor per order m. Leading dims are independent sequences (ids
    [B, T], history [B, N-1] -> [B, T] per order).
    """
    seq = torch.cat([history, ids], dim=-1)                            # [..., N-1+T]
    n_hist, T = history.shape[-1], ids.shape[-1]
    out = []
    for m, size in zip(range(2, n_hist + 2), buckets):
        acc = torch.zeros(ids.shape, dtype=torch.int64, device=ids.device)
        for j in range(m):
            acc = acc ^ (seq[..., n_hist - j:n_hist - j + T] * constants[m - 2, j])
        out.append(torch.remainder(acc, size))
    return out


# the history, read where a slot lies or left by a piece before, compiles one kernel (`ops.cuda.fuse`)
ngram_buckets.fresh = (1,)


def gelu_mul(gate: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A layer's embedding term's middle: gelu_tanh(gate) ⊙ its rows of the tables."""
    return F.gelu(gate, approximate="tanh") * table

