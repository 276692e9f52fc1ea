"""Journaled sessions: each chunk's ids on the disk before its flip; recovery from a snapshot and
the journal reaches every committed chunk, after a crash at any point."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hebrus
from hebrus import journal as journals
from hebrus.errors import InvalidInput

TEXT = list(b"So foul and fair a day I have not seen")


@pytest.fixture(scope="module")
def fast():
    return hebrus.load("tiny", mode="fast")


def _journaled(model, path, chunks):
    s = model.session(journal=path)
    for ids in chunks:
        s.feed(ids)
    return s


def test_recovery_replays_the_journal_past_the_snapshot(tmp_path, fast):
    s = fast.session(journal=tmp_path / "j")
    s.feed(TEXT[:9])
    s.save(tmp_path / "snap")
    s.feed(TEXT[9:10])
    s.feed(TEXT[10:20])
    s.journal.close()
    for snapshot in (tmp_path / "snap", None):
        back = fast.recover(tmp_path / "j", snapshot=snapshot)
        assert back.digest() == s.digest() and back.frontier == 20
        back.journal.close()
    back = fast.recover(tmp_path / "j")              # journals on into the same file
    back.feed(TEXT[20:23])
    s2 = fast.session()
    for ids in (TEXT[:9], TEXT[9:10], TEXT[10:20], TEXT[20:23]):
        s2.feed(ids)
    assert back.digest() == s2.digest()
    records, _ = journals.read(tmp_path / "j", fast.fingerprint)
    assert [(len(ids), kept, prefix) for _, ids, kept, prefix in records] == \
        [(9, 9, False), (1, 1, False), (10, 10, False), (3, 3, False)]


def test_a_torn_last_record_is_dropped(tmp_path, fast):
    s = _journaled(fast, tmp_path / "j", [TEXT[:5], TEXT[5:12]])
    s.journal.close()
    data = (tmp_path / "j").read_bytes()
    (tmp_path / "j").write_bytes(data[:-3])           # the crash cut the last record
    back = fast.recover(tmp_path / "j")
    assert back.frontier == 5
    back.feed(TEXT[5:12])
    assert back.digest() == s.digest()


def test_damage_before_whole_records_is_refused(tmp_path, fast):
    s = _journaled(fast, tmp_path / "j", [TEXT[:5], TEXT[5:12], TEXT[12:14]])
    s.journal.close()
    data = bytearray((tmp_path / "j").read_bytes())
    data[len(journals.MAGIC) + 64 + 14] ^= 0xFF        # inside the first record's ids
    (tmp_path / "j").write_bytes(bytes(data))
    with pytest.raises(InvalidInput, match="damaged"):
        fast.recover(tmp_path / "j")


def test_another_models_journal_and_a_used_one_are_refused(tmp_path, fast, tiny):
    s = _journaled(fast, tmp_path / "j", [TEXT[:4]])
    with pytest.raises(InvalidInput, match="journaled by another session"):
        fast.recover(tmp_path / "j")
    s.journal.close()
    with pytest.raises(InvalidInput, match="another model"):
        hebrus.load("tiny", dtype="float64").recover(tmp_path / "j")
    with pytest.raises(InvalidInput, match="already holds chunks"):
        fast.session(journal=tmp_path / "j")
    (tmp_path / "x").write_bytes(b"not a journal")
    with pytest.raises(InvalidInput, match="not a hebrus journal"):
        fast.recover(tmp_path / "x")


def test_a_record_that_cannot_be_written_aborts_the_chunk(tmp_path, fast, monkeypatch):
    s = _journaled(fast, tmp_path / "j", [TEXT[:4]])
    digest, size = s.digest(), (tmp_path / "j").stat().st_size
    real = os.fsync

    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(journals.os, "fsync", full)
    with pytest.raises(hebrus.CommandError) as caught:
        s.feed(TEXT[4:8])
    monkeypatch.setattr(journals.os, "fsync", real)
    assert caught.value.stage == "journal" and s.digest() == digest and s.frontier == 4
    assert (tmp_path / "j").stat().st_size == size                 # cut back to the last whole record
    s.feed(TEXT[4:8])
    s.journal.close()
    assert fast.recover(tmp_path / "j").digest() == s.digest()


def test_journaled_sessions_are_not_batched(tmp_path, fast):
    s = fast.session(journal=tmp_path / "j")
    with pytest.raises(InvalidInput, match="one at a time"):
        hebrus.feed_many([s, fast.session()], [1, 2])


def test_no_committed_token_is_lost_over_200_kills(tmp_path):
    """A child journaling a session is SIGKILLed at random points (in prefill chunks, single
    tokens, snapshot saves and journal writes) 200 times; each time recovery holds every chunk
    whose call returned, with the digest of a session fed the same chunks."""
    harness = Path(__file__).with_name("crash_harness.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    done = subprocess.run([sys.executable, str(harness), "200", "7", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["kills"] == 200 and result["failed"] == 0 and result["tokens_lost"] == 0, result
    assert result["acknowledged_tokens"] > 1000 and result["killed_before_any_ack"] < 100


@pytest.mark.parametrize("cut", [0, 5, -1])
def test_a_creation_cut_short_holds_no_chunk_and_is_begun_anew(tmp_path, fast, cut):
    """A kill while a journal is being created (the crash test met one) leaves part of its
    header, or an empty file: recovery starts from nothing, and journaling begins the file again."""
    from hebrus import journal as journals
    header = journals.MAGIC + fast.fingerprint.encode()
    (tmp_path / "j").write_bytes(header[:cut] if cut >= 0 else header[:len(header) + cut])
    back = fast.recover(tmp_path / "j")
    assert back.frontier == 0
    back.feed(TEXT[:4])
    back.journal.close()
    again = fast.recover(tmp_path / "j")
    assert again.frontier == 4 and again.digest() == back.digest()
    again.journal.close()
    (tmp_path / "k").write_bytes(header[:7])
    fresh = fast.session(journal=tmp_path / "k")
    fresh.feed(TEXT[:2])
    fresh.journal.close()
    assert not (tmp_path / "k.new").exists()
