"""A layer kind is one file: what a kind must declare, that the registry refuses a kind that
forgets a declaration (at import, naming it), that an unknown kind fails in the spec's check,
and that a kind written in one file of its own (`tests/kinds/leaky.py`) runs through the whole
engine: layout, init, owners, stages, quantization, transactions."""
from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch

import hebrus
from hebrus.layers.kind import DECLARATIONS, KINDS
from hebrus.layers.spec import ModelSpec


def _import(tmp_path, name: str, source: str):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def test_a_kind_missing_a_declaration_fails_at_import_naming_it(tmp_path):
    with pytest.raises(TypeError, match=r"hebrus_forgetful\.Forgetful does not declare: owners, cost"):
        _import(tmp_path, "hebrus_forgetful", """
            from hebrus.layers.kind import Kind

            class Forgetful(Kind):
                name = "forgetful"
                role = "mixer"
                section = None
                quantized = ()

                def weights(self, s, prefix):
                    return {}

                def init(self, leaf, shape, gen):
                    return None

                def stage(self, s, params, layer, kernels, shared):
                    raise NotImplementedError
            """)
    assert "forgetful" not in KINDS


def test_a_branch_declares_its_layer_term_and_roles_are_checked(tmp_path):
    body = """
        from hebrus.layers.kind import Kind

        class Odd(Kind):
            name = "odd"
            role = "{role}"
            section = None
            quantized = ()
            weights = owners = init = stage = cost = lambda self, *args: None
        """
    with pytest.raises(TypeError, match="does not declare: layer_term"):
        _import(tmp_path, "hebrus_branch", body.format(role="branch"))
    with pytest.raises(TypeError, match="role 'sidecar'; roles are mixer, ffn, branch"):
        _import(tmp_path, "hebrus_role", body.format(role="sidecar"))
    with pytest.raises(TypeError, match="two layer kinds are named 'gdn'"):
        _import(tmp_path, "hebrus_twin", body.format(role="mixer").replace('"odd"', '"gdn"'))
    assert {"odd", "sidecar"}.isdisjoint(KINDS) and type(KINDS["gdn"]).__module__ == "hebrus.layers.gdn"


def test_every_registered_kind_declares_everything():
    assert {"gdn", "attention", "qsa", "moe", "mlp", "ple"} <= set(KINDS)
    for kind in KINDS.values():
        assert all(hasattr(kind, name) for name in DECLARATIONS), kind.name


def test_declared_weights_are_weights_the_kind_has():
    """A kind's `quantized`, `wide`, `integer` and `outputs` must be among its weights: a
    misspelt one would change nothing, silently."""
    from hebrus.layers.kda import KdaSection
    from hebrus.layers.layout import layout
    from hebrus.layers.mla import LatentSection
    from hebrus.layers.moe import ExpertsSection
    from hebrus.layers.v4_attention import V4AttentionSection
    spec = hebrus.load("tiny").spec
    qwen_like = ModelSpec(family="t", vocab_size=16, hidden_size=8, mixers=("attention",), ffns=("mlp",),
                          max_context=32, rms_norm_eps=1e-6, residual="plain",
                          sections=spec.sections + (_mlp(4),))
    kimi_like = [ModelSpec(family="k", vocab_size=16, hidden_size=8, mixers=("kda", "mla"), ffns=("moe", "moe"),
                           max_context=32, rms_norm_eps=1e-6, residual="plain",
                           sections=(KdaSection(2, 4, 4, 4, 4), LatentSection(2, 6, 4, 2, 4, q_rank),
                                     ExpertsSection(4, 2, 8, 8, shared_gated=False, scoring="sigmoid", groups=2)))
                 for q_rank in (0, 4)]
    v4_like = ModelSpec(family="d", vocab_size=16, hidden_size=8, mixers=("swa", "hca", "csa"),
                        ffns=("hash_moe", "moe", "moe"), max_context=32, rms_norm_eps=1e-6, residual="plain",
                        sections=(V4AttentionSection(2, 4, 2, 3, 5, 2, 2, 1e4, 1.6e5, 4, 3, 2, 4, 2),
                                  ExpertsSection(4, 2, 8, 8, shared_gated=False, scoring="sqrtsoftplus", limit=7.0)))
    leaves: dict[str, set[str]] = {}
    for s in (spec, qwen_like, *kimi_like, v4_like):
        for w in layout(s):
            if w.kind is not None:
                leaves.setdefault(w.kind.name, set()).add(w.leaf)
    for name, kind in KINDS.items():
        if name in ("leaky", "odd", "sidecar"):      # the test kinds, checked where they are defined
            continue
        assert name in leaves, f"no spec here has a {name} layer: add one"
        for declared in (kind.quantized, kind.wide, kind.integer, kind.outputs, *kind.side_by_side):
            assert set(declared) <= leaves[name], name


