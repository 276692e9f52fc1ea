"""Attention over append-only rows: the indexer's scores, deterministic top-k, attention over the
pick (query-selected sparse attention), and attention over every visible row (dense).

Keys and values come from the layer's append-only rows: row s holds position s. A query at
position p sees rows [0, p]. Shapes: qi [T, Hi, di], iw [T, Hi], ki [S, di], q [T, Hq, dh],
k_rows, v_rows [S, Hkv, dh].
"""
from __future__ import annotations

import torch
from torch.nn.attention.bias import causal_lower_right

from hebrus.ops.choose import top_k as best_k


def index_scores(qi: torch.Tensor, iw: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
    """score(t, s) = Σ_h iw[t,h] · Hi^-½ · di^-½ · ReLU(qi[t,h] · ki[s])  -> [T, S]."""
    hi, di = qi.shape[1], qi.shape[2]
    dots = torch.relu(torch.einsum("thd,sd->ths", qi, ki))
    return torch.einsum("ths,th->ts", dots, iw * (hi ** -0.5 * di ** -0.5))


def visible(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """scores with -inf past each query's own position: the candidates of its selection."""
    seen = torch.arange(scores.shape[1], device=scores.device)[None, :] <= positions[:, None]
    return scores.masked_fill(~seen, float("-inf"))


def picked_rows(chosen: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """chosen [T, K] (a top-K of `visible` scores) -> (rows [T, K] ascending, valid [T, K]).

    A query at position p has min(K, p+1) real choices; the other entries point at row 0 and
    must be masked."""
    K = chosen.shape[1]
    valid = torch.arange(K, device=chosen.device)[None, :] <= positions[:, None]
    picked = torch.where(valid, chosen, torch.iinfo(chosen.dtype).max)     # invalid sort last
    picked = torch.sort(picked, dim=-1).values
    return torch.where(valid, picked, 0), valid


def select(scores: torch.Tensor, positions: torch.Tensor, top_k: int,
           choose=best_k) -> tuple[torch.Tensor, torch.Tensor]:
    """For each query row t (at absolute position positions[t]) pick the rows it attends to.

    If positions[t] + 1 <= top_k every row s <= positions[t] is picked; otherwise the top_k
    highest scores among them, ties going to the smaller s (`choose(scores, k)` makes the choice).
    Returns (rows [T, K] ascending, valid [T, K]) with K = min(top_k, S); invalid entries point at
    row 0 and must be masked.
    """
    K = min(top_k, scores.shape[1])
    return picked_rows(choose(visible(scores, positions), K), positions)


def sparse_attention(q, k_rows, v_rows, picked, valid) -> torch.Tensor:
    """Softmax over the picked rows of q·k/√dh, per query head (GQA: head h reads kv head h // group)."""
    T, hq, dh = q.shape
    group = hq // k_rows.shape[1]
    k = k_rows[picked].repeat_interleave(group, dim=2)       # [T, K, Hq, dh]
    v = v_rows[picked].repeat_interleave(group, dim=2)
    logits = torch.einsum("thd,tkhd->thk", q, k) * dh ** -0.5
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    weights = torch.softmax(logits.to(torch.float64 if q.dtype == torch.float64 else torch.float32), -1)
    return torch.einsum("thk,tkhd->thd", weights.to(q.dtype), v)


def dense_attention(q, k_rows, v_rows, positions) -> torch.Tensor:
    """Softmax over every row s <= position of q·k/√dh, per query head (GQA as above).
    q [T, Hq, dh]; k_rows, v_rows [S, Hkv, dh]; positions [T]."""
    group = q.shape[1] // k_rows.shape[1]
    k = k_rows.repeat_interleave(group, dim=1)                # [S, Hq, dh]
    v = v_rows.repeat_interleave(group, dim=1)
    logits = torch.einsum("thd,shd->ths", q, k) * q.shape[-1] ** -0.5
    future = torch.arange(k.shape[0], device=q.device)[None, :] > positions[:, None]
    logits = logits.masked_fill(future[:, None, :], float("-inf"))
    weights = torch.softmax(logits.to(torch.float64 if q.dtype == torch.float64 else torch.float32), -1)
    return torch.einsum("ths,shd->thd", weights.to(q.dtype), v)


def dense_attention_sdpa(q, k_rows, v_rows, positions) -> torch.Tensor:
    """`dense_attention` through torch's fused scaled-dot-product attention (flash or
    memory-efficient kernels on a GPU): no [T, H, S] logits tensor is materialised."""
    visible = torch.arange(k_rows.shape[0], device=q.device)[None, :] <= positions[:, None]     # [T, S]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k_rows.transpose(0, 1), v_rows.transpose(0, 1), attn_mask=visible,
        enable_gqa=q.shape[1] != k_rows.shape[1])
    return o.transpose(0, 1)


def dense_attention_rows(q, k_rows, v_rows, positions) -> torch.Tensor:
    """`dense_attention` as two batched matrix products per K/V head, reading K and V where they
    lie (no repeat per query head): for a few queries over many rows (a decode step), where a
    fused kernel runs one block per head and leaves most of a GPU idle, a matrix product spreads
    the rows over all of it."""
    T, hq, dh = q.shape
    S, hkv = k_rows.shape[0], k_rows.shape[1]
    group = hq // hkv
    qg = q.view(T, hkv, group, dh).permute(1, 0, 2, 3).reshape(hkv, T * group, dh)
    logits = torch.matmul(qg, k_rows.permute(1, 2, 0)) * dh ** -0.5                   # [Hkv, T*g, S]
    future = torch.arange(S, device=q.device)[None, :] > positions[:, None]           # [T, S]
    logits = logits.view(hkv, T, group, S).masked_fill(future[None, :, None, :], float("-inf"))
    weights = torch.softmax(logits.to(torch.float64 if q.dtype == torch.float64 else torch.float32), -1)
    o = torch.matmul(weights.to(q.dtype).view(hkv, T * group, S), v_rows.permute(1, 0, 2))   # [Hkv, T*g, dh]
    return o.view(hkv, T, group, dh).permute(1, 0, 2, 3).reshape(T, hq, dh)


def dense_attention_lanes(q, k_blocks, v_blocks, tables, positions, gate=None) -> torch.Tensor:
    """`dense_attention` of N sessions' single queries at once, each over its own rows, read
    through its row of block tables: q [N, Hq, dh]; k_blocks, v_blocks [B, R, Hkv, dh] (blocks of
    R rows); tables [N, W] (row s of session i is row s % R of block tables[i, s // R], visible
    when s <= positions[i]; positions [N]). The rows are gathered, then two batched matrix
    products per K/V head group, as `dense_attention_rows` (the readable twin of the kernels
    that read the blocks where they lie). With `gate` [N, Hq, dh]: o ⊙ σ(gate) (`sigmoid_gated`)."""
    k_rows, v_rows = k_blocks[tables].flatten(1, 2), v_blocks[tables].flatten(1, 2)     # [N, W * R, Hkv, dh]
    N, hq, dh = q.shape
    S, hkv = k_rows.shape[1], k_rows.shape[2]
    group = hq // hkv
    qg = q.view(N, hkv, group, dh)
    # a batched product per K/V head, over the rows where they lie ([N, S, dh] with a stride between
    # rows): no copy of the rows into another layout
    logits = torch.stack([torch.bmm(qg[:, h], k_rows[:, :, h].transpose(1, 2)) for h in range(hkv)], 1)
    logits = logits * dh ** -0.5                                                      # [N, Hkv, g, S]
    future = torch.arange(S, device=q.device)[None, :] > positions[:, None]           # [N, S]
    logits = logits.masked_fill(future[:, None, None, :], float("-inf"))
    weights = torch.softmax(logits.to(torch.float64 if q.dtype == torch.float64 else torch.float32), -1)
    weights = weights.to(q.dtype)
    o = torch.stack([torch.bmm(weights[:, h], v_rows[:, :, h]) for h in range(hkv)], 1)   # [N, Hkv, g, dh]
    o = o.reshape(N, hq, dh)
    return o if gate is None else sigmoid_gated(o, gate)


FEW_QUERIES = 16


def dense_attention_chunk(q, k_rows, v_rows, positions) -> torch.Tensor:
    """`dense_attention` for a chunk: the T queries sit at the last T positions of the S rows
    (positions S-T .. S-1), so the mask is causal aligned to the bottom right, which the fused
    kernels take as a flag (a flash kernel on a GPU) instead of an [T, S] tensor. `positions`
    is not read: a chunk's are known."""
    T, S = q.shape[0], k_rows.shape[0]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k_rows.transpose(0, 1)[None], v_rows.transpose(0, 1)[None],
        attn_mask=causal_lower_right(T, S), enable_gqa=q.shape[1] != k_rows.shape[1])
    return o[0].transpose(0, 1)


def dense_attention_fast(q, k_rows, v_rows, positions) -> torch.Tensor:
    """Fast mode's dense attention: the matrix-product form for a few queries (any positions:
    a planned step looks at the whole storage), the chunk form for more (an eager chunk's
    queries are always the last rows it sees). A choice on shapes alone."""
    if q.shape[0] <= FEW_QUERIES:
        return dense_attention_rows(q, k_rows, v_rows, positions)
    return dense_attention_chunk(q, k_rows, v_rows, positions)


def sigmoid_gated(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Attention's output gate: o ⊙ σ(gate)."""
    return o * torch.sigmoid(gate)
