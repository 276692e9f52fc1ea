"""Depthwise causal convolution over time, carrying the last K-1 inputs as state."""
from __future__ import annotations

import torch


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                each: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C], state [K-1, C] (oldest first), weight [C, K] (tap j multiplies x[t-K+1+j]).

    Returns y [T, C] and the new state [K-1, C]. Inputs before the first chunk are the zeros
    a fresh state holds. Leading dims are independent sequences: x [B, T, C], state [B, K-1, C].
    With `each`, the state after every token instead: [T, K-1, C] (the last is the new state).
    """
    k = weight.shape[1]
    window = torch.cat([state.to(x.dtype), x], dim=-2)         # [..., K-1+T, C]
    taps = window.unfold(-2, k, 1)                              # [..., T, C, K]
    y = (taps * weight.to(x.dtype)).sum(-1)
    if each:                    # after token t: inputs t-K+2 .. t, rows t+1 .. t+K-1 of the window
        return y, window[..., 1:, :].unfold(-2, k - 1, 1).transpose(-1, -2).contiguous()
    return y, window[..., window.shape[-2] - (k - 1):, :].clone()
