"""Depthwise causal convolution over time, carrying the last K-1 inputs as state."""
from __future__ import annotations

import torch


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C], state [K-1, C] (oldest first), weight [C, K] (tap j multiplies x[t-K+1+j]).

    Returns y [T, C] and the new state [K-1, C]. Inputs before the first chunk are the zeros
    a fresh state holds. Leading dims are independent sequences: x [B, T, C], state [B, K-1, C].
    """
    k = weight.shape[1]
    window = torch.cat([state.to(x.dtype), x], dim=-2)         # [..., K-1+T, C]
    taps = window.unfold(-2, k, 1)                              # [..., T, C, K]
    y = (taps * weight.to(x.dtype)).sum(-1)
    return y, window[..., window.shape[-2] - (k - 1):, :].clone()
