"""Per-layer-embedding tables served in pages (`hebrus.load(..., ple_cache_bytes=N)`): the same
logits and state as resident tables at every cache size, admissions published with the chunk
and dropped with an aborted one, least recently used pages evicted past capacity."""
from __future__ import annotations

import pytest
import torch

import hebrus
from hebrus.weights.pages import PageClaim, PagedTable

TEXT = list(b"ROMEO.\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.")
PAGE_BYTES = 256 * 6 * 32 * 4           # the shakespeare preset's tables: 256-row pages of 192 float32


def _run(model, steps=(3, 5, 7, 11)):
    s = model.session()
    logits = [s.feed(TEXT[:40]).clone(), s.feed(TEXT[40:]).clone()]
    logits += [s.feed([t]).clone() for t in steps]
    return s, torch.stack(logits)


@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("pages", [0, 3, 40, 400])
def test_paged_tables_give_the_resident_results(mode, pages):
    """From no frame at all (every row straight from the host) through fewer frames than one
    chunk touches to a cache holding every page: bit-identical logits and state."""
    resident, want = _run(hebrus.load("shakespeare", mode=mode))
    model = hebrus.load("shakespeare", mode=mode, ple_cache_bytes=pages * PAGE_BYTES)
    assert set(model.paged) == {"ple.unigram.weight", "ple.ngram.2.weight", "ple.ngram.3.weight"}
    paged, got = _run(model)
    assert torch.equal(got, want) and paged.digest() == resident.digest()
    tables = model.paged.values()
    if pages == 0:
        assert all(t.pool.shape[0] == 0 and t.direct > 0 and not t.mapping for t in tables)
    if pages == 400:
        assert sum(t.hits for t in tables) > 0 and sum(t.direct for t in tables) == 0
    for t in tables:
        assert not t.pins and len(t.mapping) <= t.capacity
        assert len(t.free) + len(t.mapping) == t.pool.shape[0]          # no frame lost


def test_a_small_table_is_held_whole_and_read_once():
    """The unigram table (one page) gets a pool that keeps it, from a budget where it is at most
    an eighth: read from the host once, never row by row; the n-gram tables share the rest."""
    model = hebrus.load("shakespeare", mode="fast", ple_cache_bytes=40 * PAGE_BYTES)
    unigram, ngrams = model.paged["ple.unigram.weight"], [model.paged[f"ple.ngram.{n}.weight"] for n in (2, 3)]
    assert unigram.capacity >= 1 and unigram.pool.shape[0] == PagedTable.frames_to_hold(1)
    assert sum(t.pool.shape[0] for t in ngrams) == 40 - unigram.pool.shape[0]
    _run(model)
    assert unigram.misses == 1 and unigram.direct == 0 and unigram.hits > 0
    assert not hebrus.load("shakespeare", ple_cache_bytes=8 * PAGE_BYTES).paged["ple.unigram.weight"].capacity


@pytest.mark.parametrize("pages", range(1, 12))
def test_frames_to_hold_is_the_fewest_that_keep_the_pages(pages):
    def keeps(frames):
        return PagedTable(torch.zeros(4, 2), frames, torch.device("cpu"), page_rows=1).capacity >= pages
    assert keeps(PagedTable.frames_to_hold(pages)) and not keeps(PagedTable.frames_to_hold(pages) - 1)


def test_an_aborted_chunk_leaves_the_cache_as_it_was():
    model = hebrus.load("shakespeare", mode="fast", ple_cache_bytes=40 * PAGE_BYTES)
    s = model.session()
    s.feed(TEXT[:2])
    before = {name: (dict(t.mapping), sorted(t.free)) for name, t in model.paged.items()}
    digest, misses = s.digest(), sum(t.misses for t in model.paged.values())
    with hebrus.inject(stage="layers.5.ffn", kind="nonfinite"):
        with pytest.raises(hebrus.NonFiniteError):
            s.feed(TEXT[2:])                    # its n-grams bring new pages in, then it aborts
    assert s.digest() == digest and sum(t.misses for t in model.paged.values()) > misses
    for name, t in model.paged.items():
        assert (dict(t.mapping), sorted(t.free)) == before[name] and not t.pins
    s.feed(TEXT[2:])                            # published now: its pages join the mapping
    assert any(len(t.mapping) > len(before[name][0]) for name, t in model.paged.items())


