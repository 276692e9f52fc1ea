"""A Triton kernel for sparse attention's selection, measured and set aside: the rows each query
attends to, from its index scores, without sorting a whole row, equal to `ops.qsa.select` with the
default chooser (`ops.choose.top_k`: the top k of a stable sort, ties to the smaller index) bit
for bit: the same rows, ascending, and the same validity.

Each score becomes one int64 key whose high 32 bits order like the score (-0.0 as +0.0, every NaN
as one value above +inf, a row past the query's position as -inf) and whose low 32 bits order like
the row reversed, so keys are distinct and their order is the stable sort's (`ops.choose.
top_k_packed` makes the same keys). Rounds of programs then keep the top k keys of each block of
BLOCK candidates (`tl.sort` in registers), until one block is left: a row of S scores takes
ceil(log(S / k) / log(BLOCK / k)) rounds, 2 at 128K with k = 64 and BLOCK = 4096. The last round
also does `ops.qsa.picked_rows`: the first min(k, position + 1) keys valid, their rows sorted
ascending, the others row 0.

Measured on an H100 at 88910d2 (`results/cuda-h100/88910d2/qsa-layer.txt`): 147 µs a query at
every context from 1K to 128K, against 44-63 µs for the sort it was to replace (the first round's
4,096-key sorts 55 µs, the last round 89 µs), so the model keeps the sort. `benchmarks/qsa_layer.py`
times it beside the sort after checking its rows against the twin's.

    python benchmarks/diag/select_kernel.py        (checks it against the twin: CUDA, or TRITON_INTERPRET=1)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

BLOCK = 4096
LOW = 2**32 - 1
NONE = -(2**63)          # an empty candidate: below every key


@triton.jit
def _keep_top(key, out_ptr, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    """A block's BLOCK keys -> its top K, best first, at out_ptr's KP slots (NONE past K)."""
    top = tl.sort(key, descending=True)
    rank = tl.arange(0, BLOCK)
    tl.store(out_ptr + rank, tl.where(rank < K, top, -9223372036854775808), mask=rank < KP)


@triton.jit
def _keys(scores_ptr, positions_ptr, out_ptr, S, stride, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    """Round one: block b of query t's scores -> its top K keys, best first, into out[t, b·KP ...]
    (KP: K to a power of two; the slots past K hold NONE)."""
    t, b = tl.program_id(1), tl.program_id(0)
    s = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(scores_ptr + t.to(tl.int64) * stride + s, mask=s < S, other=0.0).to(tl.float32)
    position = tl.load(positions_ptr + t)
    x = tl.where(s <= position, x, float("-inf"))
    x = tl.where(x == 0.0, 0.0, x)                                    # -0.0 as +0.0
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x != x, 0x7FC00000, bits)                         # every NaN one, above +inf
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
    key = (ordered << 32) + (4294967295 - s.to(tl.int64))
    key = tl.where(s < S, key, -9223372036854775808)
    _keep_top(key, out_ptr + (t.to(tl.int64) * tl.cdiv(S, BLOCK) + b) * KP, K, KP, BLOCK)


@triton.jit
def _merge(in_ptr, out_ptr, C, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    """A later round: block b of query t's C candidates -> their top K keys, as `_keys` keeps them."""
    t, b = tl.program_id(1), tl.program_id(0)
    c = b * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(in_ptr + t.to(tl.int64) * C + c, mask=c < C, other=-9223372036854775808)
    _keep_top(key, out_ptr + (t.to(tl.int64) * tl.cdiv(C, BLOCK) + b) * KP, K, KP, BLOCK)


