"""Multi-head latent attention (MLA) over latent rows: each position keeps one row
[c (kv_rank) ; r (rope_dim)] for all heads, c the normed latent K/V and r a key part every head
shares. Head h's key and value at row s are
    k_s,h = [W_uk,h c_s ; r_s]      v_s,h = W_uv,h c_s
with `up` = kv_b_proj viewed [H, nope + value, kv_rank] (W_uk,h its first `nope` rows, W_uv,h the
rest), and a query [q_nope ; q_rope] scores a row by q·k_s,h / sqrt(nope + rope).

Two forms of one map, q [T, H, nope + rope], rows [S, kv_rank + rope], positions [T] (each
query sees rows s ≤ its position) -> o [T, H, value]:
- `mla_expanded`, the definition: every visible row's K and V built per head, then attention.
- `mla_absorbed`: W_uk folded into the query (q_nope W_uk,h, a query over the latent rows
  themselves: one K/V head of width kv_rank + rope) and W_uv applied once to each head's
  weighted sum of latents. Nothing per row is built, which a decode step of a long context wants.
`attend(q, k_rows, v_rows, positions)` is the op table's dense attention (`ops.qsa`), which
scales scores by the query width^-½.
"""
from __future__ import annotations

import torch


def mla_expanded(q, rows, positions, up, nope: int, attend) -> torch.Tensor:
    """The definition: K [S, H, nope + rope] and V [S, H, value] from every visible row."""
    kv_rank = up.shape[-1]
    c, r = rows[:, :kv_rank], rows[:, kv_rank:]
    kv = torch.einsum("sc,hdc->shd", c, up.to(c.dtype))                       # [S, H, nope + value]
    k = torch.cat([kv[..., :nope], r[:, None, :].expand(-1, kv.shape[1], -1)], dim=-1)
    return attend(q, k, kv[..., nope:], positions)


def mla_absorbed(q, rows, positions, up, nope: int, attend) -> torch.Tensor:
    """The same, W_uk folded into the query and W_uv applied after the weighted sum: one head of
    K/V, the rows as they lie (keys and values both; the values' last `rope` columns dropped)."""
    wide = absorbed_query(q, up, nope)
    return absorbed_output(attend(wide, rows[:, None, :], rows[:, None, :], positions), up, nope)


def absorbed_query(q, up, nope: int) -> torch.Tensor:
    """[q_nope W_uk,h ; q_rope] per head [T, H, kv_rank + rope], scaled so that a dense
    attention's width^-½ gives the expanded key's (nope + rope)^-½."""
    kv_rank, rope = up.shape[-1], q.shape[-1] - nope
    latent_q = torch.einsum("thd,hdc->thc", q[..., :nope], up[:, :nope].to(q.dtype))    # [T, H, kv_rank]
    return torch.cat([latent_q, q[..., nope:]], dim=-1) * ((kv_rank + rope) / (nope + rope)) ** 0.5


def absorbed_output(o, up, nope: int) -> torch.Tensor:
    """Each head's weighted sum of rows [T, H, kv_rank + rope] (its last `rope` columns are the
    shared key part, dropped) through W_uv,h -> [T, H, value]."""
    return torch.einsum("thc,hdc->thd", o[..., :up.shape[-1]], up[:, nope:].to(o.dtype))
