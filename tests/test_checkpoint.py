"""The checkpoint format is a public contract: names, shapes, config keys, round trip, and a save
that replaces a folder's checkpoint in one step."""
import json
import os
import re

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
    assert tensors["layers.0.gdn.in_proj_qkv.weight"].shape == (2 * c.gdn_key_heads * c.gdn_key_dim + c.gdn_value_heads * c.gdn_value_dim, D)
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
    hebrus.Model(config, config.init_parameters()).save(tmp_path)
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
    with pytest.raises(hebrus.CheckpointError, match="config.json is missing"):
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
    from hebrus.layers.layout import parameter_count
    tiny, small = hebrus.load("tiny").config, hebrus.models.hebrus.preset("small")
    assert parameter_count(tiny.spec()) <= 1_000_000 and tiny.num_layers >= 4
    assert 50e6 <= parameter_count(small.spec()) <= 100e6
    assert set(small.layer_types) == {"gdn", "qsa"}


BASE = dict(vocab_size=10, hidden_size=8, num_layers=1, layer_types=["gdn"])


@pytest.mark.parametrize("change, problem", [
    ({"rope_theta": 0}, "rope_theta must be a finite number > 0, got 0"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number in (0, 1], got nan"),
    ({"ple_buckets": (509.9, "1021")}, "ple_buckets[0] must be an integer in [1, 16777216], got 509.9"),
    ({"layer_types": "gdn"}, "layer_types must be a list of layer types ('gdn', 'qsa'), got 'gdn'"),
    ({"tie_embeddings": 1}, "tie_embeddings must be true or false, got 1"),
    ({"max_context": 2**20 + 1}, "max_context must be an integer in [1, 1048576], got 1048577"),
    ({"hc_streams": 2.0}, "hc_streams must be an integer in [1, 16], got 2.0"),
])
def test_config_built_in_code_raises_invalid_input(change, problem):
    with pytest.raises(hebrus.InvalidInput, match=re.escape(problem)):
        hebrus.HebrusConfig(**(BASE | change))


def test_from_dict_refuses_what_is_not_a_hebrus_config():
    for data, problem in [([1, 2], "a JSON object"),
                          ({**BASE, "model_type": "llama"}, "model_type is 'llama'"),
                          ({"vocab_size": 3}, "missing required keys: hidden_size, layer_types, num_layers")]:
        with pytest.raises(hebrus.InvalidInput, match=re.escape(problem)):
            hebrus.HebrusConfig.from_dict(data)


def test_the_documented_limits_are_the_code_limits():
    from dataclasses import fields
    from pathlib import Path
    from hebrus.weights.checkpoint import MAX_LOAD_BYTES
    doc = (Path(__file__).resolve().parent.parent / "docs" / "checkpoint.md").read_text()
    allowed = dict(re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|", doc, re.M))
    for f in fields(hebrus.HebrusConfig):
        if f.type in ("int", "float", "tuple[int, ...]"):
            assert str(f.metadata["range"]) in allowed[f.name], f.name
    assert f"`hebrus.weights.checkpoint.MAX_LOAD_BYTES` = {MAX_LOAD_BYTES // 2**30} GiB" in doc


def test_presets_are_within_every_limit():
    from hebrus.weights.checkpoint import MAX_LOAD_BYTES
    from hebrus.models.layout import load_bytes
    for name in hebrus.models.hebrus.PRESETS:
        config = hebrus.models.hebrus.preset(name)
        assert hebrus.HebrusConfig.from_dict(config.to_dict()) == config
        assert load_bytes(config.spec()) <= MAX_LOAD_BYTES


SMALLEST = dict(vocab_size=1, hidden_size=1, num_layers=2, layer_types=["gdn", "qsa"], hc_streams=1,
                hc_sinkhorn_iters=1, hc_eps=0, rms_norm_eps=1e-30, gdn_key_heads=1, gdn_value_heads=1,
                gdn_key_dim=1, gdn_value_dim=1, gdn_conv_kernel=1, qsa_heads=1, qsa_kv_heads=1,
                qsa_head_dim=2, qsa_index_heads=1, qsa_index_dim=2, qsa_top_k=1, rope_theta=1e-300,
                moe_experts=1, moe_top_k=1,
                moe_intermediate=1, moe_shared_intermediate=1, ple_dim=1, ple_ngram=2, ple_buckets=[1],
                ple_conv_kernel=1, tie_embeddings=True, max_context=2, init_seed=0)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_the_smallest_allowed_config_runs(mode):
    config = hebrus.HebrusConfig(**SMALLEST)
    session = hebrus.Model(config, config.init_parameters(), mode=mode).session()
    session.feed([0])
    session.feed([0])
    assert session.frontier == 2


# ---- saving -------------------------------------------------------------------------------

def _other(tiny):
    return hebrus.Model(tiny.config, tiny.config.init_parameters(1))


def _write_sharded(model, folder):
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in model.named_parameters()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:40], "model-00002-of-00002.safetensors": names[40:]}
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(folder / file))
    weight_map = {k: file for file, part in shards.items() for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(model.config.to_dict()))