def _groups(model):
    """(names, weights) of each group of a model's weights its kinds lay side by side."""
    params = dict(model.named_parameters())
    for layer, kinds in model.spec.layer_kinds():
        for kind in kinds:
            for group in kind.side_by_side:
                names = [f"layers.{layer}.{kind.name}.{leaf}" for leaf in group]
                if all(n in params for n in names):
                    yield names, [params[n] for n in names]


def _products(model) -> list:
    """Every `ops.quant.Products` of a model's stages."""
    from hebrus.ops.quant import Products
    found, seen = [], set()

    def walk(x, depth=0):
        if id(x) in seen or depth > 4:
            return
        seen.add(id(x))
        if isinstance(x, Products):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y, depth + 1)
        elif hasattr(x, "__dict__") and type(x).__module__.startswith("hebrus.layers"):
            for y in vars(x).values():
                walk(y, depth + 1)
    for stage in model.stages:
        walk(stage)
    return found


def test_each_group_of_projections_lies_in_one_tensor_held_once_and_fast_mode_multiplies_it_once(fast_models):
    """Each group a kind multiplies by one input lies in one storage, in the group's order, and
    that storage holds the group and nothing else (no weight is held twice); the model in the
    other mode shares it (nothing copied); fast mode makes one product a group, exact mode one
    a weight (the twin)."""
    from hebrus.ops.quant import laid_together
    for name, model in fast_models.items():
        groups = list(_groups(model))
        assert groups, name
        for names, weights in groups:
            whole = laid_together(weights)
            assert whole is not None, (name, names)
            assert whole.untyped_storage().nbytes() == sum(w.numel() * w.element_size() for w in weights)
        exact = model.with_mode("exact")
        for other in (exact, exact.with_mode("fast")):
            shared = dict(other.named_parameters())
            assert all(shared[n].data_ptr() == w.data_ptr() for names, ws in groups for n, w in zip(names, ws))
        assert len(_products(model)) >= len(groups) and all(p.together is not None for p in _products(model))
        assert _products(exact) and all(p.together is None for p in _products(exact))


@pytest.mark.parametrize("name", ["tiny", "qwen3_5", "qwen3_5_moe", "kimi_linear"])
def test_projections_side_by_side_equal_their_twin_apart(fast_models, name, monkeypatch):
    """One product over a group's weights against one product each (the same float64 weights
    kept apart): logits and every owner's final state within 1e-12 over a prompt and steps."""
    import hebrus.runtime
    laid = fast_models[name].with_dtype(torch.float64)
    monkeypatch.setattr(hebrus.runtime, "side_by_side", lambda spec, params: None)
    apart = laid.with_dtype(torch.float64)
    assert all(w.untyped_storage().nbytes() == w.numel() * 8 for _, ws in _groups(apart) for w in ws)
    sessions = [m.session() for m in (laid, apart)]
    ids = list(range(3, 40))
    for chunk in (ids, [5], [7], ids[:3]):
        a, b = (s.feed(chunk) for s in sessions)
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), float((a - b).abs().max())
    for spec in sessions[0].image.specs:
        a, b = (s.image.value(spec.name) for s in sessions)
        if a.is_floating_point():
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), spec.name
        else:
            assert torch.equal(a, b), spec.name


