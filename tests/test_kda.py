"""Kimi delta attention's rule (`ops.kda`): its chunked form against its definition, and the
definition against transformers' own (`recurrent_kimi_delta_attention`), in float64."""
from __future__ import annotations

import pytest
import torch

from hebrus.ops.kda import kda_chunked, kda_recurrent

transformers = pytest.importorskip("transformers")


def _inputs(T: int, H: int, dk: int, dv: int, seed: int, strong: bool = False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)       # noqa: E731
    q, k = r(T, H, dk), r(T, H, dk)
    q, k = q / q.norm(dim=-1, keepdim=True) * dk ** -0.5, k / k.norm(dim=-1, keepdim=True)
    g = -torch.nn.functional.softplus(r(T, H, dk)) * (8.0 if strong else 1.0)   # per channel, ≤ 0
    beta = torch.sigmoid(r(T, H))
    return q, k, r(T, H, dv), g, beta, r(H, dk, dv)


@pytest.mark.parametrize("T, chunk", [(1, 64), (37, 16), (64, 64), (130, 32)])
@pytest.mark.parametrize("strong", [False, True])
def test_the_chunked_rule_is_the_definition(T, chunk, strong):
    q, k, v, g, beta, state = _inputs(T, 3, 8, 5, seed=T, strong=strong)
    before = state.clone()
    o1, s1 = kda_recurrent(q, k, v, g, beta, state)
    o2, s2 = kda_chunked(q, k, v, g, beta, state, chunk)
    assert torch.equal(state, before)                               # inputs untouched
    assert (o1 - o2).abs().max() <= 1e-12 * max(1.0, o1.abs().max())
    assert (s1 - s2).abs().max() <= 1e-12 * max(1.0, s1.abs().max())


def test_the_definition_is_transformers_kda():
    from foreign import float64_everywhere
    from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention
    q, k, v, g, beta, state = _inputs(23, 2, 6, 4, seed=5)
    ours, final = kda_recurrent(q, k, v, g, beta, state)
    # theirs scales q and takes batches first: q unscaled here, [B, T, H, d]
    with float64_everywhere():
        theirs, their_final = recurrent_kimi_delta_attention(
            (q * 6 ** 0.5)[None], k[None], v[None], g[None], beta[None], state[None], True)
    assert (ours - theirs[0]).abs().max() <= 1e-12 and (final - their_final[0]).abs().max() <= 1e-12


def test_a_per_channel_decay_equal_across_channels_is_the_gated_delta_rule():
    from hebrus.ops.gdn import gdn_recurrent
    q, k, v, g, beta, state = _inputs(19, 2, 6, 4, seed=9)
    per_head = g[..., 0]
    a = kda_recurrent(q, k, v, per_head[..., None].expand_as(g), beta, state)
    b = gdn_recurrent(q, k, v, per_head, beta, state)
    assert all((x - y).abs().max() <= 1e-12 for x, y in zip(a, b))
