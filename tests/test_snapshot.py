"""Saved sessions: `Session.save` writes the published image atomically with its digest and the
model's fingerprint; `Model.restore` gives back exactly that session or refuses, changing
nothing."""
from __future__ import annotations

import os

import pytest
import torch

import hebrus
from hebrus.errors import InvalidInput

TEXT = list(b"So foul and fair a day")


@pytest.mark.parametrize("options", [{}, {"mode": "fast"}, {"kv_cache": "fp8", "quantize": "int4"}])
def test_a_restored_session_is_the_saved_one(tmp_path, options):
    model = hebrus.load("tiny", **options)
    s = model.session()
    s.feed(TEXT[:15])
    s.save(tmp_path / "s")
    back = model.restore(tmp_path / "s")
    assert back.digest() == s.digest() and back.frontier == s.frontier == 15
    assert torch.equal(back.logits, s.logits)
    assert torch.equal(back.feed(TEXT[15:]), s.feed(TEXT[15:])) and back.digest() == s.digest()


def test_a_fresh_session_saves_and_restores(tmp_path, tiny):
    s = tiny.session()
    s.save(tmp_path / "s")
    assert tiny.restore(tmp_path / "s").digest() == s.digest()


@pytest.fixture
def saved(tmp_path, tiny):
    s = tiny.session()
    s.feed(TEXT)
    s.save(tmp_path / "s")
    return tmp_path / "s"


def test_a_changed_byte_is_refused(saved, tiny):
    data = bytearray(saved.read_bytes())
    data[-5] ^= 0x01                                   # inside the last owner's rows
    saved.write_bytes(bytes(data))
    with pytest.raises(InvalidInput, match="damaged"):
        tiny.restore(saved)


@pytest.mark.parametrize("keep", [0, 7, 100, -1])
def test_a_truncated_file_is_refused(saved, tiny, keep):
    saved.write_bytes(saved.read_bytes()[:keep])
    with pytest.raises(InvalidInput):
        tiny.restore(saved)


def test_another_models_session_is_refused(saved, tiny):
    for other in (hebrus.load("tiny", dtype="float64"), hebrus.load("tiny", quantize="int8"),
                  hebrus.load("shakespeare")):
        with pytest.raises(InvalidInput, match="another model"):
            other.restore(saved)
    tiny.restore(saved)                                 # the right one still restores


def test_bad_paths_are_refused(tmp_path, tiny):
    s = tiny.session()
    with pytest.raises(InvalidInput, match="is a directory"):
        s.save(tmp_path)
    with pytest.raises(InvalidInput, match="not a directory"):
        s.save(tmp_path / "missing" / "s")
    with pytest.raises(InvalidInput, match="no such file"):
        tiny.restore(tmp_path / "none")


def test_a_save_that_fails_leaves_the_old_file(saved, tiny, monkeypatch):
    before = saved.read_bytes()
    s = tiny.session()
    s.feed(TEXT[:3])

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("hebrus.snapshot.save_file", broken)
    with pytest.raises(OSError):
        s.save(saved)
    assert saved.read_bytes() == before and os.listdir(saved.parent) == [saved.name]


def test_a_budget_too_small_for_the_rows_is_refused(saved, tiny):
    from hebrus.state.owners import bank_bytes
    with pytest.raises(InvalidInput, match="too small for the saved session"):
        tiny.restore(saved, memory_budget=bank_bytes(tiny.owners) + 10)


# ---- a restored session owns its state --------------------------------------------------------

def test_what_is_done_to_the_file_after_restore_does_not_reach_the_session(tmp_path, tiny):
    """Rewriting the snapshot in place (as `cp other.hs path` or `open(path, "r+b")` do) once
    `restore` has returned changes nothing in the restored session."""
    s, other = tiny.session(), tiny.session()
    s.feed(TEXT)
    other.feed(TEXT[::-1])
    s.save(tmp_path / "s")
    other.save(tmp_path / "o")
    back = tiny.restore(tmp_path / "s")
    digest = back.digest()
    with open(tmp_path / "s", "r+b") as f:              # the same inode, other bytes
        f.write((tmp_path / "o").read_bytes())
    assert back.digest() == digest
    with open(tmp_path / "s", "r+b") as f:
        f.seek(-64, os.SEEK_END)
        f.write(b"\xff" * 64)
    assert back.digest() == digest
    assert torch.equal(back.feed(TEXT[:3]), s.feed(TEXT[:3])) and back.digest() == s.digest()


