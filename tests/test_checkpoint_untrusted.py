"""A checkpoint folder is untrusted input: whatever its files hold, `hebrus.load` either returns
a working model or raises one `CheckpointError` naming the file, quickly, before allocating much.
Fuzzing lives in test_checkpoint_fuzz.py."""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import re
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hebrus
from checkpoint_files import CONFIG, INDEX, WEIGHTS
from checkpoint_files import shard as _shard
from hebrus.weights import checkpoint


@pytest.fixture
def folder(tiny, tmp_path) -> Path:
    return tiny.save(tmp_path / "ckpt")


def _edit_config(folder: Path, **changes) -> None:
    data = json.loads((folder / CONFIG).read_text())
    data.update(changes)
    (folder / CONFIG).write_text(json.dumps(data))


def _refused(folder: Path, pattern: str, file: str = CONFIG) -> hebrus.CheckpointError:
    with pytest.raises(hebrus.CheckpointError, match=pattern) as info:
        hebrus.load(folder)
    assert str(folder / file) in str(info.value)
    return info.value


def _halves(folder: Path) -> dict[str, list[str]]:
    names = sorted(load_file(str(folder / WEIGHTS)))
    return {"a.safetensors": names[:len(names) // 2], "b.safetensors": names[len(names) // 2:]}


# ---- 1. malformed files ---------------------------------------------------------------------

@pytest.mark.parametrize("text", [b"[1, 2]", b"null", b'"hebrus"', b"{not json", b"\xff\xfe\x00{}", b"",
                                  b"[" * 100_000, b'{"vocab_size": 1, "vocab_size": 2}'])
def test_config_that_is_not_one_json_object_is_refused(folder, text):
    (folder / CONFIG).write_bytes(text)
    _refused(folder, "config.json")


@pytest.mark.parametrize("key, value, problem", [
    ("layer_types", None, "layer_types must be a list of layer types ('gdn', 'qsa'), got None"),
    ("layer_types", "gdnqsagdnqsa", "layer_types must be a list"),
    ("layer_types", ["gdn", 3, "qsa", "qsa"], "layer_types[1] is 3, not one of 'gdn', 'qsa'"),
    ("rope_theta", "abc", "rope_theta must be a finite number > 0, got 'abc'"),
    ("vocab_size", True, "vocab_size must be an integer in [1, 16777216], got True"),
    ("vocab_size", 256.0, "vocab_size must be an integer in [1, 16777216], got 256.0"),
    ("vocab_size", "256", "vocab_size must be an integer in [1, 16777216], got '256'"),
    ("hidden_size", None, "hidden_size must be an integer"),
    ("ple_buckets", [509.9, "1021"], "ple_buckets[0] must be an integer in [1, 16777216], got 509.9"),
    ("ple_buckets", 509, "ple_buckets must be a list of integers, got 509"),
    ("tie_embeddings", "yes", "tie_embeddings must be true or false, got 'yes'"),
    ("tie_embeddings", 0, "tie_embeddings must be true or false, got 0"),
    ("model_type", "llama", "model_type 'llama' is not supported; supported: deepseek_v4, hebrus, kimi_linear, qwen3_5"),
])
def test_config_fields_of_the_wrong_type_are_refused(folder, key, value, problem):
    _edit_config(folder, **{key: value})
    _refused(folder, re.escape(problem))


def test_config_missing_a_key_is_refused_and_unknown_keys_are_ignored(folder):
    data = json.loads((folder / CONFIG).read_text())
    data["added_in_a_later_version"] = {"anything": [1, 2]}
    (folder / CONFIG).write_text(json.dumps(data))
    hebrus.load(folder)
    del data["hidden_size"]
    (folder / CONFIG).write_text(json.dumps(data))
    _refused(folder, "missing required keys: hidden_size")


def test_missing_config_is_a_checkpoint_error(tmp_path):
    _refused(tmp_path, "config.json is missing")


@pytest.mark.parametrize("text", [b"{}", b'{"weight_map": []}', b'{"weight_map": null}', b"[1]", b"{",
                                  b'{"weight_map": {"embed.weight": 3}}', b"\xc3\x28"])
def test_index_without_a_weight_map_of_file_names_is_refused(folder, text):
    _shard(folder, _halves(folder))
    (folder / INDEX).write_bytes(text)
    _refused(folder, "weight_map|JSON|UTF-8|shard", file=INDEX)


@pytest.mark.parametrize("keep", [0, 7, 8, 9, 200, -1])
def test_truncated_weights_are_refused(folder, keep):
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[:keep])
    _refused(folder, "safetensors", file=WEIGHTS)


@pytest.mark.parametrize("data", [b"\x00" * 64, os.urandom(4096), struct.pack("<Q", 2**62) + b"{}",
                                  struct.pack("<Q", 2) + b"{}", struct.pack("<Q", 4) + b"[1] "])
def test_garbage_weights_are_refused(folder, data):
    (folder / WEIGHTS).write_bytes(data)
    _refused(folder, "safetensors", file=WEIGHTS)


# ---- 2. values that would load but fail every feed ------------------------------------------

@pytest.mark.parametrize("key, value, problem", [
    ("rope_theta", 0, "rope_theta must be a finite number > 0, got 0"),
    ("rope_theta", -1, "rope_theta must be a finite number > 0, got -1"),
    ("rope_theta", float("inf"), "rope_theta must be a finite number > 0, got inf"),
    ("rms_norm_eps", -1, "rms_norm_eps must be a finite number in (0, 1], got -1"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps must be a finite number in (0, 1], got nan"),
    ("rms_norm_eps", 0, "rms_norm_eps must be a finite number in (0, 1], got 0"),
    ("hc_eps", -1e-9, "hc_eps must be a finite number in [0, 1], got -1e-09"),
    ("hc_eps", 10**400, "hc_eps must be a finite number in [0, 1], got 1000"),
    ("hc_sinkhorn_iters", 0, "hc_sinkhorn_iters must be an integer in [1, 200], got 0"),
    ("qsa_top_k", 2000, "qsa_top_k=2000 exceeds max_context=1024"),
    ("init_seed", -1, "init_seed must be an integer in [0, 18446744073709551615], got -1"),
])
def test_config_values_out_of_range_are_refused(folder, key, value, problem):
    _edit_config(folder, **{key: value})
    _refused(folder, re.escape(problem))


def test_hc_eps_may_be_zero(folder):
    _edit_config(folder, hc_eps=0)
    hebrus.load(folder).session().feed([1, 2, 3])


# ---- 3. resource bombs ----------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [("max_context", 10**7), ("hc_sinkhorn_iters", 10**7)])
def test_resource_bombs_are_refused_at_once(folder, key, value):
    _edit_config(folder, **{key: value})
    start = time.perf_counter()
    _refused(folder, f"{key} must be an integer in")
    assert time.perf_counter() - start < 2


@pytest.mark.parametrize("changes", [{"max_context": 2**20, "qsa_head_dim": 1024},
                                     {"vocab_size": 2**24, "hidden_size": 2**16}])
def test_a_config_may_not_ask_to_allocate_more_than_the_bound(folder, changes, monkeypatch):
    monkeypatch.setattr("hebrus.weights.checkpoint.memory_limit", lambda device: 16 * 2**30)
    _edit_config(folder, **changes)
    (folder / WEIGHTS).unlink()                 # refused from the config alone: no weights are looked at
    _refused(folder, "MAX_LOAD_BYTES")


def test_the_limit_is_the_constant_or_the_machine(monkeypatch):
    from hebrus.weights.checkpoint import MAX_LOAD_BYTES
    from hebrus.weights.checkpoint import memory_limit
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert memory_limit(torch.device("cpu")) == min(MAX_LOAD_BYTES, physical)


def test_the_estimate_counts_parameters_and_the_rotary_build(tiny):
    from hebrus.models.layout import load_bytes, parameter_shapes, storage_dtype
    c = tiny.config

    def stored(config, dtype):
        shapes = parameter_shapes(config.spec())
        params = sum(math.prod(s) * storage_dtype(n, dtype).itemsize for n, s in shapes.items())
        return params + 16 * max(math.prod(s) for s in shapes.values())

    assert load_bytes(c.spec()) == stored(c, torch.float32) + 32 * c.max_context * c.qsa_head_dim    # dh == di
    assert load_bytes(c.spec(), torch.bfloat16) == stored(c, torch.bfloat16) + 32 * c.max_context * c.qsa_head_dim
    assert load_bytes(c.spec(), torch.bfloat16) < load_bytes(c.spec())
    wider = c.replace(qsa_index_dim=32)
    assert load_bytes(wider.spec()) == stored(wider, torch.float32) + 32 * c.max_context * (16 + 32)
    gdn_only = c.replace(layer_types=("gdn",) * 4)
    assert load_bytes(gdn_only.spec()) == stored(gdn_only, torch.float32)


class _HeadersOnly:
    """A safe_open that refuses to hand out tensor data."""

    def __init__(self, *args, **kwargs):
        self._file = safe_open(*args, **kwargs)

    def __enter__(self):
        self._file.__enter__()
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def get_tensor(self, name):
        raise AssertionError(f"tensor {name} was read before every header was checked")


@pytest.mark.parametrize("name, tensor", [("norm.weight", torch.ones(3)),
                                          ("norm.weight", torch.ones(64, dtype=torch.int32))])
def test_headers_are_checked_before_any_tensor_is_read(folder, monkeypatch, name, tensor):
    tensors = load_file(str(folder / WEIGHTS))
    tensors[name] = tensor
    save_file(tensors, str(folder / WEIGHTS))
    monkeypatch.setattr(checkpoint, "safe_open", _HeadersOnly)
    _refused(folder, name, file=WEIGHTS)


# ---- 4. file names and file kinds -----------------------------------------------------------

@pytest.mark.parametrize("name", ["../outside/all.safetensors", "ABSOLUTE", "sub/all.safetensors", "..",
                                  "sub/../../outside/all.safetensors"])
def test_index_names_must_stay_inside_the_folder(folder, tmp_path, name):
    outside = tmp_path / "outside"
    outside.mkdir()
    (folder / "sub").mkdir()
    tensors = load_file(str(folder / WEIGHTS))
    for place in (outside, folder / "sub"):
        save_file(tensors, str(place / "all.safetensors"))
    name = str(outside / "all.safetensors") if name == "ABSOLUTE" else name
    (folder / WEIGHTS).unlink()
    (folder / INDEX).write_text(json.dumps({"weight_map": {t: name for t in tensors}}))
    _refused(folder, "a shard must be a file name inside the checkpoint folder", file=INDEX)


def _load_in_child(folder: Path, seconds: float = 30) -> str:
    """Load in a forked child, so that a load blocked in open() (which holds the GIL) is killed
    instead of hanging the test run. Returns the child's report."""
    context = multiprocessing.get_context("fork")
    reports = context.SimpleQueue()

    def run():
        try:
            hebrus.load(folder)
            reports.put("loaded")
        except BaseException as exc:     # noqa: BLE001 - the report names it
            reports.put(f"{type(exc).__name__}: {exc}")

    child = context.Process(target=run, daemon=True)
    child.start()
    child.join(seconds)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"loading {folder} was still blocked after {seconds} s")
    if reports.empty():
        pytest.fail(f"the child loading {folder} exited with code {child.exitcode} and no report")
    return reports.get()


@pytest.mark.parametrize("which", [CONFIG, INDEX, "shard", "symlink to a FIFO"])
def test_fifos_are_refused_without_being_opened(folder, which):
    fifo = {CONFIG: CONFIG, INDEX: INDEX}.get(which, "b.safetensors")
    if which != CONFIG:
        _shard(folder, _halves(folder))
    os.unlink(folder / fifo)
    if which == "symlink to a FIFO":
        os.mkfifo(folder / "pipe")
        os.symlink("pipe", folder / fifo)
    else:
        os.mkfifo(folder / fifo)
    report = _load_in_child(folder)
    assert report.startswith("CheckpointError") and "not a regular file" in report
    assert str(folder / fifo) in report


def test_symlinks_to_regular_files_still_load(tiny, tmp_path):
    """The layout of a Hugging Face cache: snapshot files are symlinks into ../../blobs."""
    source = tiny.save(tmp_path / "source")
    blobs, snapshot = tmp_path / "repo" / "blobs", tmp_path / "repo" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, name in enumerate((CONFIG, WEIGHTS)):
        (blobs / f"blob{i}").write_bytes((source / name).read_bytes())
        os.symlink(f"../../blobs/blob{i}", snapshot / name)
    assert torch.equal(hebrus.load(snapshot).session().feed([5, 6]), tiny.session().feed([5, 6]))


def test_a_symlink_to_a_directory_is_refused(folder, tmp_path):
    (folder / WEIGHTS).unlink()
    os.symlink(tmp_path, folder / WEIGHTS)
    _refused(folder, "not a regular file", file=WEIGHTS)


# ---- 5. where each tensor lives -------------------------------------------------------------

def test_a_tensor_in_two_shards_is_refused(folder):
    halves = _halves(folder)
    twice = halves["a.safetensors"][0]
    index = {n: f for f, names in halves.items() for n in names}
    halves["b.safetensors"].append(twice)
    _shard(folder, halves, index=index)
    _refused(folder, f"{twice} is in both a.safetensors and b.safetensors", file=INDEX)


def test_a_tensor_in_another_shard_than_its_index_entry_is_refused(folder):
    halves = _halves(folder)
    moved = halves["a.safetensors"][0]
    index = {n: f for f, names in halves.items() for n in names}
    index[moved] = "b.safetensors"
    _shard(folder, halves, index=index)
    _refused(folder, f"{moved} is in a.safetensors, but the index names b.safetensors", file=INDEX)


def test_an_index_entry_its_shard_does_not_hold_is_refused(folder):
    halves = _halves(folder)
    index = {n: f for f, names in halves.items() for n in names} | {"extra.weight": "a.safetensors"}
    _shard(folder, halves, index=index)
    _refused(folder, "the index names extra.weight in a.safetensors, which does not hold it", file=INDEX)


def test_both_a_single_file_and_an_index_is_refused(folder):
    data = (folder / WEIGHTS).read_bytes()
    _shard(folder, _halves(folder))
    (folder / WEIGHTS).write_bytes(data)
    _refused(folder, "both", file=WEIGHTS)


# ---- 6. dtypes and values -------------------------------------------------------------------

@pytest.mark.parametrize("name, dtype", [("norm.weight", torch.int32), ("norm.weight", torch.bool),
                                         ("layers.0.gdn.A_log", torch.float8_e4m3fn),
                                         ("embed.weight", torch.int64), ("ple.hash_constants", torch.float32),
                                         ("ple.hash_constants", torch.bool)])
def test_tensor_dtypes_are_checked(folder, name, dtype):
    tensors = load_file(str(folder / WEIGHTS))
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(folder / WEIGHTS))
    _refused(folder, f"wrong dtypes: {re.escape(name)}", file=WEIGHTS)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_weights_are_refused(folder, value):
    tensors = load_file(str(folder / WEIGHTS))
    tensors["layers.0.gdn.A_log"][1] = value
    save_file(tensors, str(folder / WEIGHTS))
    _refused(folder, "tensor layers.0.gdn.A_log holds NaN or infinite values", file=WEIGHTS)


def test_other_float_storage_dtypes_load(folder):
    tensors = load_file(str(folder / WEIGHTS))
    tensors = {n: t.to(torch.bfloat16 if t.is_floating_point() else torch.int32) for n, t in tensors.items()}
    save_file(tensors, str(folder / WEIGHTS))
    hebrus.load(folder).session().feed([1, 2, 3])