def _files(folder):
    """Every entry of the folder and its bytes (None for a folder), or None when it does not exist."""
    if not folder.exists():
        return None
    return {p.name: None if p.is_dir() else p.read_bytes() for p in sorted(folder.iterdir())}


def _same_weights(a, b):
    theirs = dict(b.named_parameters())
    return all(torch.equal(t, theirs[name]) for name, t in a.named_parameters())


def test_save_refuses_a_folder_that_holds_anything_and_changes_nothing(tiny, tmp_path):
    """Saving over a model (or anything else) needs overwrite=True: a folder holds one model's
    files, and a save is not how another model's folder gets emptied by accident."""
    target = tmp_path / "ckpt"
    _write_sharded(_other(tiny), target)
    (target / "tokenizer.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("mine")
    for folder, why in ((target, "already holds a model"), (tmp_path / "notes", "is not empty")):
        before = _files(folder)
        with pytest.raises(hebrus.InvalidInput, match=why) as caught:
            tiny.save(folder)
        assert "overwrite=True" in str(caught.value) and _files(folder) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "notes"]           # no temporary folder left behind


def test_save_with_overwrite_leaves_exactly_the_saved_model(tiny, tmp_path):
    target = tmp_path / "ckpt"
    _write_sharded(_other(tiny), target)
    (target / "README.md").write_text("notes")
    os.symlink("README.md", target / "tokenizer.json")                 # another model's tokenizer
    tiny.save(target, overwrite=True)
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors"]
    assert _same_weights(hebrus.load(target), tiny)
    assert os.listdir(tmp_path) == ["ckpt"]


def test_overwrite_is_true_or_false(tiny, tmp_path):
    target = tiny.save(tmp_path / "ckpt")
    before = _files(target)
    for value in ("no", 1, None):
        with pytest.raises(hebrus.InvalidInput, match="overwrite must be True or False"):
            _other(tiny).save(target, overwrite=value)
    assert _files(target) == before


def test_a_folder_filled_while_the_model_is_written_is_not_replaced(tiny, tmp_path, monkeypatch):
    """Without overwrite, the new folder takes the place of an absent or empty one by one rename,
    which refuses a folder that something filled meanwhile."""
    from hebrus.weights import checkpoint
    target, real = tmp_path / "ckpt", checkpoint.save_file

    def meanwhile(*args, **kwargs):
        real(*args, **kwargs)
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    monkeypatch.setattr(checkpoint, "save_file", meanwhile)
    with pytest.raises(hebrus.InvalidInput, match="was filled while"):
        tiny.save(target)
    assert os.listdir(target) == ["notes.txt"] and os.listdir(tmp_path) == ["ckpt"]


def test_a_model_saved_after_a_chdir_brings_its_own_folder_files(tiny, tmp_path, monkeypatch):
    (tmp_path / "here").mkdir()
    (tmp_path / "there").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    tiny.save("m")
    (tmp_path / "here" / "m" / "chat_template.jinja").write_text("mine")
    (tmp_path / "there" / "m").mkdir()
    (tmp_path / "there" / "m" / "chat_template.jinja").write_text("another model's")
    loaded = hebrus.load("./m")
    monkeypatch.chdir(tmp_path / "there")
    loaded.save(tmp_path / "copy")
    assert (tmp_path / "copy" / "chat_template.jinja").read_text() == "mine"


def test_a_saved_model_keeps_its_configs_token_ids(tiny, tmp_path):
    import json
    source = tiny.save(tmp_path / "source")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"eos_token_id": [7, 9], "bos_token_id": 1}))
    hebrus.load(source).quantized("int8").save(tmp_path / "int8")
    saved = json.loads((tmp_path / "int8" / "config.json").read_text())
    assert saved["eos_token_id"] == [7, 9] and saved["bos_token_id"] == 1