def test_publication_evicts_the_least_recently_used_pages():
    host = torch.arange(64 * 3, dtype=torch.float32).view(64, 3)
    table = PagedTable(host, frames=4, device=torch.device("cpu"), page_rows=8)
    assert table.capacity == 3

    def chunk(rows):
        claim = PageClaim(table)
        got = table.gather(torch.tensor(rows), claim)
        assert torch.equal(got, host[rows])
        claim.commit()
        return claim

    chunk([0, 9])                   # pages 0, 1
    chunk([17])                     # page 2
    chunk([1])                      # page 0 again: now the most recent
    chunk([25])                     # page 3: page 1, the least recently used, goes
    assert list(table.mapping) == [2, 0, 3]
    claim = PageClaim(table)
    table.gather(torch.tensor([33, 41, 49, 57]), claim)   # 4 new pages, 1 free frame: 3 from the host
    assert len(claim.admitted) == 1 and len(claim.direct) == 3
    claim.release()
    assert list(table.mapping) == [2, 0, 3] and len(table.free) == 1 and not table.pins
    done = chunk([2])               # a claim is finished once: a second commit or a release is nothing
    done.commit()
    done.release()
    assert list(table.mapping) == [2, 3, 0] and len(table.free) == 1 and not table.pins


def test_a_batch_shares_its_claims():
    model = hebrus.load("shakespeare", mode="fast", ple_cache_bytes=40 * PAGE_BYTES)
    plain = hebrus.load("shakespeare", mode="fast")
    together = [model.session() for _ in range(3)]
    alone = [plain.session() for _ in range(3)]
    for i, (a, b) in enumerate(zip(together, alone)):
        a.feed(TEXT[i:i + 20])
        b.feed(TEXT[i:i + 20])
    got = hebrus.feed_many(together, [10, 32, 101])
    want = [b.feed([t]) for b, t in zip(alone, [10, 32, 101])]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=3e-5, atol=3e-5)
    assert all(not t.pins and len(t.free) + len(t.mapping) == t.pool.shape[0] for t in model.paged.values())


def test_paging_is_checked_and_runs_eagerly():
    with pytest.raises(hebrus.InvalidInput, match="ple_cache_bytes"):
        hebrus.load("shakespeare", ple_cache_bytes=-1)
    model = hebrus.load("shakespeare", mode="fast", ple_cache_bytes=PAGE_BYTES * 8)
    with pytest.raises(hebrus.InvalidInput, match="streams its PLE tables in pages"):
        model.session(decode="planned")
    assert model.session().decode == "eager"
    assert model.with_mode("exact").paged and model.with_dtype(torch.float64).paged


def test_a_page_that_cannot_be_read_aborts_the_chunk(tmp_path):
    """Tables paged from the checkpoint file: a truncated file is a `CommandError` at the ple
    stage, with the state, the caller's buffer and the cache as they were."""
    import shutil
    folder = tmp_path / "model"
    shutil.copytree(hebrus.presets.TRAINED["shakespeare"], folder)
    model = hebrus.load(folder, mode="fast", ple_cache_bytes=40 * PAGE_BYTES)
    s = model.session()
    s.feed(TEXT[:2])
    before = {name: (dict(t.mapping), sorted(t.free)) for name, t in model.paged.items()}
    digest, out = s.digest(), torch.full((256,), 7.0)
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)        # the n-gram tables lie in the second half
    with pytest.raises(hebrus.CommandError, match="cut short: the file is truncated") as raised:
        s.feed(TEXT[2:], out=out)
    assert raised.value.stage == "ple"
    assert s.digest() == digest and torch.equal(out, torch.full((256,), 7.0))
    for name, t in model.paged.items():
        assert (dict(t.mapping), sorted(t.free)) == before[name] and not t.pins


RSS_SCRIPT = r"""
import sys, torch, hebrus

def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

model = hebrus.load(sys.argv[1], mode="fast", ple_cache_bytes=16 * 2**20)
start = kib("VmRSS")
try:                                            # the peak from here on (a fork inherits its parent's)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    peak = lambda: kib("VmHWM")
except OSError:
    peak = lambda: kib("VmRSS")
s, top = model.session(), start
for i in range(4):
    s.feed(torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(i)).tolist())
    top = max(top, peak())
print(sum(t.host_bytes for t in model.paged.values()), start, top)
"""


