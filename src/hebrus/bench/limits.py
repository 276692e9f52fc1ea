"""What the device can do at all, measured in the run (copy bandwidth, matrix throughput), and
what a step must do (bytes a decode step reads, matrix flops a prefill token costs): the floor
and the roofline the measured speeds are set against."""
from __future__ import annotations

import time

import torch

from hebrus.layers.layout import layout
from hebrus.layers.owners import owner_table
from hebrus.state.owners import BANKED
from hebrus.weights.quant import is_part

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second read plus written by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / min(times)


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """Matrix-multiply flops per second in `dtype` on an n × n × n product."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    sync(device)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / min(times)


def _costs(s, position: float) -> dict[str, tuple[object, str, object]]:
    """Each weight's name -> (its kind or None, its name within the kind, the kind's `Cost` at
    `position`)."""
    costs, out = {}, {}
    for w in layout(s):
        if w.kind is not None and w.kind.name not in costs:
            costs[w.kind.name] = w.kind.cost(s, position)
        out[w.name] = (w.kind, w.leaf, costs.get(w.kind.name) if w.kind is not None else None)
    return out


def _weight(name: str, weights: dict) -> tuple[object, str, object]:
    """The layout entry of a stored tensor: a quantized weight's part counts as the weight."""
    if is_part(name):
        stem = name.rsplit(".", 1)[0]
        name = stem + ".weight" if stem + ".weight" in weights else stem
    return weights.get(name, (None, name, None))


def _active_weights(model, batch: int = 1) -> tuple[int, int, int]:
    """(bytes a step of `batch` tokens reads of the weights, elements a token multiplies in the
    body, elements of the output head): each kind's `Cost` says what share of a weight a token
    uses (routed experts: top_k of E, at most all of them for a batch) and which weights it
    reads a row of (tables); the input embedding is one row a token, the head read once."""
    s = model.spec
    weights = _costs(s, 0)
    read = body = 0
    head = s.vocab_size * s.hidden_size
    for name, p in model.named_parameters():
        kind, leaf, cost = _weight(name, weights)
        if name == "embed.weight":
            read += batch * s.hidden_size * p.element_size() if not s.tie_embeddings else 0   # the head reads it
            continue
        if cost is not None and leaf in cost.lookups:                                         # one row looked up
            read += batch * p.shape[-1] * p.element_size()
            continue
        if name == "lm_head.weight":                                                          # counted as the head
            continue
        share = cost.shares.get(leaf, 1.0) if cost is not None else 1.0
        read += int(p.numel() * p.element_size() * min(1.0, share * batch))
        body += int(p.numel() * share)
    itemsize = model.dtype.itemsize
    return read + head * itemsize, body, head


def decode_bytes(model, context: int, batch: int = 1) -> int:
    """Bytes a decode step must read at `context`: the weights a token uses (top_k of the routed
    experts, one row of an untied input embedding, the output head), the banked state, and of the
    appended rows the rows each kind's `Cost` says a token reads (dense attention every K/V row,
    sparse attention every index key and top_k K/V rows; routes are written, not read). A batch
    of sessions reads the weights once (the experts any of its tokens chose) and each session's
    state."""
    s = model.spec
    weights = _active_weights(model, batch)[0]
    state = 0
    rows = {kind.name: kind.cost(s, context).rows for kind in s.kinds()}
    for owner, kind, leaf in owner_table(s, model.dtype, model.state_dtype):
        if owner.kind == BANKED:
            state += owner.nbytes
        else:
            state += owner.nbytes * (rows[kind.name].get(leaf, context) if kind is not None else context)
    return weights + batch * state


def prefill_flops_per_token(model, context: int, chunk: int) -> float:
    """Matrix flops a prefill token costs: 2 per body weight it uses, the output head once per
    chunk (only the chunk's last position is published), and what each layer's kind adds at the
    mean position (half the context): attention's scores and sums, the indexer's scores."""
    s = model.spec
    _, body, head = _active_weights(model)
    flops = 2 * body + 2 * head / min(chunk, context)
    mean = {kind.name: kind.cost(s, context / 2).flops for kind in s.kinds()}
    for _, kinds in s.layer_kinds():
        flops += sum(mean[kind.name] for kind in kinds)
    return flops
