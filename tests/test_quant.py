"""Quantized weights: the formats against their definitions, quantized checkpoints that load as
they are stored, quantized models against float ones, and the transaction's guarantees with
quantized weights (bad scales refused, an overflowing product aborts the chunk)."""
from __future__ import annotations

import json

import pytest
import torch

import hebrus
from hebrus.cli import main
from hebrus.errors import InvalidInput
from hebrus.ops.quant import FP8, linear, pack_int4, quantize, unpack_int4
from hebrus.weights.quant import Quantization

TEXT = list(b"ROMEO.\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.")
FORMATS = ["int8", "int4", "int4-zp", "fp8"]


def _weight(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 3
    w[..., 1, :] = 0                                   # a row of zeros: scale 1, codes 0
    return w


@pytest.mark.parametrize("shape", [(300, 200), (3, 130, 257), (5, 7)])
def test_int8_rebuilds_each_row_within_half_a_step(shape):
    w = _weight(*shape)
    q = quantize(w, "int8")
    assert q.qweight.dtype == torch.int8 and q.scale.shape == shape[:-1] and q.shape == shape
    step = q.scale.unsqueeze(-1)
    assert bool(((q.dequantize() - w).abs() <= step / 2 + 1e-6 * step).all())
    assert torch.equal(q.scale[..., 1], torch.ones_like(q.scale[..., 1]))
    torch.testing.assert_close(q.scale, w.abs().amax(-1).where(w.abs().amax(-1) > 0, torch.tensor(127.0)) / 127)


@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("shape", [(300, 200), (2, 64, 257), (4, 3)])
def test_int4_rebuilds_each_group(shape, zero_point):
    """Codes in 0..15, two a byte; each group's error within half a step (symmetric) or one step
    (zero points: the rounded zero point can push the top code past 15 by half a step)."""
    w = _weight(*shape, seed=1)
    q = quantize(w, "int4", group=128, zero_point=zero_point)
    groups = -(-shape[-1] // 128)
    assert q.qweight.dtype == torch.uint8 and q.qweight.shape == (*shape[:-1], -(-shape[-1] // 2))
    assert q.scale.shape == (*shape[:-1], groups) and (q.zero is not None) == zero_point
    step = q.scale.repeat_interleave(128, -1)[..., :shape[-1]]
    bound = step if zero_point else step / 2
    assert bool(((q.dequantize() - w).abs() <= bound * (1 + 1e-5)).all())


def test_int4_packing_round_trips_at_odd_widths():
    g = torch.Generator().manual_seed(2)
    for n in (1, 2, 7, 128, 129):
        codes = torch.randint(0, 16, (3, n), generator=g, dtype=torch.uint8)
        packed = pack_int4(codes)
        assert packed.shape == (3, -(-n // 2)) and torch.equal(unpack_int4(packed, n), codes)
        assert torch.equal(packed[:, 0] & 0x0F, codes[:, 0])          # the even input in the low nibble


@pytest.mark.parametrize("shape", [(300, 200), (2, 129, 130)])
def test_fp8_blocks_are_the_layout_of_fp8_checkpoints(shape):
    """W = q · s[o // 128, i // 128], s = the block's amax / 448 (a checkpoint's weight_scale_inv);
    each entry within e4m3's rounding (3 mantissa bits) of W, or a subnormal step."""
    w = _weight(*shape, seed=3)
    q = quantize(w, "fp8")
    *lead, out, inputs = shape
    assert q.qweight.dtype == FP8 and q.scale.shape == (*lead, -(-out // 128), -(-inputs // 128))
    for bo in range(q.scale.shape[-2]):
        for bi in range(q.scale.shape[-1]):
            block = w[..., bo * 128:(bo + 1) * 128, bi * 128:(bi + 1) * 128]
            amax = block.abs().amax((-2, -1))
            torch.testing.assert_close(q.scale[..., bo, bi], torch.where(amax > 0, amax / 448, 1.0))
    full = q.scale.repeat_interleave(128, -1).repeat_interleave(128, -2)[..., :out, :inputs]
    assert bool(((q.dequantize() - w).abs() <= torch.maximum(w.abs() / 16, full * 2 ** -10)).all())


@pytest.mark.parametrize("format", FORMATS)
def test_an_expert_of_a_stack_is_that_expert_quantized_alone(format):
    q = Quantization.parse(format)
    w = _weight(4, 256, 160, seed=4)
    stack = quantize(w, q.format, zero_point=q.zero_point)
    for e in (0, 3):
        alone = quantize(w[e], q.format, zero_point=q.zero_point)
        assert torch.equal(stack[e].dequantize(), alone.dequantize())
    x = torch.randn(5, 160)
    torch.testing.assert_close(linear(x, stack[2]), x @ stack[2].dequantize().T)


def _laid(parts: list):
    """Quantized weights laid one after another: each part in one tensor, each weight views."""
    from dataclasses import replace
    whole = {f: torch.cat([getattr(p, f) for p in parts]) for f in ("qweight", "scale")
             if all(getattr(p, f) is not None for p in parts)}
    if all(p.zero is not None for p in parts):
        whole["zero"] = torch.cat([p.zero for p in parts])
    out, at = [], {f: 0 for f in whole}
    for p in parts:
        views = {}
        for f in whole:
            n = getattr(p, f).shape[0]
            views[f], at[f] = whole[f][at[f]:at[f] + n], at[f] + n
        out.append(replace(p, **views))
    return out


@pytest.mark.parametrize("format", FORMATS)
def test_quantized_weights_laid_together_are_one_weight_where_their_scales_line_up(format):
    """`laid_together` of quantized weights whose codes, scales and zero points each lie one after
    another: one weight, rebuilt as the members rebuilt one after another, multiplied as them
    (`Products`) — for fp8 only where every member but the last is whole blocks of rows; never
    for weights apart, of two formats or of two widths."""
    from hebrus.ops.quant import Products, laid_together
    q = Quantization.parse(format)
    block = 32
    rows = (64, 96, 21) if format == "fp8" else (64, 37, 21)
    members = _laid([quantize(_weight(n, 100, seed=n), q.format, group=block, zero_point=q.zero_point)
                     for n in rows])
    whole = laid_together(members)
    assert whole is not None and whole.shape == (sum(rows), 100)
    assert torch.equal(whole.dequantize(), torch.cat([m.dequantize() for m in members]))
    x = torch.randn(3, 100, dtype=torch.float64)
    for a, b in zip(Products(*members, together=True)(x), Products(*members)(x), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert len(Products(*members, together=True).runs) == 1
    apart = [quantize(_weight(n, 100, seed=n), q.format, group=block, zero_point=q.zero_point) for n in rows]
    assert laid_together(apart) is None
    if format == "fp8":            # a member before the last of 21 rows: its blocks of scales do not line up
        assert laid_together(_laid([quantize(_weight(n, 100, seed=n), "fp8", group=block) for n in (21, 64)])) is None
    other = quantize(_weight(8, 100), "int8" if format != "int8" else "fp8", group=block)
    narrower = quantize(_weight(8, 64), q.format, group=block, zero_point=q.zero_point)
    assert laid_together([members[-1], other]) is None and laid_together([members[-1], narrower]) is None


@pytest.fixture(scope="module")
def shakespeare():
    return hebrus.load("shakespeare")


@pytest.mark.parametrize("format, bound", [("int8", 0.005), ("fp8", 0.03), ("int4", 0.08), ("int4-zp", 0.08)])
def test_quantized_logits_stay_near_the_float_models(shakespeare, format, bound):
    """The trained model quantized: relative error of its logits over a passage (measured:
    int8 0.2%, fp8 1.3%, int4 3.8%, int4-zp 3.2%)."""
    want = shakespeare.session().feed(TEXT)
    got = shakespeare.quantized(format).session().feed(TEXT)
    assert (got - want).norm() / want.norm() < bound


@pytest.mark.parametrize("format", FORMATS)
def test_a_quantized_checkpoint_loads_as_it_was_saved(tmp_path, format):
    model = hebrus.load("tiny", quantize=format)
    model.save(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert data["quant_method"] == ("fp8" if format == "fp8" else "hebrus")
    again = hebrus.load(tmp_path)
    assert again.spec.quantization == model.spec.quantization
    mine, theirs = dict(model.named_parameters()), dict(again.named_parameters())
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[n].view(torch.uint8) if mine[n].dtype == FP8
                                                            else mine[n],
                                                            theirs[n].view(torch.uint8) if theirs[n].dtype == FP8
                                                            else theirs[n]) for n in mine)
    a, b = model.session(), again.session()
    assert torch.equal(a.feed(TEXT[:30]), b.feed(TEXT[:30])) and a.digest() == b.digest()
    with pytest.raises(InvalidInput, match="stored quantized"):
        hebrus.load(tmp_path, quantize="int8")


def test_quantized_weights_take_fewer_bytes(tmp_path):
    sizes = {f: sum(p.numel() * p.element_size() for _, p in hebrus.load("small", quantize=f).named_parameters())
             for f in ("int8", "int4", "fp8")}
    full = sum(p.numel() * p.element_size() for _, p in hebrus.load("small").named_parameters())
    assert sizes["int4"] < sizes["int8"] <= sizes["fp8"] * 1.01 < full * 0.5


def _tamper(folder, name: str, value: float) -> None:
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[name].view(-1)[0] = value
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "hebrus"})


@pytest.mark.parametrize("value, why", [(0.0, "positive"), (float("nan"), "NaN"), (float("inf"), "infinite")])
def test_a_checkpoint_with_a_bad_scale_is_refused(tmp_path, value, why):
    hebrus.load("tiny", quantize="int8").save(tmp_path)
    _tamper(tmp_path, "layers.0.gdn.in_proj_qkv.qscale", value)
    with pytest.raises(InvalidInput, match=why):
        hebrus.load(tmp_path)


def test_bad_quantize_arguments_are_refused():
    with pytest.raises(InvalidInput, match="int8, int4, int4-zp, fp8"):
        hebrus.load("tiny", quantize="int3")
    with pytest.raises(InvalidInput, match="already quantized"):
        hebrus.load("tiny", quantize="int8").quantized("int4")
    with pytest.raises(InvalidInput, match="zero points"):
        Quantization("fp8", zero_point=True)
    with pytest.raises(InvalidInput, match="not supported"):
        Quantization.from_config({"quant_method": "gptq"})


def test_an_overflowing_product_aborts_the_chunk_and_publishes_nothing():
    """A finite scale so large that the rebuilt weight overflows float16: the stage's checks see
    the non-finite output and the chunk aborts there, the session as it was."""
    model = hebrus.load("tiny", dtype="float16", quantize="int8")
    s = model.session()
    s.feed(TEXT[:5])
    digest, frontier = s.digest(), s.frontier
    scale = dict(model.named_parameters())["layers.2.gdn.out_proj.qscale"]
    kept = scale.clone()
    scale.fill_(1e30)
    try:
        with pytest.raises(hebrus.NonFiniteError) as caught:
            s.feed(TEXT[5:12])
    finally:
        scale.copy_(kept)
    assert caught.value.stage == "layers.2.gdn" and s.digest() == digest and s.frontier == frontier
    clean = model.session()
    clean.feed(TEXT[:5])
    assert torch.equal(s.feed(TEXT[5:12]), clean.feed(TEXT[5:12])) and s.digest() == clean.digest()


@pytest.mark.parametrize("format, mode", [("int4", "exact"), ("int4", "fast"), ("fp8", "fast")])
def test_verify_passes_on_a_quantized_model(format, mode, capsys):
    """Every stage × every fault kind, and the equivalence checks (which rebuild the model in
    float64 and in exact mode: fp8 codes have no isfinite of their own)."""
    assert main(["verify", "--model", "tiny", "--quantize", format, "--mode", mode]) == 0
    assert ", 0 failed" in capsys.readouterr().out


def test_the_quantize_command_writes_a_checkpoint_info_describes(tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", "tiny", str(out), "--format", "int4-zp"]) == 0
    assert "int4-zp weights" in capsys.readouterr().out
    assert main(["info", "--model", str(out)]) == 0
    text = capsys.readouterr().out
    assert "int4 (groups of 128, zero points)" in text and "per token" in text
    with pytest.raises(SystemExit) as exited:
        main(["quantize", "tiny", str(out), "--format", "int2"])
    assert exited.value.code == 2 and "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_an_fp8_checkpoint_in_the_published_layout_loads_as_stored(tmp_path, family):
    """A Qwen3.5 checkpoint whose layers' linear weights are fp8 with `weight_scale_inv` block
    scales beside them (blocks of 32 here, so a tiny model has several): weights the model keeps
    quantized take the file's codes as they are (or, split from a fused tensor, are quantized
    again), weights it keeps in float are rebuilt from their codes; the logits match the same
    model loaded from a float checkpoint of the rebuilt weights."""
    from safetensors.torch import load_file, save_file

    from tests import foreign
    folder, _ = foreign.build(family, tmp_path / "float")
    config = json.loads((folder / "config.json").read_text())
    stored, rebuilt = {}, {}
    for name, t in load_file(folder / "model.safetensors").items():
        if name.startswith("model.layers.") and t.dim() in (2, 3) and "norm" not in name and "conv1d" not in name:
            q = quantize(t, "fp8", group=32)
            stored[name], stored[name + "_scale_inv"] = q.qweight, q.scale
            rebuilt[name] = q.dequantize()
        else:
            stored[name] = rebuilt[name] = t
    for sub, tensors, extra in (("fp8", stored, {"quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}}), ("rebuilt", rebuilt, {})):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "config.json").write_text(json.dumps(config | extra))
        save_file(tensors, tmp_path / sub / "model.safetensors")
    fp8 = hebrus.load(tmp_path / "fp8")
    reference = hebrus.load(tmp_path / "rebuilt").quantized(Quantization("fp8", 32))
    assert str(fp8.spec.quantization) == "fp8 (e4m3, 32 × 32 blocks)"
    params = dict(fp8.named_parameters())
    layer = fp8.spec.mixers.index("gdn")
    f, m = f"model.layers.{layer}.linear_attn.", f"layers.{layer}.gdn."
    assert torch.equal(params[m + "out_proj.qweight"].view(torch.uint8), stored[f + "out_proj.weight"].view(torch.uint8))
    assert torch.equal(params[m + "out_proj.qscale"], stored[f + "out_proj.weight_scale_inv"])
    assert torch.equal(params[m + "in_proj_a.weight"], rebuilt[f + "in_proj_a.weight"])   # kept in float: rebuilt
    ids = [t % 101 for t in TEXT[:40]]
    a, b = fp8.session(), reference.session()
    assert torch.equal(a.feed(ids), b.feed(ids)) and a.digest() == b.digest()
    assert hebrus.load(tmp_path / "fp8", mode="fast").session().feed(ids).shape == (101,)


@pytest.mark.parametrize("format", ["int8", "fp8"])
def test_cache_rows_are_rebuilt_within_their_formats_rounding(format):
    from hebrus.ops.quant import QuantizedRows, quantize_rows
    g = torch.Generator().manual_seed(8)
    x = torch.randn(50, 3, 16, generator=g) * torch.rand(50, 3, 1, generator=g) * 10
    x[4] = 0                                                     # a row of zeros: scale 1
    codes, scale = quantize_rows(x, format)
    assert codes.shape == x.shape and scale.shape == (50, 3) and bool((scale[4] == 1).all())
    rebuilt = QuantizedRows.of(codes, scale, torch.float32)
    step = scale.unsqueeze(-1)
    bound = step / 2 if format == "int8" else torch.maximum(x.abs() / 16, step * 2 ** -10)
    assert bool(((rebuilt.dequantize() - x).abs() <= bound * (1 + 1e-5)).all())
    picked = torch.tensor([[3, 7], [49, 0]])
    assert torch.equal(rebuilt[picked], rebuilt.dequantize()[picked])
    x[9, 1, 2] = float("nan")
    assert torch.isnan(quantize_rows(x, format)[1][9, 1])        # seen by the finite checks


@pytest.mark.parametrize("kv_cache, bound", [("int8", 1e-3), ("fp8", 1e-2)])
def test_a_quantized_cache_keeps_every_guarantee(shakespeare, kv_cache, bound):
    """Logits near the float cache's (measured: int8 1.7e-4, fp8 2.8e-3); in exact mode any
    chunking gives the same state bit for bit; planned one-token steps match eager ones; the
    owners hold codes and float32 scales, fewer bytes per token."""
    model = hebrus.load("shakespeare", kv_cache=kv_cache)
    want = shakespeare.session().feed(TEXT)
    whole, one = model.session(), model.session()
    got = whole.feed(TEXT)
    for t in TEXT:
        one.feed([t])
    assert (got - want).norm() / want.norm() < bound
    assert whole.digest() == one.digest() and torch.equal(got, one.logits)
    owners = {o.name: o for o in model.owners}
    layer = next(name.removesuffix(".k") for name in owners if name.endswith(".qsa.k"))
    assert owners[layer + ".k"].dtype == (torch.int8 if kv_cache == "int8" else FP8)
    assert owners[layer + ".k_scale"].dtype == torch.float32 and owners[layer + ".index_scale"].shape == (1,)
    per_token = [sum(o.nbytes for o in m.owners if o.kind != "banked") for m in (model, shakespeare)]
    assert per_token[0] < per_token[1] * 0.6
    fast = model.with_mode("fast")
    planned, eager = fast.session(decode="planned"), fast.session(decode="eager")
    for s in (planned, eager):
        s.feed(TEXT[:30])
    for t in TEXT[30:40]:             # as for a float cache: the same to rounding (the plan masks more rows)
        torch.testing.assert_close(planned.feed([t]), eager.feed([t]), rtol=1e-5, atol=1e-5)


def test_a_non_finite_cache_row_aborts_its_chunk_through_its_scale():
    """A key row that is not finite (here from a poisoned projection) gets a non-finite scale;
    the chunk aborts at that stage and nothing is published."""
    model = hebrus.load("tiny", kv_cache="fp8")
    s = model.session()
    s.feed(TEXT[:5])
    digest = s.digest()
    weight = dict(model.named_parameters())["layers.1.qsa.k_proj.weight"]
    kept = weight.clone()
    weight[0, 0] = float("nan")
    try:
        with pytest.raises(hebrus.NonFiniteError) as caught:
            s.feed(TEXT[5:9])
    finally:
        weight.copy_(kept)
    assert caught.value.stage == "layers.1.qsa" and s.digest() == digest


@pytest.mark.parametrize("kv_cache, mode", [("int8", "exact"), ("fp8", "fast")])
def test_verify_passes_with_a_quantized_cache(kv_cache, mode, capsys):
    assert main(["verify", "--model", "tiny", "--kv-cache", kv_cache, "--quantize", "int8", "--mode", mode]) == 0
    assert ", 0 failed" in capsys.readouterr().out
    assert main(["info", "--model", "tiny", "--kv-cache", kv_cache]) == 0
    assert "qsa.k_scale" in capsys.readouterr().out


def test_a_bad_kv_cache_is_refused():
    with pytest.raises(InvalidInput, match="kv_cache must be one of int8, fp8"):
        hebrus.load("tiny", kv_cache="int4")


def _retyped(folder, name: str, dtype) -> None:
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[name] = tensors[name].view(dtype)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "hebrus"})


@pytest.mark.parametrize("format, wrong", [("int8", torch.uint8), ("int4", torch.int8), ("fp8", torch.int8)])
def test_codes_stored_in_another_formats_dtype_are_refused(tmp_path, format, wrong):
    hebrus.load("tiny", quantize=format).save(tmp_path)
    _retyped(tmp_path, "layers.1.qsa.q_proj.qweight", wrong)
    with pytest.raises(hebrus.CheckpointError, match="wrong dtypes"):
        hebrus.load(tmp_path)


def test_an_int8_code_of_minus_128_is_refused(tmp_path):
    hebrus.load("tiny", quantize="int8").save(tmp_path)
    _tamper(tmp_path, "layers.1.qsa.q_proj.qweight", -128)
    with pytest.raises(hebrus.CheckpointError, match="-127..127"):
        hebrus.load(tmp_path)


def test_a_weight_too_small_to_scale_still_gets_a_positive_scale(tmp_path):
    """amax / 127 of a subnormal row underflows to 0: the scale is clamped, so the quantized
    model saves a checkpoint that loads."""
    model = hebrus.load("tiny")
    dict(model.named_parameters())["layers.1.qsa.q_proj.weight"][0] = 1e-44
    for format in ("int8", "fp8"):
        q = model.quantized(format)
        scale = dict(q.named_parameters())["layers.1.qsa.q_proj.qscale"]
        assert bool((scale > 0).all())
        q.save(tmp_path / format)
        assert torch.equal(hebrus.load(tmp_path / format).session().feed([1, 2]), q.session().feed([1, 2]))


@pytest.mark.parametrize("config, why", [
    ({"quant_method": "hebrus", "format": "int4", "zero_point": "false"}, "true or false"),
    ({"quant_method": "hebrus", "format": "int8", "group_size": 0}, "positive integer"),
    ({"quant_method": "fp8", "weight_block_size": [0, 0]}, "square weight blocks"),
])
def test_a_malformed_quantization_config_is_refused(tmp_path, config, why):
    hebrus.load("tiny", quantize="int8").save(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(data | {"quantization_config": config}))
    with pytest.raises(hebrus.CheckpointError, match=why):
        hebrus.load(tmp_path)


def test_a_kv_cache_needs_attention_layers():
    from hebrus.models.hebrus import preset
    config = preset("tiny").replace(layer_types=("gdn",) * 4)
    model = hebrus.Model(config, config.init_parameters())
    with pytest.raises(InvalidInput, match="attention, qsa and latent attention layers.; this hebrus model has none"):
        model.with_kv_cache("int8")


def test_foreign_fp8_scales_that_are_not_positive_are_refused(tmp_path):
    """On a weight the model rebuilds (a router kept in float) as on one it takes as stored."""
    from safetensors.torch import load_file, save_file

    from tests import foreign
    folder, _ = foreign.build("qwen3_5_moe", tmp_path / "float")
    config = json.loads((folder / "config.json").read_text())
    tensors = {}
    for name, t in load_file(folder / "model.safetensors").items():
        if name.startswith("model.layers.") and t.dim() == 2 and "norm" not in name:
            q = quantize(t, "fp8", group=16)
            tensors[name], tensors[name + "_scale_inv"] = q.qweight, q.scale
        else:
            tensors[name] = t
    for name in ("model.layers.1.mlp.gate.weight_scale_inv", "model.layers.1.linear_attn.out_proj.weight_scale_inv"):
        bad = dict(tensors)
        bad[name] = -bad[name]
        (tmp_path / "fp8").mkdir(exist_ok=True)
        (tmp_path / "fp8" / "config.json").write_text(json.dumps(config | {"quantization_config": {
            "quant_method": "fp8", "weight_block_size": [16, 16]}}))
        save_file(bad, tmp_path / "fp8" / "model.safetensors")
        with pytest.raises(InvalidInput, match="positive"):
            hebrus.load(tmp_path / "fp8")
