"""Kimi-Linear beyond the shared parity tests (`test_foreign_parity.py`): a low-rank query, both
checkpoint layouts and both config spellings, configs refused, latent attention's two forms
against each other, the bytes a position keeps, and verify over every stage."""
from __future__ import annotations

import json

import pytest
import torch

import hebrus
from foreign import build, float64_everywhere, in_float64, reference_run

IDS = [5, 17, 3, 99, 42, 7, 61, 8, 23, 77, 4]


def relative(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def test_a_low_rank_query_matches_transformers_in_float64(tmp_path):
    folder, model = build("kimi_linear", tmp_path, q_lora_rank=7)
    with float64_everywhere():
        logits, states, tokens, step_logits = reference_run(in_float64(model), IDS, 4)
    for mode in ("exact", "fast"):
        session = hebrus.load(folder, mode=mode, dtype=torch.float64).session()
        assert relative(session.feed(IDS), logits[-1]) <= 1e-12, mode
        for owner, theirs in states.items():
            theirs = theirs[:, 1:] if owner.endswith("kda.conv") else theirs
            assert relative(session.image.value(owner), theirs) <= 1e-12, (mode, owner)
        for step in range(4):
            assert relative(session.logits, step_logits[step]) <= 1e-12, (mode, step)
            session.feed([tokens[step]])


def _in_memory_layout(folder) -> None:
    """Rewrite a save (the release's layout) as transformers holds the model: one conv for
    q/k/v, the forget gate's tensors under `forget_gate.`, stacked experts, `mlp.`."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for leaf in ("f_a_proj.", "f_b_proj.", "dt_bias", "A_log"):
            name = name.replace(f"self_attn.{leaf}", f"self_attn.forget_gate.{leaf}")
        out[name] = t
    for prefix in sorted({n.split("q_conv1d")[0] for n in out if "q_conv1d" in n}):
        out[prefix + "conv1d.weight"] = torch.cat([out.pop(f"{prefix}{p}_conv1d.weight") for p in "qkv"])
    for prefix in sorted({n.split("experts.")[0] for n in out if ".experts.0.w1." in n}):
        count = sum(1 for n in out if n.startswith(prefix + "experts.") and n.endswith(".w1.weight"))
        w = {k: [out.pop(f"{prefix}experts.{e}.{k}.weight") for e in range(count)] for k in ("w1", "w2", "w3")}
        out[prefix + "experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(w["w1"], w["w3"])])
        out[prefix + "experts.down_proj"] = torch.stack(w["w2"])
    save_file(out, folder / "model.safetensors")


def test_both_checkpoint_layouts_load_the_same_model(tmp_path):
    release, _ = build("kimi_linear", tmp_path / "release")
    other, _ = build("kimi_linear", tmp_path / "other")
    _in_memory_layout(other)
    names = set(json.loads((other / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (other / "model.safetensors").read_bytes()[:8], "little")]))
    assert any("forget_gate" in n for n in names) and any("gate_up_proj" in n for n in names)
    one, two = (hebrus.load(f).session() for f in (release, other))
    assert torch.equal(one.feed(IDS), two.feed(IDS))
    assert one.digest() == two.digest()


def test_the_release_config_reads_as_transformers_config(tmp_path):
    """`linear_attn_config` (1-based layer lists, heads, head dim, conv width),
    `first_k_dense_replace` and the release's key names give the same model as transformers'."""
    folder, _ = build("kimi_linear", tmp_path / "m", mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"])
    want = hebrus.load(folder).session().feed(IDS)
    config = json.loads((folder / "config.json").read_text())
    kinds = config.pop("layer_types")
    for key in ("mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        config.pop(key)
    config["linear_attn_config"] = {
        "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "linear_attention"],
        "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "full_attention"],
        "num_heads": 3, "head_dim": 8, "short_conv_kernel_size": 4}
    config["first_k_dense_replace"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    assert torch.equal(hebrus.load(folder).session().feed(IDS), want)


@pytest.mark.parametrize("changes, message", [
    ({"mla_use_nope": False}, "rotary latent attention"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func must be one of 'sigmoid'"),
    ({"layer_types": ["linear_attention"] * 2}, "layer_types has 2 entries for num_hidden_layers=5"),
    ({"num_expert_group": 4}, "6 experts in 4 groups"),
    ({"topk_group": 3}, "6 experts in 2 groups, 3 of them chosen"),
    ({"num_experts_per_token": 4}, "at most the chosen groups' experts per token"),
    ({"layer_types": None, "linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [9]}},
     "linear_attn_config.full_attn_layers must list layers 1..5"),
    ({"layer_types": None, "linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [3]}},
     "names no kind for layer 4"),
])
def test_impossible_configs_are_refused_by_name(tmp_path, changes, message):
    folder, _ = build("kimi_linear", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text()) | changes
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(hebrus.InvalidInput, match=message):
        hebrus.load(folder)


def test_latent_attention_absorbed_equals_expanded():
    """The absorbed form (W_uk folded into the query, W_uv after the sum) against the
    definition, in float64: queries at the end of the rows and at positions inside them."""
    from hebrus.ops.mla import mla_absorbed, mla_expanded
    from hebrus.ops.qsa import dense_attention, dense_attention_fast
    gen = torch.Generator().manual_seed(0)
    H, nope, rope, value, rank, S = 3, 5, 4, 7, 6, 19
    up = torch.randn(H, nope + value, rank, generator=gen, dtype=torch.float64)
    rows = torch.randn(S, rank + rope, generator=gen, dtype=torch.float64)
    for T, positions in ((1, torch.tensor([18])), (4, torch.tensor([3, 9, 17, 18])), (19, torch.arange(19))):
        q = torch.randn(T, H, nope + rope, generator=gen, dtype=torch.float64)
        want = mla_expanded(q, rows, positions, up, nope, dense_attention)
        assert want.shape == (T, H, value)
        for attend in (dense_attention, dense_attention_fast):
            got = mla_absorbed(q, rows, positions, up, nope, attend)
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (T, attend.__name__)


def test_a_latent_row_holds_far_fewer_values_than_full_rows(tmp_path):
    """What a position keeps a latent layer: kv_rank + rope values, against the heads' full K
    and V (H·(nope + rope) + H·value): 18 against 120 at this test's shapes."""
    folder, _ = build("kimi_linear", tmp_path)
    model = hebrus.load(folder)
    latent = next(spec for spec in model.session().image.specs if spec.name.endswith("mla.latent"))
    assert latent.shape == (12 + 6,)
    assert 4 * (10 + 6) + 4 * 14 == 120


def test_verify_passes_for_the_family(tmp_path):
    from hebrus import verify
    folder, _ = build("kimi_linear", tmp_path)
    results = verify.run(hebrus.load(folder))
    failed = [r for r in results if not r.passed]
    assert results and not failed, failed[:3]


@pytest.mark.parametrize("kv_cache, bound", [("int8", 3e-2), ("fp8", 1e-1)])
def test_latent_rows_in_a_quantized_cache(tmp_path, kv_cache, bound):
    """A quantized cache keeps latent rows as codes with a float32 scale a row (fewer bytes per
    token): logits near the float cache's (measured on this model: int8 1.2e-2, fp8 3.9e-2; a
    row's rounding, 0.5% and 2.1%, grows through the layers; a scale each for the latent and
    the shared key part took it only to 0.47% and 1.9%), any chunking the same bits, verify
    passes."""
    from hebrus.cli import main
    folder, _ = build("kimi_linear", tmp_path)
    model, wide = hebrus.load(folder, kv_cache=kv_cache), hebrus.load(folder)
    ids = IDS * 3
    whole, pieces = model.session(), model.session()
    got, want = whole.feed(ids), wide.session().feed(ids)
    for a in range(0, len(ids), 5):
        last = pieces.feed(ids[a:a + 5])
    assert (got - want).norm() / want.norm() < bound
    assert whole.digest() == pieces.digest() and torch.equal(got, last)
    owners = {o.name: o for o in model.owners}
    assert owners["layers.1.mla.latent"].dtype in (torch.int8, torch.float8_e4m3fn)
    assert owners["layers.1.mla.latent_scale"].shape == (1,)
    assert sum(o.nbytes for o in model.owners if o.kind != "banked") < \
        sum(o.nbytes for o in wide.owners if o.kind != "banked")
    assert main(["verify", "--model", str(folder), "--kv-cache", kv_cache]) == 0
    fast = model.with_mode("fast")               # planned steps read every lane's rows at once
    planned, eager = ([fast.session(decode=d) for _ in range(3)] for d in ("planned", "eager"))
    for i, (p, e) in enumerate(zip(planned, eager)):
        p.feed(IDS[:4 + i])
        e.feed(IDS[:4 + i])
    for t in IDS[:5]:                            # as for a float cache: the same to rounding
        for a, b in zip(hebrus.feed_many(planned, [[t]] * 3), [e.feed([t]) for e in eager]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
