"""What the device can do at all, measured in the run (copy bandwidth, matrix throughput), and
what a step must do (bytes a decode step reads, matrix flops a prefill token costs): the floor
and the roofline the measured speeds are set against."""
from __future__ import annotations

import time

import torch

from hebrus.state.owners import BANKED

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


def _active_weights(model, batch: int = 1) -> tuple[int, int, int]:
    """(bytes a step of `batch` tokens reads of the weights, elements a token multiplies in the
    body, elements of the output head): routed experts count top_k of E per token (at most all
    E for a batch), the input embedding one row a token, the head once."""
    s = model.spec
    read = body = 0
    head = s.vocab_size * s.hidden_size
    for name, p in model.named_parameters():
        share = s.moe_top_k / s.moe_experts if ".moe.experts." in name else 1.0
        if name == "embed.weight":
            read += batch * s.hidden_size * p.element_size() if not s.tie_embeddings else 0   # the head reads it
            continue
        if name.startswith(("ple.unigram.", "ple.ngram.")):                                  # one row looked up
            read += batch * p.shape[-1] * p.element_size()
            continue
        if name == "lm_head.weight":                                                          # counted as the head
            continue
        read += int(p.numel() * p.element_size() * min(1.0, share * batch))
        body += int(p.numel() * share)
    itemsize = model.dtype.itemsize
    return read + head * itemsize, body, head


def decode_bytes(model, context: int, batch: int = 1) -> int:
    """Bytes a decode step must read at `context`: the weights a token uses (top_k of the routed
    experts, one row of an untied input embedding, the output head), the banked state, and of the
    appended rows those attention reads: every K/V row of dense attention, every index key and
    top_k K/V rows of sparse attention; routes are written, not read. A batch of sessions reads
    the weights once (the experts any of its tokens chose) and each session's state."""
    s = model.spec
    weights = _active_weights(model, batch)[0]
    state = 0
    for o in model.owners:
        if o.kind == BANKED:
            state += o.nbytes
        elif o.name.endswith((".qsa.k", ".qsa.v")):
            state += o.nbytes * min(s.top_k, context)
        elif o.name != "routes":
            state += o.nbytes * context
    return weights + batch * state


def prefill_flops_per_token(model, context: int, chunk: int) -> float:
    """Matrix flops a prefill token costs: 2 per body weight it uses, the output head once per
    chunk (only the chunk's last position is published), and attention over the positions before
    it (on average half the context): q·k and the weighted sum of v, the indexer's scores."""
    s = model.spec
    _, body, head = _active_weights(model)
    flops = 2 * body + 2 * head / min(chunk, context)
    mean_position = context / 2
    for kind in s.mixers:
        if kind == "attention":
            flops += 4 * s.attn_heads * s.attn_head_dim * mean_position
        elif kind == "qsa":
            flops += 2 * s.index_heads * s.index_dim * mean_position
            flops += 4 * s.attn_heads * s.attn_head_dim * min(s.top_k, mean_position)
    return flops
