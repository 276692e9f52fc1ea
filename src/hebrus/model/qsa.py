"""Query-selected sparse attention with its indexer, over append-only K/V/index rows."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from hebrus.config import HebrusConfig
from hebrus.model.kernels import Kernels
from hebrus.ops.norm import layer_norm, rms_norm
from hebrus.ops.qsa import index_scores, select, sparse_attention
from hebrus.ops.rope import apply_rope, rope_tables
from hebrus.state.status import Status


class RotaryTables:
    """cos/sin tables for every position up to `max_context`, built once per model and per
    rotary width, and shared by every layer that rotates that width."""

    def __init__(self, c: HebrusConfig, like: torch.Tensor):
        self.theta, self.positions = c.rope_theta, c.max_context
        self.dtype, self.device = like.dtype, like.device
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        if dim not in self._tables:
            self._tables[dim] = rope_tables(dim, self.theta, self.positions, self.dtype, self.device)
        return self._tables[dim]


class SparseAttention:
    def __init__(self, c: HebrusConfig, params: dict[str, torch.Tensor], prefix: str, rotary: RotaryTables,
                 kernels: Kernels):
        w = {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}
        self.w, self.choose, self.site = w, kernels.choose, prefix.removesuffix(".")
        self.hq, self.hkv, self.dh = c.qsa_heads, c.qsa_kv_heads, c.qsa_head_dim
        self.hi, self.di, self.top_k = c.qsa_index_heads, c.qsa_index_dim, c.qsa_top_k
        self.eps = c.rms_norm_eps
        self.rope, self.index_rope = rotary(self.dh), rotary(self.di)

    def __call__(self, h: torch.Tensor, start: int, k_rows, v_rows, index_rows, check_range) -> torch.Tensor:
        """h [T, D] at positions start..start+T-1. Writes rows [start, start+T) of the three row
        logs, then attends over rows [0, position]. `check_range` takes the device-side check that
        no query picked a row past its own position."""
        T, w, end = h.shape[0], self.w, start + h.shape[0]
        q = rms_norm(F.linear(h, w["q_proj.weight"]).view(T, self.hq, self.dh), w["q_norm.weight"], self.eps)
        k = rms_norm(F.linear(h, w["k_proj.weight"]).view(T, self.hkv, self.dh), w["k_norm.weight"], self.eps)
        cos, sin = (t[start:end] for t in self.rope)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        qi = F.linear(h, w["index_q.weight"]).view(T, self.hi, self.di)
        ki = layer_norm(F.linear(h, w["index_k.weight"]), w["index_k_norm.weight"], w["index_k_norm.bias"], self.eps)
        icos, isin = (t[start:end] for t in self.index_rope)
        qi, ki = apply_rope(qi, icos, isin), apply_rope(ki, icos, isin)
        k_rows[start:end] = k
        v_rows[start:end] = F.linear(h, w["v_proj.weight"]).view(T, self.hkv, self.dh)
        index_rows[start:end] = ki

        positions = torch.arange(start, end, device=h.device)
        scores = index_scores(qi, F.linear(h, w["index_w.weight"]), index_rows[:end])
        picked, valid = self.select(scores, start, positions)
        check_range(picked - positions[:, None], 1, Status.INDEX_RANGE, lower=None)
        o = sparse_attention(q, k_rows[:end], v_rows[:end], picked, valid)
        gate = torch.sigmoid(F.linear(h, w["gate_proj.weight"]).view(T, self.hq, self.dh))
        return F.linear((o * gate).flatten(1), w["o_proj.weight"])

    def select(self, scores: torch.Tensor, start: int, positions: torch.Tensor):
        """The rows each query attends to: the top_k of its visible scores, the model's chooser
        making the choice (a set: rank order does not matter)."""
        return select(scores, positions, self.top_k, partial(self.choose, self.site, start, ordered=False))
