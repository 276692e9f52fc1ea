"""The op table a model is built with: chosen once, when the model is built, and handed to every
layer (DESIGN §9). A mode is a table; so is the chooser, the one op that makes discrete choices.
Each layer kind's own ops (the delta rule, the expert runners, attention) are the kind's
declaration (`Kind.ops`, in its file), gathered here into `Kernels.ops` by name.

A chooser is called as `choose(site, start, scores, k, ordered)`: `site` names the stage that
chooses, rows of `scores` [T, N] are the positions start..start+T-1, entries of -inf may not be
chosen, and it returns indices [T, k], best first. `ordered` says whether the rank order of the
choice matters downstream (experts: yes, their order is stored; attended rows: no, a set).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from hebrus.layers.kind import kind_ops
from hebrus.ops.choose import top_k
from hebrus.ops.hyper import sinkhorn
from hebrus.ops.quant import linear as product, rebuilt_linear


class Chooser(Protocol):
    # `start` is a device tensor in a planned step (`state.step`), which runs only the default
    def __call__(self, site: str, start: int | torch.Tensor, scores: torch.Tensor, k: int,
                 ordered: bool = True) -> torch.Tensor: ...


def top_k_chooser(site: str, start: int, scores: torch.Tensor, k: int, ordered: bool = True) -> torch.Tensor:
    """The default chooser: the spec's top-k, ties to the smaller index. No host sync."""
    return top_k(scores, k)


def unfused(op: Callable) -> Callable:
    """The op as written (every table but CUDA's fast one)."""
    return op


def alone(x: torch.Tensor) -> torch.Tensor:
    """A model on one rank: its partial sums are whole sums, its logits every logit."""
    return x


@dataclass(frozen=True, slots=True)
class Kernels:
    whole_chunk: bool          # True: each stage runs the whole chunk at once; False: token by token
    choose: Chooser
    fused: Callable = unfused             # op -> the op as this table runs it (compiled on CUDA fast)
    planned: Callable = contextlib.nullcontext    # () -> the context a planned step's stages run in (`ops.cuda.fuse.planned`)
    quantized_linear: Callable = rebuilt_linear   # (x, Quantized w) -> x Wᵀ
    linear: Callable = product          # (x, W dense or quantized) -> x Wᵀ: every projection's product
    together: bool = False     # projections of one input laid side by side: one product (fast), else each
    sinkhorn: Callable = sinkhorn       # (logits, iters, eps) -> the hyper-connection's stream mix
    ops: dict = field(default_factory=dict, compare=False)     # the kinds' own ops, by name (`Kind.ops`)
    # tensor parallelism (`layers.shard`): this rank of how many; a split sublayer's partial
    # output [T, D] -> the sum over ranks; this rank's logits [T, V/world] -> every rank's, joined
    rank: int = 0
    world: int = 1
    reduce: Callable = alone
    gather: Callable = alone


def kernels(mode: str, chooser: Chooser | None = None, device: torch.device | None = None,
            dtype: torch.dtype | None = None, ranks=None) -> Kernels:
    """The table for `mode` ("exact" or "fast"), with `chooser` (default: `top_k_chooser`), and
    every kind's ops for that mode, device and dtype (fast mode of a 16-bit model on CUDA runs
    the delta rule through fla's kernels: `layers.gdn`). Fast mode on CUDA also compiles the
    elementwise groups the layers mark (`fused`, `hebrus.ops.cuda.fuse`), multiplies by quantized
    weights in Triton kernels for a decode step's few rows (`hebrus.ops.cuda.quant`), a batch-1
    step's row by 16-bit weights in one (`hebrus.ops.cuda.gemv`), and runs the
    hyper-connection's Sinkhorn rounds in one (`hebrus.ops.cuda.sinkhorn`); on the CPU, fast mode
    runs those rounds on numpy arrays (`hebrus.ops.cpu`); the ops as written are their twins.
    `ranks`: a tensor-parallel model's rank (`engine.ranks.Ranks`), whose collectives the
    frame adds its split sublayers' outputs and joins its logits with (over more than one rank)."""
    choose = top_k_chooser if chooser is None else chooser
    ops = kind_ops(mode, device, dtype)
    # a world of one adds up and joins nothing: its collectives stay the identities (NCCL's
    # all-reduce over one rank cost its eager steps 20%)
    parallel = {} if ranks is None or ranks.world == 1 else {"rank": ranks.rank, "world": ranks.world,
                                                            "reduce": ranks.reduce, "gather": ranks.gather}
    if mode != "fast":
        return Kernels(False, choose, ops=ops, **parallel)
    fuse, planned, quantized, mix, linear = unfused, contextlib.nullcontext, rebuilt_linear, sinkhorn, product
    if device is None or device.type == "cpu":
        from hebrus.ops import cpu
        mix = cpu.sinkhorn
    elif device.type == "cuda":
        from hebrus.ops.cuda import fuse as cuda_fuse
        if cuda_fuse.enabled():
            fuse, planned = cuda_fuse.fused, cuda_fuse.planned
        try:
            from hebrus.ops.cuda import gemv as cuda_gemv            # Triton
            from hebrus.ops.cuda import quant as cuda_quant
            from hebrus.ops.cuda import sinkhorn as cuda_sinkhorn
            quantized, mix, linear = cuda_quant.linear, cuda_sinkhorn.sinkhorn, cuda_gemv.linear
        except ImportError:
            pass
    return Kernels(True, choose, fused=fuse, planned=planned, quantized_linear=quantized, linear=linear, together=True, sinkhorn=mix,
                   ops=ops, **parallel)
