"""Choosing the next token from logits. Pure: randomness comes from the generator passed in."""
from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Greedy at temperature 0 (ties to the smaller id); otherwise nucleus sampling."""
    if temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits.double()
    scaled = (scaled - scaled.max()) / temperature          # <= 0, so no temperature overflows it
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        before = sorted_p.cumsum(0) - sorted_p                 # mass strictly before each token
        sorted_p = torch.where(before < top_p, sorted_p, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