@triton.jit
def _picked(in_ptr, positions_ptr, rows_ptr, valid_ptr, C, K: tl.constexpr, BLOCK: tl.constexpr):
    """The last round: query t's C ≤ BLOCK candidates -> its top K keys' rows, as
    `ops.qsa.picked_rows` gives them: the first min(K, position + 1) valid, sorted ascending;
    the others row 0."""
    t = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    key = tl.load(in_ptr + t.to(tl.int64) * C + c, mask=c < C, other=-9223372036854775808)
    top = tl.sort(key, descending=True)
    position = tl.load(positions_ptr + t).to(tl.int64)
    valid = (c < K) & (c <= position)
    row = 4294967295 - (top & 4294967295)
    row = tl.sort(tl.where(valid, row, 9223372036854775807))          # valid rows first, ascending
    tl.store(rows_ptr + t.to(tl.int64) * K + c, tl.where(valid, row, 0), mask=c < K)
    tl.store(valid_ptr + t.to(tl.int64) * K + c, valid.to(tl.int8), mask=c < K)


def takes(scores: torch.Tensor, top_k: int) -> bool:
    """Whether `select` runs here: CUDA scores [T, S] in a 16- or 32-bit float, S < 2**31, and a
    top k of at most BLOCK / 4."""
    return (scores.is_cuda and scores.dim() == 2 and scores.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and 0 < top_k <= BLOCK // 4 and scores.shape[1] < 2**31 and scores.stride(1) == 1)


def select(scores: torch.Tensor, positions: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.qsa.select(scores, positions, top_k)` with the default chooser: (rows [T, K] int64
    ascending, valid [T, K] bool), K = min(top_k, S), on any device Triton runs on."""
    T, S = scores.shape
    K = min(top_k, S)
    KP = triton.next_power_of_2(K)
    rows = torch.empty((T, K), dtype=torch.int64, device=scores.device)
    valid = torch.empty((T, K), dtype=torch.int8, device=scores.device)
    if T == 0:
        return rows, valid.bool()
    positions = positions.to(device=scores.device, dtype=torch.int64).contiguous()
    n = triton.cdiv(S, BLOCK)
    keys = torch.empty((T, n * KP), dtype=torch.int64, device=scores.device)
    _keys[(n, T)](scores, positions, keys, S, scores.stride(0), K=K, KP=KP, BLOCK=BLOCK, num_warps=8)
    while keys.shape[1] > BLOCK:
        C, n = keys.shape[1], triton.cdiv(keys.shape[1], BLOCK)
        merged = torch.empty((T, n * KP), dtype=torch.int64, device=scores.device)
        _merge[(n, T)](keys, merged, C, K=K, KP=KP, BLOCK=BLOCK, num_warps=8)
        keys = merged
    _picked[(T,)](keys, positions, rows, valid, keys.shape[1], K=K, BLOCK=BLOCK, num_warps=8)
    return rows, valid.bool()


def check(device: torch.device) -> int:
    """`select` against `ops.qsa.select` with the default chooser, bit for bit (the rows, ascending,
    and their validity), in three dtypes: random scores; scores of a few values (ties everywhere,
    decided by index) with -0.0 beside +0.0, ±inf and NaN; every row visible, a few (fewer than
    k), none past the first; scores a view of a wider tensor. Returns the cases checked."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from hebrus.ops.qsa import select as twin
    cases = 0
    sizes = ((131072, 64, 2), (131072, 1024, 2), (8192, 64, 3), (5000, 16, 2), (100, 64, 2), (17, 4, 2))
    for S, k, T in (sizes if device.type == "cuda" else sizes[3:]):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            g = torch.Generator().manual_seed(S + k)
            wide = torch.randn(T, S + 3, generator=g).to(dtype).to(device)[:, :S]          # a view, rows apart
            tied = torch.randint(-2, 3, (T, S), generator=g).to(dtype)
            tied[:, ::7] = -0.0
            tied[:, 3::11], tied[:, 5::13] = float("inf"), float("-inf")
            tied[0, 2::17] = float("nan")
            for scores in (wide, tied.to(device)):
                for positions in (torch.full((T,), S - 1), torch.randint(0, S, (T,), generator=g),
                                  torch.full((T,), 2), torch.zeros(T, dtype=torch.int64)):
                    got = select(scores, positions.to(device), k)
                    want = twin(scores, positions.to(device), k)
                    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (S, k, T, dtype)
                    cases += 1
    return cases


if __name__ == "__main__":
    print(f"{check(torch.device('cuda' if torch.cuda.is_available() else 'cpu'))} cases equal to the twin")
