"""Mixture-of-experts routing and the ways to run the routed experts (per token: the readable
twin; grouped per expert; grouped in one device-side matmul per projection).

h [T, D]; gate_up [E, 2I, D] (first I rows: gate); down [E, D, I]. Routing breaks ties toward
the smaller expert id.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hebrus.ops.choose import top_k as best_k
from hebrus.ops.quant import dense, linear


def router_probs(logits: torch.Tensor) -> torch.Tensor:
    """softmax in ≥ float32: the scores experts are chosen by  -> p [T, E]."""
    return torch.softmax(logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32), -1)


def route_weights(p: torch.Tensor, experts: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """The chosen experts' probabilities, renormalised to sum to one (unless not `normalize`)
    -> [T, k]."""
    w = p.gather(-1, experts)
    return w / w.sum(-1, keepdim=True) if normalize else w


def route(logits: torch.Tensor, top_k: int, choose=best_k, normalize: bool = True,
          fused=lambda op: op) -> tuple[torch.Tensor, torch.Tensor]:
    """The router softmax's top k, renormalised  -> (weights, experts) [T, k], best first.
    `choose(p, k)` makes the choice (default: ties to the smaller id); `fused`, the op table's
    (`layers.kernels`), runs the softmax and the weights."""
    p = fused(router_probs)(logits)
    experts = choose(p, top_k)
    return fused(route_weights)(p, experts, normalize), experts


def sigmoid_scores(logits: torch.Tensor, bias: torch.Tensor | None, sqrt_softplus: bool = False):
    """σ(logits) (or, `sqrt_softplus`, √softplus(logits): DeepSeek-V4's) in ≥ float32, and the
    scores experts are chosen by: those plus a per-expert correction `bias` (None: none) ->
    (p [T, E], choice [T, E])."""
    x = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    p = F.softplus(x).sqrt() if sqrt_softplus else torch.sigmoid(x)
    return p, p if bias is None else p + bias.to(p.dtype)


def group_scores(choice: torch.Tensor, groups: int) -> torch.Tensor:
    """Each group of experts (E / groups consecutive ids) scored by the sum of its best two
    choice scores -> [T, groups]."""
    T, E = choice.shape
    return choice.view(T, groups, E // groups).topk(min(2, E // groups), dim=-1).values.sum(-1)


def outside_groups(choice: torch.Tensor, chosen: torch.Tensor, groups: int) -> torch.Tensor:
    """The choice scores with every expert outside the `chosen` groups [T, g] at -inf."""
    T, E = choice.shape
    keep = torch.zeros(T, groups, dtype=torch.bool, device=choice.device).scatter(1, chosen, True)
    return choice.masked_fill(~keep.repeat_interleave(E // groups, dim=1), float("-inf"))


def scaled_weights(p: torch.Tensor, experts: torch.Tensor, normalize: bool, scale: float) -> torch.Tensor:
    """The chosen experts' σ scores, divided by their sum (+1e-20) if `normalize`, times
    `scale` -> [T, k]."""
    w = p.gather(-1, experts)
    if normalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale


def route_sigmoid(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, groups: int, top_groups: int,
                  choose=best_k, choose_groups=best_k, normalize: bool = True, scale: float = 1.0,
                  fused=lambda op: op, sqrt_softplus: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing by sigmoid scores (DeepSeek-V3's, Kimi's; √softplus with `sqrt_softplus`,
    DeepSeek-V4's): experts chosen by the scores + bias among the `top_groups` best of `groups`
    groups (`choose_groups` makes that choice, a set), weighted by their scores
    (`scaled_weights`) -> (weights, experts) [T, k], best first."""
    p, choice = fused(sigmoid_scores)(logits, bias, sqrt_softplus)
    if groups > 1:
        choice = outside_groups(choice, choose_groups(group_scores(choice, groups), top_groups), groups)
    experts = choose(choice, top_k)
    return fused(scaled_weights)(p, experts, normalize, scale), experts


def route_given(logits: torch.Tensor, experts: torch.Tensor, normalize: bool = True, scale: float = 1.0,
                fused=lambda op: op, sqrt_softplus: bool = False) -> torch.Tensor:
    """Hash routing's weights: `experts` [T, k] given (nothing chosen), weighted by their
    scores as `route_sigmoid` weights its own -> [T, k]."""
    p, _ = fused(sigmoid_scores)(logits, None, sqrt_softplus)
    return fused(scaled_weights)(p, experts, normalize, scale)


def sigmoid_gated_add(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + σ(gate) ⊙ y: a shared expert's output, gated, added to the routed experts'."""
    return x + torch.sigmoid(gate) * y


def silu_mul(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """SwiGLU's middle: silu(gate) ⊙ up; with a `limit` (DeepSeek-V4's clipping), gate cut to at
    most it and up to [-limit, limit] first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def _expert(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    gate, up = linear(h, gate_up).chunk(2, dim=-1)
    return linear(silu_mul(gate, up, limit), down)


# Every runner below takes (h, weights, experts, gate_up, down, limit=None): `limit` is SwiGLU's
# clipping (`silu_mul`).

def experts_per_token(h, weights, experts, gate_up, down, limit=None) -> torch.Tensor:
    """Each token, each choice in rank order: the readable twin."""
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            y = _expert(h[t:t + 1], gate_up[e], down[e], limit)
            out[t:t + 1] += weights[t, j].to(h.dtype) * y
    return out


def experts_grouped(h, weights, experts, gate_up, down, limit=None) -> torch.Tensor:
    """One batched call per expert over the tokens routed to it."""
    out = torch.zeros_like(h)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token = order // experts.shape[1]
    scale = weights.flatten()[order].to(h.dtype)
    start = 0
    for e, count in enumerate(counts):
        if count:
            rows = token[start:start + count]
            y = _expert(h[rows], gate_up[e], down[e], limit) * scale[start:start + count, None]
            out.index_add_(0, rows, y)
            start += count
    return out


def experts_grouped_mm(h, weights, experts, gate_up, down, limit=None) -> torch.Tensor:
    """The same as `experts_grouped`, with no host synchronisation: the (token, choice) rows are
    sorted by expert on the device and each projection is one grouped matrix multiply over the
    experts' row ranges (`torch.nn.functional.grouped_mm`). Widths whose rows are not a multiple
    of 16 bytes, which grouped_mm refuses, go to `experts_grouped` (a choice on shapes alone)."""
    row = h.element_size()
    if (h.shape[1] * row) % 16 or (down.shape[2] * row) % 16:
        return experts_grouped(h, weights, experts, gate_up, down, limit)
    gate_up, down = dense(gate_up, h.dtype), dense(down, h.dtype)       # quantized stacks: rebuilt whole
    T, k = experts.shape
    ranked, order = torch.sort(experts.flatten(), stable=True)
    token = order // k
    # each expert's rows end where the sorted ids pass it (bincount would read its range on the host)
    ids = torch.arange(gate_up.shape[0], device=ranked.device, dtype=ranked.dtype)
    ends = torch.searchsorted(ranked, ids, right=True).to(torch.int32)
    gate, up = F.grouped_mm(h[token], gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    y = F.grouped_mm(silu_mul(gate, up, limit), down.transpose(1, 2), offs=ends)
    y = y * weights.flatten()[order].to(h.dtype)[:, None]
    # back to (token, choice) order, then summed over the choices in rank order: deterministic,
    # where an atomic index_add would not be on a GPU
    rows = torch.empty_like(y)
    rows[order] = y
    return rows.view(T, k, -1).sum(1)


def experts_gathered(h, weights, experts, gate_up, down, limit=None) -> torch.Tensor:
    """The same for a few tokens, in any dtype and with no host synchronisation: each (token,
    choice) row gathers a copy of its expert's two matrices and all rows run as one batched
    product. The copy costs a write and a second read of the chosen experts' weights, which a
    decode step reads anyway; more rows than FEW_ROWS go to a grouped runner instead."""
    T, k = experts.shape
    chosen = experts.flatten()
    x = h.repeat_interleave(k, dim=0)                                        # [T*k, D]
    gate, up = torch.bmm(dense(gate_up[chosen], h.dtype), x[:, :, None])[..., 0].chunk(2, dim=-1)
    y = torch.bmm(dense(down[chosen], h.dtype), silu_mul(gate, up, limit)[:, :, None])[..., 0]     # [T*k, D]
    y = y * weights.flatten().to(h.dtype)[:, None]
    return y.view(T, k, -1).sum(1)                                           # choices in rank order


# At most this many (token, choice) rows run row by row (each row's result its own, whatever the
# other rows of the step: a padding lane of a planned step changes no session's bits), more go to a
# grouped runner. On a GPU the rows gather copies of their experts' matrices (no host
# synchronisation); on a CPU, where the host reads the routes for free, each token runs through its
# experts in place: at the `shakespeare` model's shapes on two cores, one token's two experts took
# 83 µs that way against 265 µs gathered, eight tokens' 660 against 1,900
FEW_ROWS = 16


def experts_few_first(many, few=experts_gathered):
    """An expert runner that takes `few` (default `experts_gathered`) for at most FEW_ROWS
    (token, choice) rows and `many` for more (a choice on shapes alone)."""
    def run(h, weights, experts, gate_up, down, limit=None):
        if experts.numel() <= FEW_ROWS:
            return few(h, weights, experts, gate_up, down, limit)
        return many(h, weights, experts, gate_up, down, limit)
    run.many, run.few = many, few
    return run


def grouped_mm_supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `experts_grouped_mm` runs here: torch's grouped matmul takes float32, bfloat16 and
    float16 on the CPU, and bfloat16 on a CUDA device of compute capability 9.0 or later."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return dtype in (torch.float32, torch.bfloat16, torch.float16)
