"""The checkpoint format is a public contract: names, shapes, config keys, round trip."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import hebrus
from conftest import tokens

CONFIG_KEYS = """vocab_size hidden_size num_layers layer_types hc_streams hc_sinkhorn_iters hc_eps rms_norm_eps
gdn_key_heads gdn_value_heads gdn_key_dim gdn_value_dim gdn_conv_kernel qsa_heads qsa_kv_heads qsa_head_dim
qsa_index_heads qsa_index_dim qsa_top_k rope_theta moe_experts moe_top_k moe_intermediate moe_shared_intermediate
ple_dim ple_ngram ple_buckets ple_conv_kernel tie_embeddings max_context""".split()


def _contract_names(layer_types, ngram=3, tied=False):
    """Written out from DESIGN.md §3a, independently of the package's layout table."""
    names = {"embed.weight", "ple.unigram.weight", "ple.hash_constants", "ple.conv.weight",
             "head_hc.fn", "head_hc.base", "head_hc.scale", "norm.weight"}
    names |= {f"ple.ngram.{m}.weight" for m in range(2, ngram + 1)}
    if not tied:
        names.add("lm_head.weight")
    for l, kind in enumerate(layer_types):
        p = f"layers.{l}."
        names |= {p + f"{hc}.{k}" for hc in ("mixer_hc", "ffn_hc") for k in ("fn", "base", "scale")}
        names |= {p + "mixer_norm.weight", p + "ffn_norm.weight"}
        if kind == "gdn":
            names |= {p + "gdn." + n for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                               "in_proj_a.weight", "conv.weight", "A_log", "dt_bias",
                                               "norm.weight", "out_proj.weight")}
        else:
            names |= {p + "qsa." + n for n in ("q_proj.weight", "gate_proj.weight", "k_proj.weight",
                                               "v_proj.weight", "q_norm.weight", "k_norm.weight", "o_proj.weight",
                                               "index_q.weight", "index_k.weight", "index_k_norm.weight",
                                               "index_k_norm.bias", "index_w.weight")}
        names |= {p + "moe." + n for n in ("router.weight", "experts.gate_up", "experts.down",
                                           "shared.gate_proj.weight", "shared.up_proj.weight",
                                           "shared.down_proj.weight", "shared_gate.weight")}
        names |= {p + "ple." + n for n in ("gate.weight", "down.weight", "norm.weight")}
    return names


def test_saved_names_config_and_shapes_follow_the_contract(tiny, tmp_path):
    tiny.save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "hebrus" and set(CONFIG_KEYS) <= config.keys()
    tensors = load_file(str(tmp_path / "model.safetensors"))
    c = tiny.config
    assert set(tensors) == _contract_names(c.layer_types)
    D, n = c.hidden_size, c.hc_streams
    assert tensors["layers.0.mixer_hc.fn"].shape == ((2 + n) * n, n * D)
    assert tensors["layers.0.gdn.in_proj_qkv.weight"].shape == (c.gdn_conv_dim, D)
    assert tensors["layers.1.qsa.index_k.weight"].shape == (c.qsa_index_dim, D)
    assert tensors["layers.0.moe.experts.gate_up"].shape == (c.moe_experts, 2 * c.moe_intermediate, D)
    assert tensors["ple.hash_constants"].dtype == torch.int64
    assert tensors["ple.conv.weight"].shape == (c.num_layers * c.ple_dim, c.ple_conv_kernel)
    assert tensors["head_hc.fn"].shape == (n, n * D)


def test_round_trip_gives_the_same_state(tiny, tmp_path):
    tiny.save(tmp_path)
    loaded = hebrus.load(tmp_path)
    ids = tokens(20)
    a, b = tiny.session(), loaded.session()
    assert torch.equal(a.feed(ids), b.feed(ids)) and a.digest() == b.digest()
    assert loaded.config == tiny.config


def test_tied_checkpoint_has_no_lm_head(tmp_path):
    config = hebrus.load("tiny").config.replace(tie_embeddings=True)
    from hebrus.weights.init import init_parameters
    hebrus.Model(config, init_parameters(config)).save(tmp_path)
    assert set(load_file(str(tmp_path / "model.safetensors"))) == _contract_names(config.layer_types, tied=True)
    hebrus.load(tmp_path).session().feed([1, 2])


def test_sharded_checkpoint_loads(tiny, tmp_path):
    tensors = {k: v.contiguous() for k, v in tiny.named_parameters()}
    names = sorted(tensors)
    half = len(names) // 2
    save_file({k: tensors[k] for k in names[:half]}, str(tmp_path / "a.safetensors"))
    save_file({k: tensors[k] for k in names[half:]}, str(tmp_path / "b.safetensors"))
    weight_map = {k: ("a.safetensors" if i < half else "b.safetensors") for i, k in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(tiny.config.to_dict()))
    assert torch.equal(hebrus.load(tmp_path).session().feed([3, 4]), tiny.session().feed([3, 4]))


def test_broken_checkpoints_say_what_is_wrong(tiny, tmp_path):
    tiny.save(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["layers.0.gdn.A_log"]
    tensors["norm.weight"] = torch.ones(3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors: layers.0.gdn.A_log.*wrong shapes: norm.weight"):
        hebrus.load(tmp_path)


def test_unknown_names_are_clear_errors(tmp_path):
    with pytest.raises(hebrus.InvalidInput, match="neither a preset"):
        hebrus.load(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        hebrus.load(tmp_path)
    with pytest.raises(hebrus.InvalidInput, match="modes are"):
        hebrus.load("tiny", mode="turbo")
    with pytest.raises(hebrus.InvalidInput, match="dtype"):
        hebrus.load("tiny", dtype="int8")


def test_config_validation_names_the_problem():
    with pytest.raises(ValueError, match="layer_types has 1 entries for num_layers=2"):
        hebrus.HebrusConfig(vocab_size=10, hidden_size=8, num_layers=2, layer_types=["gdn"])
    with pytest.raises(ValueError, match="not one of"):
        hebrus.HebrusConfig(vocab_size=10, hidden_size=8, num_layers=1, layer_types=["lstm"])
    with pytest.raises(ValueError, match="missing required keys: hidden_size"):
        hebrus.HebrusConfig.from_dict({"vocab_size": 3, "num_layers": 1, "layer_types": ["gdn"]})


def test_presets_sizes():
    from hebrus.weights.layout import parameter_count
    tiny, small = hebrus.load("tiny").config, hebrus.config.preset("small")
    assert parameter_count(tiny) <= 1_000_000 and tiny.num_layers >= 4
    assert 50e6 <= parameter_count(small) <= 100e6
    assert set(small.layer_types) == {"gdn", "qsa"}
