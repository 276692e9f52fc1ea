"""Checkpoint fuzzing: whatever the bytes of config.json, the weights or the index, `hebrus.load`
returns a working model or raises one `CheckpointError`, quickly. CI runs a fixed slice;
HEBRUS_HYPOTHESIS=long runs ten times more."""
from __future__ import annotations

import json
import math
import os
import struct
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hebrus
from checkpoint_files import CONFIG, INDEX, WEIGHTS
from checkpoint_files import shard as _shard

LONG = os.environ.get("HEBRUS_HYPOTHESIS") == "long"
FUZZ = settings(max_examples=1000 if LONG else 100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
SECONDS = 15            # a load that is refused or succeeds, plus one small feed, on a busy 2-core machine


def _holds(folder: Path) -> None:
    start = time.perf_counter()
    try:
        model = hebrus.load(folder)
    except hebrus.CheckpointError:
        pass
    else:
        try:
            model.session().feed([1, 2, 3][:model.config.max_context])
        except hebrus.ChunkAborted:
            pass
    assert time.perf_counter() - start < SECONDS


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, bytes]:
    """The files of a saved tiny checkpoint, and of the same weights in two shards."""
    folder = hebrus.load("tiny").save(tmp_path_factory.mktemp("pristine") / "ckpt")
    files = {name: (folder / name).read_bytes() for name in (CONFIG, WEIGHTS)}
    _shard(folder, _halves_from_bytes(files[WEIGHTS]))
    files.update({name: (folder / name).read_bytes() for name in (INDEX, "a.safetensors", "b.safetensors")})
    return files


def _halves_from_bytes(data: bytes) -> dict[str, list[str]]:
    header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
    names = sorted(name for name in header if name != "__metadata__")
    return {"a.safetensors": names[:len(names) // 2], "b.safetensors": names[len(names) // 2:]}


def _holds_for(files: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory(prefix="hebrus-fuzz-") as folder:
        for name, data in files.items():
            (Path(folder) / name).write_bytes(data)
        _holds(Path(folder))


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
NUMBERS = st.sampled_from([0, 1, -1, 2, 3, 7, 16, 1023, 1024, 2**20, 2**20 + 1, 10**7, 2**63,
                           0.5, 1e-300, 1e300])


@st.composite
def config_edits(draw, config: dict) -> dict | list | None:
    data = dict(config)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(config)))
        action = draw(st.sampled_from(["value", "number", "delete", "layers", "whole"]))
        if action == "whole":
            return draw(JSON)
        if action == "delete":
            data.pop(key, None)
        elif action == "layers":
            data["layer_types"] = draw(st.lists(st.sampled_from(["gdn", "qsa", "lstm"]), max_size=6))
        else:
            data[key] = draw(NUMBERS if action == "number" else JSON)
    return data


@FUZZ
@given(data=st.data())
def test_fuzzed_config(pristine, data):
    edited = data.draw(config_edits(json.loads(pristine[CONFIG])))
    _holds_for({CONFIG: json.dumps(edited).encode(), WEIGHTS: pristine[WEIGHTS]})


@st.composite
def byte_edits(draw, blob: bytes) -> bytes:
    header_end = 8 + struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:header_end])
    name = draw(st.sampled_from(sorted(n for n in header if n != "__metadata__")))
    action = draw(st.sampled_from(["truncate", "flip header", "flip body", "header entry", "retype",
                                   "reshape", "nonfinite"]))
    if action == "truncate":
        return blob[:draw(st.integers(0, len(blob) - 1))]
    if action in ("flip header", "flip body"):
        lo, hi = (0, header_end) if action == "flip header" else (header_end, len(blob))
        return _flipped(draw, blob, lo, hi)
    if action == "nonfinite":
        return _nonfinite(draw, blob, header_end, header)
    header[name] = dict(header[name])
    header[name].update(_entry_edit(draw, action, header[name]))
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + blob[header_end:]


def _flipped(draw, blob: bytes, lo: int, hi: int) -> bytes:
    data = bytearray(blob)
    for _ in range(draw(st.integers(1, 8))):
        data[draw(st.integers(lo, hi - 1))] ^= draw(st.integers(1, 255))
    return bytes(data)


def _nonfinite(draw, blob: bytes, header_end: int, header: dict) -> bytes:
    """One float32 entry of one tensor set to NaN or ±inf."""
    floats = sorted(n for n, h in header.items() if n != "__metadata__" and h["dtype"] == "F32")
    name = draw(st.sampled_from(floats))
    begin, end = header[name]["data_offsets"]
    at = header_end + begin + 4 * draw(st.integers(0, (end - begin) // 4 - 1))
    value = struct.pack("<f", draw(st.sampled_from([math.nan, math.inf, -math.inf])))
    return blob[:at] + value + blob[at + 4:]


def _entry_edit(draw, action: str, entry: dict) -> dict:
    """A changed header entry: same-size dtype or same-size shape (still a valid file), or junk."""
    numel = math.prod(entry["shape"])
    if action == "retype":
        same_size = {"F32": ["I32", "U32", "F32"], "I64": ["F64", "U64", "I64"]}[entry["dtype"]]
        return {"dtype": draw(st.sampled_from(same_size))}
    if action == "reshape":
        return {"shape": draw(st.sampled_from([[numel], [1, numel], [numel, 1], entry["shape"][::-1]]))}
    key = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
    values = {"dtype": st.sampled_from(["F16", "BF16", "F64", "I32", "I64", "BOOL", "U8", "F8_E4M3", "X"]),
              "shape": st.lists(st.integers(0, 2**40), max_size=3),
              "data_offsets": st.lists(st.integers(0, 2**40), min_size=2, max_size=2)}
    return {key: draw(values[key] | JSON)}


@FUZZ
@given(data=st.data())
def test_fuzzed_weights(pristine, data):
    blob = data.draw(byte_edits(pristine[WEIGHTS]))
    _holds_for({CONFIG: pristine[CONFIG], WEIGHTS: blob})


NAMES = st.sampled_from(["a.safetensors", "b.safetensors", "c.safetensors", "", ".", "..", "../a.safetensors",
                         "/etc/passwd", "/dev/zero", "a.safetensors/..", "config.json", INDEX, "x\x00y",
                         "a" * 300])


@st.composite
def index_edits(draw, index: dict) -> object:
    weight_map = dict(index["weight_map"])
    action = draw(st.sampled_from(["rename", "delete", "add", "map", "whole"]))
    if action == "whole":
        return draw(JSON)
    if action == "map":
        return {"weight_map": draw(JSON)}
    names = sorted(weight_map)
    for _ in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from(names))
        if action == "delete":
            weight_map.pop(name, None)
        elif action == "add":
            weight_map[draw(st.text(max_size=12))] = draw(NAMES | JSON)
        else:
            weight_map[name] = draw(NAMES | JSON)
    return {"weight_map": weight_map}


@FUZZ
@given(data=st.data())
def test_fuzzed_index(pristine, data):
    edited = data.draw(index_edits(json.loads(pristine[INDEX])))
    files = {name: pristine[name] for name in (CONFIG, "a.safetensors", "b.safetensors")}
    _holds_for(files | {INDEX: json.dumps(edited).encode()})
