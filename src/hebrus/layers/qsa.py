"""Gated attention over append-only K/V rows: over the rows an indexer selects (qsa), or over
every row (attention)."""
from __future__ import annotations

from functools import partial

import torch

from hebrus.layers.kernels import Kernels
from hebrus.layers.span import Span
from hebrus.layers.spec import ModelSpec
from hebrus.ops.norm import layer_norm
from hebrus.ops.qsa import index_scores, select, sigmoid_gated
from hebrus.ops.rope import apply_rope, normed_rotated, rope_tables
from hebrus.state.status import Status
from hebrus.ops.quant import QuantizedRows, dense, linear, quantize_rows


QUERY_BLOCK = 1024      # queries of a chunk scored and attended together (bounds a long chunk's memory)


class RotaryTables:
    """cos/sin tables for every position up to `max_context`, built once per model and per
    rotary width, and shared by every layer that rotates that width. A table of width r rotates
    the first r features of a head (partial rotary) with frequencies over those r features."""

    def __init__(self, s: ModelSpec, like: torch.Tensor):
        self.theta, self.positions = s.rope_theta, s.max_context
        self.dtype, self.device = like.dtype, like.device
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        if dim not in self._tables:
            self._tables[dim] = rope_tables(dim, self.theta, self.positions, self.dtype, self.device)
        return self._tables[dim]


class Attention:
    """Gated attention; with `indexed`, over the top_k rows the indexer scores highest."""

    def __init__(self, s: ModelSpec, params: dict[str, torch.Tensor], prefix: str, rotary: RotaryTables,
                 kernels: Kernels, indexed: bool):
        w = {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}
        self.w, self.choose, self.site, self.indexed = w, kernels.choose, prefix.removesuffix("."), indexed
        self.attend, self.sparse_attend, self.fused = kernels.attend, kernels.sparse_attend, kernels.fused
        self.index_input = kernels.index_input
        self.hq, self.hkv, self.dh = s.attn_heads, s.attn_kv_heads, s.attn_head_dim
        self.hi, self.di, self.top_k = s.index_heads, s.index_dim, s.top_k
        self.cache, self.parts = s.kv_cache, 3 if indexed else 2      # quantized rows: scales after codes
        self.eps = s.rms_norm_eps
        self.rope = rotary(s.rotary_dim)
        self.index_rope = rotary(self.di) if indexed else None

    def __call__(self, h: torch.Tensor, start, rows, check_range) -> torch.Tensor:
        """h [T, D] at positions start..start+T-1 (`start` an int, or a device tensor in a
        planned step: see `layers.span`). Writes rows [start, start+T) of the row logs (k, v
        and, indexed, index), then attends over rows [0, position]. `check_range` takes the
        device-side check that no query picked a row past its own position. For several
        sessions' tokens (`start` a list of positions), row i of h is session i's, `rows` hold
        one storage per session and `check_range` one check per session."""
        T, w = h.shape[0], self.w
        span = Span(start, T, h.device)
        cos, sin = (span.take(t) for t in self.rope)
        rotate = self.fused(normed_rotated)
        q = rotate(linear(h, w["q_proj.weight"]).view(T, self.hq, self.dh), w["q_norm.weight"], cos, sin, self.eps)
        k = rotate(linear(h, w["k_proj.weight"]).view(T, self.hkv, self.dh), w["k_norm.weight"], cos, sin, self.eps)
        self._put(span, rows, 0, k)
        self._put(span, rows, 1, linear(h, w["v_proj.weight"]).view(T, self.hkv, self.dh))
        if span.sessions:               # each session over its own rows; check_range is per session
            o = torch.cat([self._attend(h[i:i + 1], span.one(i), q[i:i + 1], [r[i] for r in rows], check_range[i])
                           for i in range(T)])
        else:
            o = self._attend(h, span, q, rows, check_range)
        gated = self.fused(sigmoid_gated)(o, linear(h, w["gate_proj.weight"]).view(T, self.hq, self.dh))
        return linear(gated.flatten(1), w["o_proj.weight"])

    def _put(self, span, rows, part: int, value: torch.Tensor) -> None:
        """Write the chunk's rows of row log `part` (0 k, 1 v, 2 index): as they are, or, with a
        quantized cache, their codes and beside them (log `part` + `parts`) their scales."""
        if self.cache is None:
            span.put(rows[part], value)
            return
        codes, scale = quantize_rows(value, self.cache)
        span.put(rows[part], codes)
        span.put(rows[part + self.parts], scale if scale.dim() > 1 else scale[:, None])

    def _view(self, rows, part: int, cut, dtype: torch.dtype):
        """Rows `cut` of row log `part`: a tensor, or with a quantized cache `QuantizedRows`."""
        if self.cache is None:
            return cut(rows[part])
        return QuantizedRows.of(cut(rows[part]), cut(rows[part + self.parts]), dtype)

    def _attend(self, h, span, q, rows, check_range):
        if self.indexed:
            return self._sparse(h, span, q, rows, check_range)
        k, v = (dense(self._view(rows, part, span.visible, q.dtype)) for part in (0, 1))
        return self.attend(q, k, v, span.positions)

    def _sparse(self, h, span, q, rows, check_range):
        T, w, positions, hi = h.shape[0], self.w, span.positions, self.index_input(h)
        qi = linear(hi, w["index_q.weight"]).view(T, self.hi, self.di)
        ki = layer_norm(linear(hi, w["index_k.weight"]), w["index_k_norm.weight"], w["index_k_norm.bias"], self.eps)
        icos, isin = (span.take(t) for t in self.index_rope)
        rotate = self.fused(apply_rope)
        qi, ki = rotate(qi, icos, isin), rotate(ki, icos, isin)
        self._put(span, rows, 2, ki)
        iw = linear(hi, w["index_w.weight"])
        if isinstance(span.start, int) and T > QUERY_BLOCK:
            # a long chunk, a block of queries at a time over the rows it sees: the scores and
            # their sort take O(block × context) memory, never O(chunk × context)
            blocks = []
            for a in range(0, T, QUERY_BLOCK):
                b, end = min(T, a + QUERY_BLOCK), span.start + min(T, a + QUERY_BLOCK)
                seen = [self._view(rows, part, lambda r, end=end: r[:end], q.dtype) for part in (2, 0, 1)]
                blocks.append(self._pick_and_attend(qi[a:b], iw[a:b], q[a:b], seen, span.start + a,
                                                    positions[a:b], check_range))
            return torch.cat(blocks)
        seen = [self._view(rows, part, span.visible, q.dtype) for part in (2, 0, 1)]
        return self._pick_and_attend(qi, iw, q, seen, span.start, positions, check_range)

    def _pick_and_attend(self, qi, iw, q, rows, start, positions, check_range):
        """Queries at `positions` (the first at `start`) over the visible (index, k, v) rows
        (k and v: tensors, or `QuantizedRows` whose picked rows alone are rebuilt)."""
        index_rows, k_rows, v_rows = rows
        picked, valid = self.select(index_scores(qi, iw, dense(index_rows)), start, positions)
        check_range(picked - positions[:, None], 1, Status.INDEX_RANGE, lower=None)
        return self.sparse_attend(q, k_rows, v_rows, picked, valid)

    def select(self, scores: torch.Tensor, start, positions: torch.Tensor):
        """The rows each query attends to: the top_k of its visible scores, the model's chooser
        making the choice (a set: rank order does not matter)."""
        return select(scores, positions, self.top_k, partial(self.choose, self.site, start, ordered=False))