TEXT_FILES = {"tokenizer.json": "{}", "tokenizer_config.json": "{}", "chat_template.jinja": "{{ messages }}",
              "generation_config.json": '{"eos_token_id": 1}', "special_tokens_map.json": "{}"}


def test_a_saved_model_brings_its_own_tokenizer_and_template(tiny, tmp_path):
    source = tiny.save(tmp_path / "source")
    for name, text in TEXT_FILES.items():
        (source / name).write_text(text)
    (source / "README.md").write_text("about the source")
    loaded = hebrus.load(source)
    target = loaded.quantized("int8").save(tmp_path / "int8")
    assert sorted(os.listdir(target)) == sorted(["config.json", "model.safetensors", *TEXT_FILES])
    assert all((target / name).read_text() == text for name, text in TEXT_FILES.items())
    loaded.save(source, overwrite=True)                                 # over the folder it came from
    assert sorted(os.listdir(source)) == sorted(["config.json", "model.safetensors", *TEXT_FILES])


def test_save_into_a_new_nested_folder(tiny, tmp_path):
    target = tiny.save(tmp_path / "a" / "b")
    assert target == tmp_path / "a" / "b" and _same_weights(hebrus.load(target), tiny)
    assert os.listdir(tmp_path / "a") == ["b"]


def test_save_through_a_symlink_replaces_the_folder_it_names(tiny, tmp_path):
    real = _other(tiny).save(tmp_path / "real")
    os.symlink("real", tmp_path / "link")
    tiny.save(tmp_path / "link", overwrite=True)
    assert os.readlink(tmp_path / "link") == "real" and _same_weights(hebrus.load(real), tiny)
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]


def test_save_refuses_a_target_it_cannot_replace_and_changes_nothing(tiny, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(hebrus.InvalidInput, match="not a directory"):
        tiny.save(tmp_path / "file")
    target = tiny.save(tmp_path / "ckpt")
    (target / "sub").mkdir()
    before = _files(target)
    with pytest.raises(hebrus.InvalidInput, match="subdirectory 'sub'"):
        _other(tiny).save(target, overwrite=True)
    assert _files(target) == before and (tmp_path / "file").read_text() == "not a folder"
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "file"]


def test_a_failed_save_leaves_the_target_as_it_was(tiny, tmp_path, monkeypatch):
    from hebrus.weights import checkpoint
    target = tiny.save(tmp_path / "ckpt")
    (target / "README.md").write_text("notes")
    before = _files(target)

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", broken)
    with pytest.raises(OSError, match="No space left"):
        _other(tiny).save(target, overwrite=True)
    assert _files(target) == before and os.listdir(tmp_path) == ["ckpt"]


def test_every_moment_of_a_save_shows_one_whole_checkpoint(tiny, tmp_path, monkeypatch):
    """Watch the target at every rename and file write of a save over a sharded checkpoint."""
    from hebrus.weights import checkpoint
    target = tmp_path / "ckpt"
    _write_sharded(_other(tiny), target)
    old, seen = _files(target), []
    real_rename, real_save = os.rename, checkpoint.save_file

    def rename(*args, **kwargs):
        seen.append(_files(target))
        real_rename(*args, **kwargs)
        seen.append(_files(target))

    def save_file(*args, **kwargs):
        seen.append(_files(target))
        real_save(*args, **kwargs)
        seen.append(_files(target))

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(checkpoint, "save_file", save_file)
    tiny.save(target, overwrite=True)
    new = _files(target)
    assert seen and all(state in (old, new, None) for state in seen)


def test_a_folder_replaced_while_it_is_read_is_refused(tiny, tmp_path, monkeypatch):
    from hebrus.weights import checkpoint
    target = tiny.save(tmp_path / "ckpt")
    real_open, other = checkpoint.safe_open, _other(tiny)

    def open_during_a_save(*args, **kwargs):
        monkeypatch.setattr(checkpoint, "safe_open", real_open)
        other.save(target, overwrite=True)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "safe_open", open_during_a_save)
    with pytest.raises(hebrus.CheckpointError, match="replaced while it was being read"):
        hebrus.load(target)
