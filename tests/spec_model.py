"""The Hebrus model written a second time, straight from DESIGN.md §3, one token at a time with
plain loops and no hebrus ops. Slow and float64; tests compare exact mode against it."""
from __future__ import annotations

import math

import torch

F64 = torch.float64


def _rms(x, w, eps):
    y = x / math.sqrt(float((x * x).mean()) + eps)
    return y * w if w is not None else y


def _sigmoid(x):
    return 1 / (1 + torch.exp(-x))


def _silu(x):
    return x * _sigmoid(x)


def _softplus(x):
    return torch.log1p(torch.exp(x))


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = torch.tensor([theta ** (-2 * i / d) for i in range(d // 2)], dtype=F64)
    ang = pos * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + rot * sin


class SpecModel:
    def __init__(self, config, params):
        self.c = config
        self.p = {k: (v.to(F64) if v.is_floating_point() else v) for k, v in params.items()}
        c = config
        self.tokens: list[int] = []
        self.e_hist: list[torch.Tensor] = []                 # PLE e vectors so far
        self.gdn_in: dict[int, list[torch.Tensor]] = {l: [] for l in range(c.num_layers)}
        self.S = {l: torch.zeros(c.gdn_value_heads, c.gdn_key_dim, c.gdn_value_dim, dtype=F64)
                  for l in range(c.num_layers)}
        self.K = {l: [] for l in range(c.num_layers)}
        self.V = {l: [] for l in range(c.num_layers)}
        self.KI = {l: [] for l in range(c.num_layers)}
        self.routes: list[list[list[int]]] = []

    # -- pieces ------------------------------------------------------------------------------
    def _ple(self, t):
        c, p = self.c, self.p
        V = c.vocab_size
        ids = self.tokens
        e = p["ple.unigram.weight"][ids[t]].clone()
        for m in range(2, c.ple_ngram + 1):
            acc = 0
            for j in range(m):
                tok = ids[t - j] if t - j >= 0 else V
                prod = (tok * int(p["ple.hash_constants"][m - 2, j])) % 2**64
                acc ^= prod
            acc = acc - 2**64 if acc >= 2**63 else acc                # back to signed int64
            e = e + p[f"ple.ngram.{m}.weight"][acc % c.ple_buckets[m - 2]]
        self.e_hist.append(e)
        K = c.ple_conv_kernel
        w = p["ple.conv.weight"]
        conv = torch.zeros_like(e)
        for j in range(K):
            s = t - K + 1 + j
            if s >= 0:
                conv = conv + w[:, j] * self.e_hist[s]
        a = e + _silu(conv)
        return a.view(c.num_layers, c.ple_dim)

    def _hc(self, X, prefix, sublayer):
        c, p = self.c, self.p
        n = c.hc_streams
        fn, base, scale = p[prefix + ".fn"], p[prefix + ".base"], p[prefix + ".scale"]
        r = _rms(X.flatten(), None, c.rms_norm_eps)
        m = fn @ r
        pre = _sigmoid(scale[0] * m[:n] + base[:n]) + c.hc_eps
        post = 2 * _sigmoid(scale[1] * m[n:2 * n] + base[n:2 * n])
        logits = (scale[2] * m[2 * n:] + base[2 * n:]).view(n, n)
        comb = torch.softmax(logits, dim=-1) + c.hc_eps
        for col in range(n):
            comb[:, col] = comb[:, col] / (comb[:, col].sum() + c.hc_eps)
        for _ in range(c.hc_sinkhorn_iters - 1):
            for row in range(n):
                comb[row] = comb[row] / (comb[row].sum() + c.hc_eps)
            for col in range(n):
                comb[:, col] = comb[:, col] / (comb[:, col].sum() + c.hc_eps)
        ct = sum(pre[i] * X[i] for i in range(n))
        y = sublayer(ct)
        return torch.stack([post[k] * y + sum(comb[j, k] * X[j] for j in range(n)) for k in range(n)])

    def _gdn(self, l, h, t):
        c, p = self.c, self.p
        pre = f"layers.{l}.gdn."
        Hk, Hv, dk, dv = c.gdn_key_heads, c.gdn_value_heads, c.gdn_key_dim, c.gdn_value_dim
        raw = p[pre + "in_proj_qkv.weight"] @ h
        self.gdn_in[l].append(raw)
        Kc = c.gdn_conv_kernel
        conv = torch.zeros_like(raw)
        for j in range(Kc):
            s = t - Kc + 1 + j
            if s >= 0:
                conv = conv + p[pre + "conv.weight"][:, j] * self.gdn_in[l][s]
        qkv = _silu(conv)
        q = qkv[: Hk * dk].view(Hk, dk)
        k = qkv[Hk * dk: 2 * Hk * dk].view(Hk, dk)
        v = qkv[2 * Hk * dk:].view(Hv, dv)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        z = (p[pre + "in_proj_z.weight"] @ h).view(Hv, dv)
        beta = _sigmoid(p[pre + "in_proj_b.weight"] @ h)
        g = -torch.exp(p[pre + "A_log"]) * _softplus(p[pre + "in_proj_a.weight"] @ h + p[pre + "dt_bias"])
        out = []
        for j in range(Hv):
            kh = j // (Hv // Hk)
            S = torch.exp(g[j]) * self.S[l][j]
            u = beta[j] * (v[j] - S.T @ k[kh])
            S = S + torch.outer(k[kh], u)
            self.S[l][j] = S
            o = S.T @ q[kh]
            o = _rms(o, p[pre + "norm.weight"], c.rms_norm_eps) * _silu(z[j])
            out.append(o)
        return p[pre + "out_proj.weight"] @ torch.cat(out)

    def _qsa(self, l, h, t):
        c, p = self.c, self.p
        pre = f"layers.{l}.qsa."
        Hq, Hkv, dh, Hi, di = c.qsa_heads, c.qsa_kv_heads, c.qsa_head_dim, c.qsa_index_heads, c.qsa_index_dim
        q = (p[pre + "q_proj.weight"] @ h).view(Hq, dh)
        k = (p[pre + "k_proj.weight"] @ h).view(Hkv, dh)
        v = (p[pre + "v_proj.weight"] @ h).view(Hkv, dh)
        gate = (p[pre + "gate_proj.weight"] @ h).view(Hq, dh)
        q = torch.stack([_rope(_rms(q[i], p[pre + "q_norm.weight"], c.rms_norm_eps), t, c.rope_theta) for i in range(Hq)])
        k = torch.stack([_rope(_rms(k[i], p[pre + "k_norm.weight"], c.rms_norm_eps), t, c.rope_theta) for i in range(Hkv)])
        qi = (p[pre + "index_q.weight"] @ h).view(Hi, di)
        ki = p[pre + "index_k.weight"] @ h
        mu, var = ki.mean(), ((ki - ki.mean()) ** 2).mean()
        ki = (ki - mu) / math.sqrt(float(var) + c.rms_norm_eps) * p[pre + "index_k_norm.weight"] + p[pre + "index_k_norm.bias"]
        qi = torch.stack([_rope(qi[i], t, c.rope_theta) for i in range(Hi)])
        ki = _rope(ki, t, c.rope_theta)
        iw = p[pre + "index_w.weight"] @ h
        self.K[l].append(k)
        self.V[l].append(v)
        self.KI[l].append(ki)
        scores = [sum(float(iw[i]) * Hi ** -0.5 * di ** -0.5 * max(float(qi[i] @ self.KI[l][s]), 0.0)
                      for i in range(Hi)) for s in range(t + 1)]
        if t + 1 <= c.qsa_top_k:
            chosen = list(range(t + 1))
        else:
            chosen = sorted(sorted(range(t + 1), key=lambda s: (-scores[s], s))[: c.qsa_top_k])
        outs = []
        for i in range(Hq):
            kv = i // (Hq // Hkv)
            logits = torch.stack([q[i] @ self.K[l][s][kv] / math.sqrt(dh) for s in chosen])
            w = torch.softmax(logits, 0)
            o = sum(w[n] * self.V[l][s][kv] for n, s in enumerate(chosen))
            outs.append(o * _sigmoid(gate[i]))
        return p[pre + "o_proj.weight"] @ torch.cat(outs)

    def _ffn(self, l, h, ple_l, routes_t):
        c, p = self.c, self.p
        pre = f"layers.{l}."
        probs = torch.softmax(p[pre + "moe.router.weight"] @ h, 0)
        order = sorted(range(c.moe_experts), key=lambda e: (-float(probs[e]), e))[: c.moe_top_k]
        routes_t.append(order)
        total = sum(float(probs[e]) for e in order)
        I = c.moe_intermediate
        y = torch.zeros_like(h)
        for e in order:
            gu = p[pre + "moe.experts.gate_up"][e]
            act = _silu(gu[:I] @ h) * (gu[I:] @ h)
            y = y + float(probs[e]) / total * (p[pre + "moe.experts.down"][e] @ act)
        shared = p[pre + "moe.shared.down_proj.weight"] @ (
            _silu(p[pre + "moe.shared.gate_proj.weight"] @ h) * (p[pre + "moe.shared.up_proj.weight"] @ h))
        y = y + _sigmoid(p[pre + "moe.shared_gate.weight"] @ h) * shared
        gl = p[pre + "ple.gate.weight"] @ h
        gelu = 0.5 * gl * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gl + 0.044715 * gl ** 3)))
        y = y + _rms(p[pre + "ple.down.weight"] @ (gelu * ple_l), p[pre + "ple.norm.weight"], c.rms_norm_eps)
        return y

    # -- one token ---------------------------------------------------------------------------
    def step(self, token: int) -> torch.Tensor:
        c, p = self.c, self.p
        t = len(self.tokens)
        self.tokens.append(token)
        ple = self._ple(t)
        X = p["embed.weight"][token].expand(c.hc_streams, -1).clone()
        routes_t: list[list[int]] = []
        for l, kind in enumerate(c.layer_types):
            mixer = (lambda h: self._gdn(l, h, t)) if kind == "gdn" else (lambda h: self._qsa(l, h, t))
            X = self._hc(X, f"layers.{l}.mixer_hc", lambda ct: mixer(_rms(ct, p[f"layers.{l}.mixer_norm.weight"], c.rms_norm_eps)))
            X = self._hc(X, f"layers.{l}.ffn_hc", lambda ct: self._ffn(
                l, _rms(ct, p[f"layers.{l}.ffn_norm.weight"], c.rms_norm_eps), ple[l], routes_t))
        self.routes.append(routes_t)
        self.residual = X
        r = _rms(X.flatten(), None, c.rms_norm_eps)
        pre = _sigmoid(p["head_hc.scale"][0] * (p["head_hc.fn"] @ r) + p["head_hc.base"]) + c.hc_eps
        hfin = sum(pre[i] * X[i] for i in range(c.hc_streams))
        w_out = p["embed.weight"] if c.tie_embeddings else p["lm_head.weight"]
        return w_out @ _rms(hfin, p["norm.weight"], c.rms_norm_eps)
