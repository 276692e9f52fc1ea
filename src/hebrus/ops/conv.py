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


def causal_conv_ragged(x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor,
                       windows: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv` of N sequences in one call: x [T, C] their rows one after another, states
    [N, K-1, C]. Each sequence's rows are laid out after its state's, all of them end to end, and
    one conv runs over the lot: a window never reaches back past its own sequence's state, so
    each output is the one its sequence gives alone (computed the same way). `windows`:
    (gather [N·(K-1) + T]: each laid-out row's place in cat(states' rows, x); out [T]: the output
    of each of x's rows; last [N·(K-1)]: each sequence's last K-1 laid-out rows, its new state),
    as `StepBatch.windows` makes them. Returns (y [T, C], the new states [N, K-1, C])."""
    gather, out, last = windows
    n, k1, c = states.shape
    k = weight.shape[1]
    laid = torch.cat([states.reshape(n * k1, c).to(x.dtype), x])[gather]
    y = (laid.unfold(-2, k, 1) * weight.to(x.dtype)).sum(-1)
    return y[out], laid[last].reshape(n, k1, c)

