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