@pytest.mark.parametrize("quantize", ["int8", "int4", "int4-zp", "fp8"])
def test_a_group_with_quantized_and_float_members_runs_a_product_a_run_and_holds_no_float_copy(quantize):
    """The delta rule's q/k/v and z are quantized in a quantized model, its b and a stay float:
    the group is two runs, each laid together alone in its storage (the quantized parts each in
    one tensor; no float copy of the group it was laid in before quantizing), one product a run;
    each run's product equals one product a weight (the twin) within float32's rounding, and the
    model decodes."""
    from hebrus.ops.quant import Products, Quantized
    model = hebrus.load("tiny", mode="fast", quantize=quantize)
    gdn = next(stage for stage in model.stages if hasattr(stage, "gdn")).gdn
    assert gdn.project.together is None and len(gdn.project.weights) == 4
    (quantized, q_sizes), (floats, f_sizes) = gdn.project.runs
    assert isinstance(quantized, Quantized) and type(floats) is torch.Tensor
    assert q_sizes == [w.shape[0] for w in gdn.project.weights[:2]] and f_sizes == [w.shape[0] for w in gdn.project.weights[2:]]
    parts = [quantized.qweight, quantized.scale] + ([quantized.zero] if quantized.zero is not None else [])
    for t in parts + [floats]:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    params = dict(model.named_parameters())
    for layer in {name.split(".gdn.")[0] for name in params if ".gdn.in_proj_" in name}:
        for run in ((".qweight", ".qscale", ".qzero"), (".weight",)):
            for part in run:
                leaves = [f"{layer}.gdn.in_proj_{leaf}{part}" for leaf in (("qkv", "z") if part != ".weight" else "ba")]
                ts = [params[n] for n in leaves if n in params]
                if ts:
                    assert len({t.untyped_storage().data_ptr() for t in ts}) == 1, leaves
                    assert ts[0].untyped_storage().nbytes() == sum(t.numel() * t.element_size() for t in ts), leaves
    x = torch.randn(3, model.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    laid, apart = Products(*gdn.project.weights, together=True), Products(*gdn.project.weights)
    for a, b in zip(laid(x), apart(x), strict=True):          # float32: one product's sums may run in
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)     # another order than one a weight
    s = model.session()
    assert torch.isfinite(s.feed(list(range(3, 20)))).all()


def _mlp(inner):
    from hebrus.layers.mlp import MLPSection
    return MLPSection(inner)


def test_an_unknown_kind_or_a_missing_section_fails_in_the_spec():
    spec = hebrus.load("tiny").spec
    with pytest.raises(hebrus.InvalidInput, match=r"unknown mixer 'mamba'; mixers are attention, csa, gdn, hca, kda, mla, qsa, swa"):
        spec.replace(mixers=("mamba",) * 4)
    with pytest.raises(hebrus.InvalidInput, match=r"unknown ffn 'gdn'; ffns are hash_moe, mlp, moe"):
        spec.replace(ffns=("gdn",) * 4)
    with pytest.raises(hebrus.InvalidInput, match=r"mlp layers need a MLPSection"):
        spec.replace(ffns=("mlp",) * 4)


@pytest.fixture()
def leaky():
    """The test kind registered for one test, and taken out again."""
    module = importlib.import_module("tests.kinds.leaky")
    if "leaky" not in KINDS:                # taken out by an earlier test: define it again
        module = importlib.reload(module)
    yield module
    KINDS.pop("leaky", None)


def _leaky_model(module, mode: str) -> hebrus.Model:
    from hebrus.layers.layout import init_parameters
    from hebrus.runtime import Model
    tiny = hebrus.load("tiny")
    spec = tiny.spec.replace(mixers=("leaky", "qsa", "gdn", "leaky"),
                             sections=tiny.spec.sections + (module.LeakySection(decay=0.5),))
    params = {name: t.double() if t.is_floating_point() else t for name, t in init_parameters(spec, 3).items()}
    return Model._placed(tiny.config, spec, params, tiny.device, torch.float64, mode)


def test_a_kind_in_one_file_runs_through_the_engine(leaky):
    exact = _leaky_model(leaky, "exact")
    assert "layers.0.leaky.sum" in [o.name for o in exact.owners]
    assert exact.stage_names[2] == "layers.0.leaky"
    ids = list(range(1, 30))
    whole, chunked = exact.session(), exact.session()
    logits = whole.feed(ids)
    for a in range(0, len(ids), 7):
        last = chunked.feed(ids[a:a + 7])
    assert whole.digest() == chunked.digest() and torch.equal(logits, last)      # chunking changes no bit
    fast = _leaky_model(leaky, "fast").session()
    torch.testing.assert_close(fast.feed(ids), logits, rtol=1e-9, atol=1e-9)
    quantized = exact.quantized("int8")
    assert "layers.0.leaky.out.qweight" in dict(quantized.named_parameters())
    assert torch.isfinite(quantized.session().feed(ids)).all()


