"""Kernels of the CPU's fast table. A decode step's hyper-connection mixes are a few n × n
matrices, and their Sinkhorn rounds are six small ops a round: in torch each op costs a few
microseconds of dispatch, 20 rounds about 0.26 ms a sublayer, a quarter of the `shakespeare`
model's decode step on two cores. The same rounds on numpy arrays cost a third of that, up to
about 64 tokens' 4 x 4 mixes (1,024 values: 350 µs against 383); from there torch's vectorised
ops win (256 tokens: 730 against 1,096 µs), so larger mixes run the twin. The twin is
`ops.hyper.sinkhorn` (the same ops in the same order; sums of more than a few terms may associate
differently)."""
from __future__ import annotations

import torch

from hebrus.ops.hyper import sinkhorn as sinkhorn_twin

NUMPY_UP_TO = 1024          # values of the mixes (T · n · n) that run on numpy arrays


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`ops.hyper.sinkhorn`, its rounds in place on a numpy view of the softmax's new tensor;
    a float32 or float64 CPU tensor outside autograd of at most NUMPY_UP_TO values, else the twin."""
    if (logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64) or logits.requires_grad
            or logits.numel() > NUMPY_UP_TO):
        return sinkhorn_twin(logits, iters, eps)
    comb = torch.softmax(logits, dim=-1)
    c = comb.numpy()
    c += eps
    c /= c.sum(-2, keepdims=True) + eps
    for _ in range(iters - 1):
        c /= c.sum(-1, keepdims=True) + eps
        c /= c.sum(-2, keepdims=True) + eps
    return comb