def test_tables_paged_from_a_file_keep_memory_bounded(tmp_path):
    """PLE tables of 2 GB read from their file through a 16 MB cache: the process's resident set
    grows by far less than the tables while chunks run (measured in a fresh process)."""
    import subprocess
    import sys
    from hebrus.bench.pages import sparse_checkpoint
    from hebrus.models.hebrus import preset
    config = preset("tiny").replace(ple_buckets=(8_000_000, 8_000_000))
    size = (sparse_checkpoint(tmp_path / "big", config, stored="F32") / "model.safetensors").stat().st_size
    assert size > 2 * 10**9
    done = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path / "big")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    streamed, before, after = (int(v) for v in done.stdout.split())
    assert streamed > 2 * 10**9
    assert (after - before) * 1024 < 200 * 2**20, (before, after)          # KiB
    assert after * 1024 < 1.5 * 2**30                                      # the whole process, torch included


def test_verify_injects_a_page_read_failure_and_info_shows_streamed_bytes(capsys):
    from hebrus import verify
    from hebrus.cli import main
    model = hebrus.load("shakespeare", mode="fast", ple_cache_bytes=8 * PAGE_BYTES)
    page = [c for c in verify.checks(model) if "page read" in c.name]
    assert len(page) == 1 and page[0].run().passed
    assert not [c for c in verify.checks(hebrus.load("tiny")) if "page read" in c.name]
    with pytest.raises(hebrus.InvalidInput, match="resident"):
        with hebrus.faults.page_read_failure(hebrus.load("tiny")):
            pass
    assert main(["info", "--model", "shakespeare", "--ple-cache-bytes", str(8 * PAGE_BYTES)]) == 0
    out = capsys.readouterr().out
    assert "streamed PLE bytes         2,546,688" in out and "resident weight bytes" in out


def test_with_paging_moves_between_resident_and_paged():
    paged = hebrus.load("shakespeare", ple_cache_bytes=8 * PAGE_BYTES)
    resident = paged.with_paging(None)
    direct = paged.with_paging(0)
    assert not resident.paged and all(t.pool.shape[0] == 0 for t in direct.paged.values())
    want = _run(hebrus.load("shakespeare"))[1]
    for model in (resident, direct):
        assert torch.equal(_run(model)[1], want)
    with pytest.raises(hebrus.InvalidInput, match="save needs every weight in memory"):
        paged.save("/tmp/never-written")


def test_a_fault_at_any_stage_leaves_the_cache_as_it_was():
    """Every stage × every fault kind on a paged model: the chunk aborts, its page admissions
    are dropped, no frame stays pinned, and the mapping is the one before the chunk."""
    from hebrus.errors import FAULT_KINDS
    model = hebrus.load("shakespeare", mode="fast", ple_cache_bytes=12 * PAGE_BYTES)
    s = model.session()
    s.feed(TEXT[:2])
    for stage in model.stage_names:
        for kind in FAULT_KINDS:
            before = {name: (dict(t.mapping), sorted(t.free)) for name, t in model.paged.items()}
            digest = s.digest()
            with hebrus.inject(stage=stage, kind=kind):
                with pytest.raises(hebrus.ChunkAborted):
                    s.feed(TEXT[2:40])
            assert s.digest() == digest, (stage, kind)
            for name, t in model.paged.items():
                assert (dict(t.mapping), sorted(t.free)) == before[name] and not t.pins, (stage, kind, name)


def _overwrite_tensor(folder, name: str, byte: int) -> None:
    import json
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as f:
        length = int.from_bytes(f.read(8), "little")
        begin, end = json.loads(f.read(length))[name]["data_offsets"]
        f.seek(8 + length + begin)
        f.write(bytes([byte]) * (end - begin))


def test_a_page_that_is_not_finite_fails_its_read(tmp_path):
    """The checks a resident load makes (finite weights) are made on each page read instead."""
    import shutil
    folder = tmp_path / "model"
    shutil.copytree(hebrus.presets.TRAINED["shakespeare"], folder)
    _overwrite_tensor(folder, "ple.ngram.3.weight", 0xFF)            # bf16 NaN everywhere
    with pytest.raises(hebrus.CheckpointError, match="NaN or infinite"):
        hebrus.load(folder)
    model = hebrus.load(folder, mode="fast", ple_cache_bytes=8 * PAGE_BYTES)
    s = model.session()
    with pytest.raises(hebrus.CommandError, match="hold NaN or infinite values"):
        s.feed(TEXT[:20])
    assert s.frontier == 0