def test_a_model_whose_layers_are_not_its_configs_is_not_saved(leaky, tmp_path):
    with pytest.raises(hebrus.InvalidInput, match="not the ones its config describes"):
        _leaky_model(leaky, "exact").save(tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_a_failing_chunk_leaves_the_new_kinds_state_as_it_was(leaky):
    s = _leaky_model(leaky, "exact").session()
    s.feed([1, 2, 3])
    before = s.digest()
    with pytest.raises(hebrus.InvalidInput):
        s.feed([4, 5, 10**6])                              # a token outside the vocabulary
    assert s.digest() == before


def test_a_new_kind_meets_every_shape_of_step(leaky, tmp_path):
    """The five shapes a stage must meet (`Kind.stage`): sessions stepped together (row i is
    session i's token), a prefix transaction, a chunk that keeps its state after marks (alone,
    and several sessions' together), a planned step, and a snapshot of what it keeps."""
    from hebrus.batching import Batch, feed_keeping_many, feed_many
    fast = _leaky_model(leaky, "fast")
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    alone = [fast.session() for _ in prompts]
    together = [fast.session() for _ in prompts]
    for a, b, ids in zip(alone, together, prompts):
        a.feed(ids)
        b.feed(ids)
    expected = [a.feed([9]) for a in alone]
    got = feed_many(together, [9, 9])
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)
    planned = Batch(together, decode="planned").feed([11, 12])
    for a, g, token in zip(alone, planned, [11, 12]):
        torch.testing.assert_close(g, a.feed([token]), rtol=1e-9, atol=1e-9)
    # several sessions' chunks keeping states after their marks, in one pass
    chunks, marks = [[5, 6, 7, 8], [9, 10, 11]], [[1, 3], [2]]
    kept = feed_keeping_many(together, chunks, marks)
    for a, chunk, mine, (logits, sessions) in zip(alone, chunks, marks, kept):
        want, want_kept = a.feed_keeping(chunk, mine)
        torch.testing.assert_close(logits, want, rtol=1e-9, atol=1e-9)
        for k, w in zip(sessions, want_kept):
            assert k.frontier == w.frontier
            torch.testing.assert_close(k.feed([2]), w.feed([2]), rtol=1e-9, atol=1e-9)

    exact = _leaky_model(leaky, "exact")
    s, twin = exact.session(), exact.session()
    k, _ = s.feed_prefix(list(range(1, 9)), lambda logits: 5)
    twin.feed(list(range(1, 6)))
    assert k == 5 and s.digest() == twin.digest()            # the state after token 5, bit for bit
    marked = exact.session()
    _, (at_2, at_4) = marked.feed_keeping(list(range(1, 9)), [2, 4])
    for kept, n in ((at_2, 2), (at_4, 4)):
        alone = exact.session()
        alone.feed(list(range(1, n + 1)))
        assert kept.digest() == alone.digest()

    s.save(tmp_path / "s.hs")
    restored = exact.restore(tmp_path / "s.hs")
    assert restored.digest() == s.digest() and torch.equal(restored.feed([3]), s.feed([3]))


def test_storage_dtypes_follow_each_weights_own_kind():
    from hebrus.layers.layout import float_dtype
    bf16 = torch.bfloat16
    assert float_dtype("layers.0.gdn.A_log", bf16) == torch.float32                 # gdn's `wide`
    assert float_dtype("layers.1.qsa.index_k_norm.bias", bf16) == bf16               # not another kind's
    assert float_dtype("layers.1.qsa.k_norm.weight", bf16) == torch.float32          # every norm weight
    assert float_dtype("ple.hash_constants", bf16) == torch.int64                    # ple's `integer`
    assert float_dtype("layers.0.mixer_hc.fn", bf16) == torch.float32                # the residual's


def test_two_kinds_keeping_one_owner_are_refused(tmp_path):
    module = _import(tmp_path, "hebrus_collide", """
        import torch
        from hebrus.layers.kind import Cost, Kind
        from hebrus.state.owners import APPENDED, OwnerSpec

        class Collide(Kind):
            name = "collide"
            role = "ffn"
            section = None
            quantized = ()
            weights = owners = lambda self, *args: {} if len(args) == 2 else []
            init = stage = lambda self, *args: None
            cost = lambda self, s, position: Cost()

            def model_owners(self, s, dtype, state_dtype):
                return [OwnerSpec("routes", (1,), torch.int32, APPENDED)]
        """)
    try:
        from hebrus.layers.owners import owner_specs
        spec = hebrus.load("tiny").spec
        mixed = spec.replace(ffns=("moe", "collide", "moe", "moe"))
        with pytest.raises(TypeError, match="owner 'routes' is kept by both moe and collide"):
            owner_specs(mixed, torch.float32, torch.float32)
    finally:
        KINDS.pop(module.Collide.name, None)
