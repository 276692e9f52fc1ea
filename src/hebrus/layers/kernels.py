"""The op table a model is built with: chosen once, when the model is built, and handed to every
layer (DESIGN §9). A mode is a table; so is the chooser, the one op that makes discrete choices.

A chooser is called as `choose(site, start, scores, k, ordered)`: `site` names the stage that
chooses, rows of `scores` [T, N] are the positions start..start+T-1, entries of -inf may not be
chosen, and it returns indices [T, k], best first. `ordered` says whether the rank order of the
choice matters downstream (experts: yes, their order is stored; attended rows: no, a set).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from hebrus.layers.kind import kind_ops
from hebrus.ops.choose import top_k
from hebrus.ops.gdn import gdn_chunked, gdn_recurrent, gdn_recurrent_states, gdn_states
from hebrus.ops.moe import (experts_few_first, experts_grouped, experts_grouped_mm, experts_per_token,
                            grouped_mm_supports)
from hebrus.ops.qsa import dense_attention, dense_attention_fast, sparse_attention
from hebrus.ops.quant import rebuilt_linear


class Chooser(Protocol):
    # `start` is a device tensor in a planned step (`layers.span`), which runs only the default
    def __call__(self, site: str, start: int | torch.Tensor, scores: torch.Tensor, k: int,
                 ordered: bool = True) -> torch.Tensor: ...


def top_k_chooser(site: str, start: int, scores: torch.Tensor, k: int, ordered: bool = True) -> torch.Tensor:
    """The default chooser: the spec's top-k, ties to the smaller index. No host sync."""
    return top_k(scores, k)


def delta_rule_fast(q, k, v, g, beta, state):
    """The chunked (WY) form over a chunk; the recurrence for a single token (also for several
    sessions' single tokens: q [B, 1, H, dk])."""
    rule = gdn_chunked if q.shape[-3] > 1 else gdn_recurrent
    return rule(q, k, v, g, beta, state)


def unfused(op: Callable) -> Callable:
    """The op as written (every table but CUDA's fast one)."""
    return op


@dataclass(frozen=True, slots=True)
class Kernels:
    whole_chunk: bool          # True: each stage runs the whole chunk at once; False: token by token
    delta_rule: Callable       # (q, k, v, g, beta, state) -> (o, state)
    experts: Callable          # (h, weights, experts, gate_up, down) -> y
    choose: Chooser
    attend: Callable = dense_attention    # (q, k_rows, v_rows, positions) -> o: attention over every row
    sparse_attend: Callable = sparse_attention    # (q, k_rows, v_rows, picked, valid) -> o: over picked rows
    index_input: Callable = unfused       # h -> what the indexer reads (training: cut from the trunk's gradient)
    fused: Callable = unfused             # op -> the op as this table runs it (compiled on CUDA fast)
    quantized_linear: Callable = rebuilt_linear   # (x, Quantized w) -> x Wᵀ
    # (q, k, v, g, beta, state) -> (o, the state after every token): a prefix transaction's chunk
    delta_rule_each: Callable = gdn_recurrent_states
    ops: dict = field(default_factory=dict, compare=False)     # the kinds' own ops, by name (`layers.kind.Kind.ops`)


def kernels(mode: str, chooser: Chooser | None = None, device: torch.device | None = None,
            dtype: torch.dtype | None = None) -> Kernels:
    """The table for `mode` ("exact" or "fast"), with `chooser` (default: `top_k_chooser`). Fast
    mode of a 16-bit model on a CUDA device runs the delta rule through fla's kernels when fla is
    installed (`hebrus.ops.cuda`; their TF32 dots would not meet float32's fast bound); their
    readable twins are `ops.gdn`. Fast mode on CUDA also compiles the elementwise groups the
    layers mark (`fused`, `hebrus.ops.cuda.fuse`), and multiplies by quantized weights in Triton
    kernels for a decode step's few rows (`hebrus.ops.cuda.quant`); the ops as written are their
    twins."""
    choose = top_k_chooser if chooser is None else chooser
    if mode == "fast":
        rule = delta_rule_fast
        if device is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
            from hebrus.ops.cuda import gdn as cuda_gdn
            if cuda_gdn.available():
                rule = cuda_gdn.gdn_fla
        experts = experts_grouped
        if device is not None and dtype is not None and grouped_mm_supports(device, dtype):
            experts = experts_grouped_mm                  # no host synchronisation
        experts = experts_few_first(experts)              # a decode step: none in any dtype
        fuse, quantized = unfused, rebuilt_linear
        if device is not None and device.type == "cuda":
            from hebrus.ops.cuda import fuse as cuda_fuse
            if cuda_fuse.enabled():
                fuse = cuda_fuse.fused
            try:
                from hebrus.ops.cuda import quant as cuda_quant          # Triton
                quantized = cuda_quant.linear
            except ImportError:
                pass
        return Kernels(True, rule, experts, choose, attend=dense_attention_fast, fused=fuse,
                       quantized_linear=quantized, delta_rule_each=gdn_states, ops=kind_ops(mode, device, dtype))
    return Kernels(False, gdn_recurrent, experts_per_token, choose, ops=kind_ops(mode, device, dtype))