def test_a_snapshot_truncated_after_restore_does_not_reach_the_session(tmp_path, tiny):
    """In a child process: a mapped file cut to nothing would kill it (SIGBUS) at the next read."""
    import subprocess
    import sys
    s = tiny.session()
    s.feed(TEXT)
    s.save(tmp_path / "s")
    s.feed(TEXT[:3])
    script = (f"import os, hebrus\nm = hebrus.load('tiny')\nback = m.restore({str(tmp_path / 's')!r})\n"
              f"os.truncate({str(tmp_path / 's')!r}, 0)\nback.feed({TEXT[:3]!r})\nprint(back.digest())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [s.digest()]


# ---- a restored session is within the model's limits ------------------------------------------

def _crafted(model, path, frontier: int, change=lambda values: None) -> None:
    """A snapshot that is self-consistent (owners, fingerprint, digest all agree; none of them is
    secret) at `frontier`, its rows repeated from a real session's, then `change`d."""
    from safetensors.torch import save_file
    from hebrus.state.image import digest
    real = model.session()
    real.feed(TEXT)
    values = {}
    for spec in model.owners:
        value = real.image.value(spec.name).clone()
        if spec.kind == "appended":
            value = value[torch.arange(frontier) % len(TEXT)].clone()
        values[spec.name] = value
    values["frontier"] = torch.tensor(frontier)
    change(values)
    ordered = digest({spec.name: values[spec.name] for spec in model.owners})     # in the owner table's order
    save_file(values, str(path), metadata={"format": "hebrus-session/1", "frontier": str(frontier),
                                            "digest": ordered, "fingerprint": model.fingerprint})


def _set(name, index, value):
    def change(values):
        values[name][index] = value
    return change


@pytest.mark.parametrize("frontier, change, why", [
    (1074, lambda values: None, "context limit of 1024"),
    (30, _set("frontier", (), 29), "frontier"),
    (30, _set("ple.history", 0, 257), "ple.history"),
    (30, _set("routes", (3, 1, 0), 4), "routes"),
    (30, _set("routes", (3, 1, 0), -1), "routes"),
    (30, _set("residual", (0, 0), float("nan")), "residual"),
    (30, _set("layers.1.qsa.k", (2, 0, 0), float("inf")), "layers.1.qsa.k"),
])
def test_a_crafted_snapshot_past_the_models_limits_is_refused(tmp_path, tiny, frontier, change, why):
    _crafted(tiny, tmp_path / "ok", 30)
    assert tiny.restore(tmp_path / "ok").frontier == 30           # the crafting itself is sound
    _crafted(tiny, tmp_path / "bad", frontier, change)
    with pytest.raises(InvalidInput, match=why):
        tiny.restore(tmp_path / "bad")


def test_a_session_at_the_context_limit_restores(tmp_path, tiny):
    _crafted(tiny, tmp_path / "s", tiny.spec.max_context)
    back = tiny.restore(tmp_path / "s")
    assert back.frontier == tiny.spec.max_context
    with pytest.raises(InvalidInput, match="0 tokens left"):
        back.feed([1])


def _header_of(path) -> tuple[dict, bytes]:
    import json
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length]), data[8 + length:]


def _with_header(path, header: bytes, rest: bytes) -> None:
    path.write_bytes(len(header).to_bytes(8, "little") + header + rest)


@pytest.mark.parametrize("frontier", ["²", "٣", "-1", "1e3", " 7"])
def test_a_frontier_that_is_not_plain_digits_is_refused(saved, tiny, frontier):
    import json
    header, rest = _header_of(saved)
    header["__metadata__"]["frontier"] = frontier
    _with_header(saved, json.dumps(header).encode(), rest)
    with pytest.raises(InvalidInput, match="frontier"):
        tiny.restore(saved)


def test_a_header_nested_too_deep_is_refused(saved, tiny):
    _, rest = _header_of(saved)
    _with_header(saved, b"[" * 200_000 + b"]" * 200_000, rest)
    with pytest.raises(InvalidInput, match="not JSON"):
        tiny.restore(saved)