def test_paged_tables_follow_the_models_dtype_conversions(tmp_path):
    """float32 weights loaded as bfloat16 and widened again: paged rows are the resident ones."""
    hebrus.load("tiny").save(tmp_path / "tiny32")
    resident = hebrus.load(tmp_path / "tiny32", dtype="bfloat16").with_dtype(torch.float32)
    paged = hebrus.load(tmp_path / "tiny32", dtype="bfloat16", ple_cache_bytes=2**20).with_dtype(torch.float32)
    assert all(t.dtype == torch.float32 for t in paged.paged.values())
    a, b = resident.session(), paged.session()
    assert torch.equal(a.feed(TEXT[:30]), b.feed(TEXT[:30])) and a.digest() == b.digest()
    host = hebrus.load("tiny", ple_cache_bytes=2**20)
    assert all(t.source.tensor.device.type == "cpu" for t in host.paged.values())
    back = host.with_paging(None)
    assert not back.paged and torch.equal(_run(back)[1], _run(hebrus.load("tiny"))[1])


def test_paging_a_model_without_ple_tables_is_refused(tmp_path):
    from foreign import build
    folder, _ = build("qwen3_5", tmp_path / "q")
    with pytest.raises(hebrus.InvalidInput, match="has none"):
        hebrus.load(folder, ple_cache_bytes=2**20)


class _Flaky:
    """Host rows whose reads fail now and then, as a file on a failing disk would."""

    def __init__(self, rows: torch.Tensor, rng, chance: float):
        from hebrus.weights.pages import HostRows
        self.inner, self.rng, self.chance = HostRows(rows), rng, chance
        self.shape, self.dtype, self.nbytes = self.inner.shape, rows.dtype, self.inner.nbytes

    def _maybe_fail(self):
        from hebrus.errors import PageReadError
        if self.rng.random() < self.chance:
            raise PageReadError("a read failed")

    def read(self, start, stop):
        self._maybe_fail()
        return self.inner.read(start, stop)

    def take(self, ids):
        self._maybe_fail()
        return self.inner.take(ids)


def _invariants(table, live, rows) -> None:
    """Every frame has one home (free, mapped, or a live claim's; evicted but pinned ones are
    retired), pins are exactly the live claims' frames, and every mapped or claimed frame holds
    its page's rows."""
    P, frames = table.page_rows, table.pool.shape[0]
    claimed = {s for c in live for s in c.admitted.values()}
    mapped = set(table.mapping.values())
    assert len(mapped) == len(table.mapping) and len(set(table.free)) == len(table.free)
    for s in range(frames):
        homes = (s in table.free) + (s in mapped) + (s in table.retired) + (s in claimed - mapped - table.retired)
        assert homes == 1, s
    pins = {}
    for c in live:
        for s in c.frames.values():
            pins[s] = pins.get(s, 0) + 1
    assert dict(table.pins) == pins and not set(table.free) & set(pins)
    assert all(pins.get(s, 0) for s in table.retired)
    held = list(table.mapping.items()) + [item for c in live for item in c.frames.items()]
    for page, s in held:
        n = min(table.rows, (page + 1) * P) - page * P
        assert torch.equal(table.pool[s, :n], rows[page * P:page * P + n]), (page, s)


@pytest.mark.parametrize("seed", range(40))
def test_the_page_cache_keeps_its_invariants_under_interleaved_claims(seed):
    """Several claims in flight at once (sessions), gathers that read or fail at random,
    commits and releases in any order: the bookkeeping stays whole and rows are always right."""
    import random
    rng = random.Random(seed)
    count, P = rng.choice([(40, 4), (64, 8), (33, 4)])
    rows = torch.randn(count, 3, generator=torch.Generator().manual_seed(seed))
    table = PagedTable(_Flaky(rows, rng, rng.choice([0.0, 0.05, 0.2])), rng.choice([0, 1, 2, 3, 5, 8]),
                       torch.device("cpu"), P)
    live = []
    for _ in range(300):
        op = rng.random()
        if op < 0.25 or not live:
            live.append(PageClaim(table))
        elif op < 0.7:
            ids = torch.tensor([rng.randrange(count) for _ in range(rng.randint(1, 6))])
            try:
                assert torch.equal(table.gather(ids, rng.choice(live)), rows[ids])
            except hebrus.errors.PageReadError:
                pass
        else:
            claim = live.pop(rng.randrange(len(live)))
            (claim.commit if op < 0.85 else claim.release)()
            assert len(table.mapping) <= table.capacity
        _invariants(table, live, rows)
    for claim in live:
        claim.commit()
    _invariants(table, [], rows)
    assert not table.pins and not table.retired and len(table.free) + len(table.mapping) == table.pool.shape[0]
