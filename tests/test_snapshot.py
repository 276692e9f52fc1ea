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
