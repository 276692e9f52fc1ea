"""Bad foreign checkpoints: each is one clear error naming what is wrong, and nothing is loaded."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import hebrus
from foreign import build


@pytest.fixture
def folder(tmp_path):
    return build("qwen3_next", tmp_path / "m")[0]


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_unknown_model_type(folder):
    _edit_config(folder, model_type="mamba2")
    with pytest.raises(hebrus.CheckpointError, match="model_type 'mamba2' is not supported; supported: .*qwen3_next"):
        hebrus.load(folder)


def test_a_missing_tensor_is_named(folder):
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.2.self_attn.k_norm.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(hebrus.CheckpointError, match=r"missing tensors: model\.layers\.2\.self_attn\.k_norm\.weight"):
        hebrus.load(folder)


def test_a_misshaped_tensor_is_named_with_both_shapes(folder):
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.linear_attn.in_proj_qkvz.weight"] = torch.zeros(7, 40)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(hebrus.CheckpointError,
                       match=r"in_proj_qkvz\.weight: \(7, 40\) \(expected \(128, 40\)\)"):
        hebrus.load(folder)


def test_a_truncated_file(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(hebrus.CheckpointError, match="model.safetensors"):
        hebrus.load(folder)


def test_a_corrupt_header(folder):
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[8:20] = b"not json at "
    (folder / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(hebrus.CheckpointError, match="safetensors"):
        hebrus.load(folder)


@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": 2**40}, "hidden_size must be an integer"),
    ({"num_key_value_heads": 3}, "must be a multiple of its K/V heads"),
    ({"linear_num_value_heads": 3}, "must be a multiple of its key heads"),
    ({"num_experts_per_tok": 9}, "exceeds"),
    ({"layer_types": ["linear_attention"]}, "layer_types has 1 entries"),
    ({"layer_types": ["linear_attention", "mamba", "full_attention", "linear_attention"]}, r"layer_types\[1\]"),
    ({"hidden_act": "gelu"}, "hidden_act must be one of 'silu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type 'yarn' is not supported"),
    ({"vocab_size": 2**24, "hidden_size": 2**16}, "MAX_LOAD_BYTES"),
])
def test_impossible_configs_are_refused_before_weights_are_read(folder, changes, message):
    _edit_config(folder, **changes)
    (folder / "model.safetensors").write_bytes(b"never read")
    with pytest.raises(hebrus.CheckpointError, match=message):
        hebrus.load(folder)


def test_save_of_a_foreign_model_is_a_clear_error(folder, tmp_path):
    with pytest.raises(hebrus.InvalidInput, match="save writes Hebrus checkpoints"):
        hebrus.load(folder).save(tmp_path / "out")


def test_names_that_are_neither_folders_nor_repo_ids(tmp_path):
    for name in ["a" * 300, "Org/" + "a" * 300, "Org/a-", "Org/../x"]:
        with pytest.raises(hebrus.InvalidInput):
            hebrus.load(name)
    with pytest.raises(hebrus.InvalidInput, match="nor a checkpoint directory"):
        hebrus.load(tmp_path / "x" / "y")                  # a path is never looked up as a repo id


def _config(tmp_path, family, **changes):
    folder = build(family, tmp_path / family)[0]
    _edit_config(folder, **changes)
    return json.loads((folder / "config.json").read_text())


def test_layer_types_from_the_interval_and_rope_settings_from_either_place(tmp_path):
    from hebrus.layers.attention import AttentionSection
    from hebrus.models import family_of
    data = _config(tmp_path, "qwen3_5")
    del data["layer_types"]
    data["num_hidden_layers"] = 8
    data["full_attention_interval"] = 4
    family = family_of(data)
    spec = family.spec(family.config(data))
    assert spec.mixers == ("gdn", "gdn", "gdn", "attention") * 2
    nested = family.spec(family.config(dict(data, rope_parameters={"rope_theta": 500.0, "partial_rotary_factor": 0.5,
                                                                    "rope_type": "default"})))
    top = dict(data, rope_theta=500.0, partial_rotary_factor=0.5)
    top.pop("rope_parameters")
    flat = family.spec(family.config(top))
    attention = nested.section(AttentionSection)
    assert nested == flat and attention.rope_theta == 500.0 and attention.rotary_dim == 8


def test_a_real_size_config_passes_the_allocation_check(tmp_path):
    """A Qwen3.5-0.8B-shaped config is refused only for its missing weights, not its size."""
    folder = tmp_path / "big"
    folder.mkdir()
    config = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024, num_hidden_layers=24,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                  intermediate_size=3584, max_position_embeddings=262144, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(hebrus.CheckpointError, match="has neither model.safetensors"):
        hebrus.load(folder)


def test_multimodal_configs_take_the_top_level_tie(tmp_path):
    from hebrus.models import family_of
    text = _config(tmp_path, "qwen3_5")
    data = {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": dict(text, tie_word_embeddings=False)}
    family = family_of(data)
    assert family.config(data).tie_word_embeddings is True


@pytest.mark.parametrize("family, key", [("qwen3_5", "intermediate_size"), ("qwen3_5_moe", "moe_intermediate_size"),
                                         ("qwen3_next", "shared_expert_intermediate_size")])
def test_feed_forward_sizes_are_required(tmp_path, family, key):
    folder = build(family, tmp_path / family)[0]
    data = json.loads((folder / "config.json").read_text())
    del data[key]
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(hebrus.CheckpointError, match=f"missing required keys: {key}"):
        hebrus.load(folder)
