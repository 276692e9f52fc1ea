"""Tensor parallelism on the CPU: two ranks (gloo, a worker process beside the test's) against
one, on every family that shards; the fault matrix across ranks; a rank killed or hung
mid-chunk; two processes meeting over a TCP rendezvous as two hosts would."""
from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import PATIENCE, tokens

import hebrus
from hebrus import parallel
from hebrus.errors import FAULT_KINDS

ROOT = Path(__file__).resolve().parent.parent
DEVICE = os.environ.get("HEBRUS_DEVICE", "cpu")     # the ranks-against-one tests on a GPU: cuda (NCCL)
KIND_ERRORS = {"structural": hebrus.StructuralError, "nonfinite": hebrus.NonFiniteError,
               "alloc": hebrus.AllocationError, "command": hebrus.CommandError,
               "status": hebrus.DeviceStatusError}


@pytest.fixture
def closing():
    """Models loaded over ranks in a test, closed after it (one a process at a time)."""
    made = []
    yield made.append
    for model in made:
        model.close()


def over_ranks(closing, source, world: int = 2, **options):
    model = hebrus.load(source, tensor_parallel=world, **options)
    closing(model)
    return model


def _checkpoint(family: str, folder: Path) -> Path:
    from foreign import build
    overrides = {"qwen3_5_moe": dict(linear_num_key_heads=2, linear_num_value_heads=4),
                 "kimi_linear": dict(linear_num_heads=4)}.get(family, {})
    return build(family, folder, **overrides)[0]


@pytest.mark.parametrize("family", ["hebrus", "qwen3_5", "qwen3_5_moe", "qwen3_next", "kimi_linear", "deepseek_v4"])
def test_two_ranks_equal_one_in_float64_and_greedy(family, tmp_path, closing):
    """Logits within 1e-12 of the model on one rank (the parts are added in another order),
    every chunking the same bits on each rank (exact mode), and the same greedy tokens (float64;
    float32 for the Hebrus model, whose test runs both)."""
    source = "tiny" if family == "hebrus" else _checkpoint(family, tmp_path)
    ids = tokens(40, seed=3, vocab=101)
    one = hebrus.load(source, dtype=torch.float64, device=DEVICE)
    two = over_ranks(closing, source, dtype=torch.float64, device=DEVICE)
    alone, split = one.session(), two.session()
    expected = alone.feed(ids)
    got = split.feed(ids)
    assert (got - expected).abs().max().item() <= 1e-12 * max(1.0, expected.abs().max().item())
    chunked = two.session()
    chunked.feed(ids[:7])
    chunked.prefill(ids[7:], chunk_size=5)
    assert chunked.digests() == split.digests()              # each rank's part, bit for bit
    # the parts differ, but DeepSeek-V4's state is what every head shares (whole on each rank)
    assert len(set(split.digests())) == (1 if family == "deepseek_v4" else 2)
    assert list(split.generate([], max_new_tokens=8)) == list(alone.generate([], max_new_tokens=8))
    if family == "hebrus":
        two.close()
        one32, two32 = hebrus.load(source, device=DEVICE), over_ranks(closing, source, device=DEVICE)
        want = list(one32.session().generate(ids, max_new_tokens=16))
        assert list(two32.session().generate(ids, max_new_tokens=16)) == want


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "kimi_linear", "deepseek_v4"])
def test_a_rank_reads_its_part_of_each_weight_as_the_whole_model_splits(family, tmp_path):
    """A rank's load cuts each weight to its part as it is read (never the whole model in
    memory): the same spec, names and bits as the whole model loaded, then split, on each rank;
    a kv_cache taken with it."""
    from hebrus.engine.ranks import Ranks
    from hebrus.runtime import _load
    folder = _checkpoint(family, tmp_path)
    cpu, cache = torch.device("cpu"), None if family in ("kimi_linear", "deepseek_v4") else "int8"
    whole = hebrus.load(folder, dtype=torch.float64, kv_cache=cache)
    for rank in (0, 1):
        read = _load(folder, cpu, torch.float64, "exact", None, None, None, Ranks(rank, 2, None, cpu), cache)
        split = whole.on_ranks(Ranks(rank, 2, None, cpu))
        assert read.spec == split.spec and read.spec != whole.spec
        got, want = dict(read.named_parameters()), dict(split.named_parameters())
        assert got.keys() == want.keys()
        assert all(torch.equal(got[name], want[name]) for name in want), family


def test_four_ranks_with_fewer_kv_heads_than_ranks(tmp_path, closing):
    """Four ranks over two K/V heads (each rank holds the one its query heads read), an uneven
    vocabulary split, three workers reading every call: within 1e-12 of one process."""
    from foreign import build
    folder = build("qwen3_5", tmp_path, linear_num_key_heads=4, linear_num_value_heads=8)[0]
    ids = tokens(24, seed=4, vocab=101)
    expected = hebrus.load(folder, dtype=torch.float64).session().feed(ids)
    got = over_ranks(closing, folder, world=4, dtype=torch.float64).session().feed(ids)
    assert (got - expected).abs().max().item() <= 1e-12 * max(1.0, expected.abs().max().item())


def test_one_rank_is_the_model_bit_for_bit(closing):
    """A world of one (its sums and joins the identities, as over one rank they are): the same
    bits as no ranks at all, its one exchange after validation skipped."""
    ids = tokens(30, seed=1)
    plain = hebrus.load("tiny", device=DEVICE).session()
    one = over_ranks(closing, "tiny", world=1, device=DEVICE).session()
    assert torch.equal(one.feed(ids), plain.feed(ids))
    assert one.digests() == [plain.digest()]


def test_every_fault_on_either_rank_aborts_every_rank_alike(closing):
    """Every stage x every kind, on rank 0 and on rank 1: every rank raises the same error (the
    injected kind at the injected stage), and no rank's part of the session changes."""
    model = over_ranks(closing, "tiny")
    s = model.session()
    s.feed(tokens(12, seed=2))
    before = s.digests()
    for rank in (0, 1):
        for stage in model.stage_names:
            for kind in FAULT_KINDS:
                with hebrus.inject(stage, kind, rank=rank) as fault:
                    with pytest.raises(KIND_ERRORS[kind]) as raised:
                        s.feed(tokens(3, seed=5))
                assert fault.fired
                assert raised.value.stage == stage and f"rank {rank} of 2" in str(raised.value), (stage, kind, rank)
                assert s.digests() == before, (stage, kind, rank)
    s.feed(tokens(3, seed=5))                 # and the ranks go on together
    assert s.frontier == 15


def test_text_generation_runs_on_every_rank(closing):
    """The text level drives every rank's session: the same text as the model in one process."""
    options = dict(max_new_tokens=12, temperature=0)
    expected = hebrus.load("shakespeare").session().generate_text("ROMEO.\n", **options).text()
    with hebrus.load("shakespeare", tensor_parallel=2) as model:
        assert model.session().generate_text("ROMEO.\n", **options).text() == expected
        assert isinstance(hebrus.generate(model, "JULIET.\n", max_new_tokens=4), str)   # sampled, one seed for all


def test_a_session_after_a_fault_equals_one_without(closing):
    """An aborted chunk leaves nothing behind: fed again, the same bits on every rank."""
    model = over_ranks(closing, "tiny")
    clean, faulted = model.session(), model.session()
    with hebrus.inject("layers.1.ffn", "nonfinite", rank=1):
        with pytest.raises(hebrus.NonFiniteError):
            faulted.feed(tokens(9))
    clean.feed(tokens(9))
    faulted.feed(tokens(9))
    assert faulted.digests() == clean.digests()


def _lose(model, s, how: str):
    """Feed a chunk while rank 1 is `how` mid-chunk -> what the feed raised, in time."""
    outcome: list = []

    def feed():
        try:
            with parallel.lose("layers.2.gdn", rank=1, how=how):
                s.feed(tokens(4, seed=9))
            outcome.append(None)
        except BaseException as exc:            # what the survivor raised
            outcome.append(exc)

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    thread.join(PATIENCE)
    assert outcome, "the surviving rank did not return"
    return outcome[0]


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_rank_lost_mid_chunk_aborts_the_survivor_with_nothing_published(how, closing):
    """Rank 1 killed (SIGKILL) or stopped as it reaches a stage: rank 0 raises a command failure
    (the connection closed, or the group's timeout), publishes nothing, and the model refuses
    every call after."""
    model = over_ranks(closing, "tiny", rank_timeout=3.0)
    s = model.session()
    s.feed(tokens(6))
    digest, frontier = s.local.digest(), s.frontier
    error = _lose(model, s, how)
    assert isinstance(error, hebrus.CommandError), error
    assert "stopped answering" in str(error)
    assert s.local.digest() == digest and s.frontier == frontier
    with pytest.raises(hebrus.InvalidInput, match="broken"):
        s.feed(tokens(2))
    model.close()
    assert all(p.poll() is not None for p in model.processes)


def test_a_lost_rank_is_rebuilt_and_its_sessions_restored_from_snapshots(tmp_path, closing):
    """Saved over ranks (a file a rank), a rank killed mid-chunk, the model loaded again: the
    session restored equals what it was, and goes on as one that never broke. A save that one
    rank cannot write changes no rank's file; a rank's file of another save, or a damaged one,
    is refused."""
    model = over_ranks(closing, "tiny", rank_timeout=3.0)
    s = model.session()
    s.feed(tokens(10))
    s.save(tmp_path / "s.hs")
    saved = s.digests()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.hs", "s.hs.rank1"]
    assert isinstance(_lose(model, s, "killed"), hebrus.CommandError)
    model.close()

    again = over_ranks(closing, "tiny")
    back = again.restore(tmp_path / "s.hs")
    assert back.digests() == saved
    back.feed(tokens(4, seed=9))
    fresh = again.session()
    fresh.feed(tokens(10))
    fresh.feed(tokens(4, seed=9))
    assert back.digests() == fresh.digests()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    (tmp_path / "s.hs.saving.rank1").mkdir()            # rank 1 cannot write its part: no rank's file changes
    with pytest.raises(hebrus.InvalidInput, match="rank 1's file ended otherwise"):
        back.save(tmp_path / "s.hs")
    (tmp_path / "s.hs.saving.rank1").rmdir()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    back.save(tmp_path / "later.hs")                    # a part of another save beside this one's
    (tmp_path / "s.hs.rank1").write_bytes((tmp_path / "later.hs.rank1").read_bytes())
    with pytest.raises(hebrus.InvalidInput, match="not one save"):
        again.restore(tmp_path / "s.hs")
    (tmp_path / "s.hs.rank1").write_bytes(b"not a session")
    with pytest.raises(hebrus.InvalidInput, match="not one save"):
        again.restore(tmp_path / "s.hs")
    assert again.session().feed([1, 2]).shape == (256,)         # and the ranks go on together


def test_two_processes_meet_over_a_tcp_rendezvous(closing, capsys):
    """As two hosts would: this process loads with a rendezvous address (saying what it waits
    for), a worker started by hand (`hebrus worker`) joins it there."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    worker = subprocess.Popen([sys.executable, "-m", "hebrus", "worker", "--rendezvous", f"127.0.0.1:{port}",
                               "--rank", "1"], env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        model = over_ranks(closing, "tiny", rendezvous=f"127.0.0.1:{port}", dtype=torch.float64)
        assert f"hebrus worker --rendezvous 127.0.0.1:{port} --rank R" in capsys.readouterr().err
        ids = tokens(20)
        got = model.session().feed(ids)
        expected = hebrus.load("tiny", dtype=torch.float64).session().feed(ids)
        assert (got - expected).abs().max().item() <= 1e-12
        model.close()
        assert worker.wait(PATIENCE) == 0, worker.stdout.read()
    finally:
        worker.kill()


def test_ple_tables_paged_from_the_file_on_every_rank(tmp_path, closing):
    """A Hebrus checkpoint over two ranks with its PLE tables paged from the file through a
    small cache (whole on every rank): within 1e-12 of one process with the tables resident; a
    preset is refused (nothing to page from)."""
    folder = hebrus.load("tiny", dtype=torch.float64).save(tmp_path / "tiny")
    ids = tokens(30, seed=6)
    expected = hebrus.load(folder, dtype=torch.float64).session().feed(ids)
    model = over_ranks(closing, folder, dtype=torch.float64, ple_cache_bytes=1 << 14)
    assert model.paged
    got = model.session().feed(ids)
    assert (got - expected).abs().max().item() <= 1e-12 * max(1.0, expected.abs().max().item())
    with pytest.raises(hebrus.InvalidInput, match="paged from a checkpoint's file"):
        hebrus.load("tiny", tensor_parallel=2, ple_cache_bytes=1 << 14)


def test_each_rank_quantizes_its_part(tmp_path, closing):
    """quantize over two ranks: each rank quantizes its float part (a split row's scales are its
    part's): the logits as near the float model's as one process's quantized model is (int8;
    each within quantization's noise), every fault still aborting every rank alike; a
    checkpoint stored quantized is refused, saying what to load instead."""
    ids = tokens(24, seed=8)
    full = hebrus.load("tiny").session().feed(ids)
    alone = hebrus.load("tiny", quantize="int8").session().feed(ids)
    model = over_ranks(closing, "tiny", quantize="int8")
    assert model.spec.quantization.name == "int8"
    s = model.session()
    got = s.feed(ids)

    def error(x):
        return ((x - full).norm() / full.norm()).item()
    assert 0 < error(got) <= 2 * error(alone) + 1e-3, (error(got), error(alone))
    before = s.digests()
    with hebrus.inject("layers.1.ffn", "nonfinite", rank=1):
        with pytest.raises(hebrus.NonFiniteError, match="rank 1 of 2"):
            s.feed([1, 2])
    assert s.digests() == before
    stored = hebrus.load("tiny", quantize="int8").save(tmp_path / "q")
    model.close()
    with pytest.raises(hebrus.InvalidInput, match="stored quantized \\(int8\\) does not split over ranks yet"):
        hebrus.load(stored, tensor_parallel=2)


def test_a_session_over_ranks_goes_to_host_memory_and_back(closing):
    """`host_copy` over ranks (what the server does with a session it preempts): each rank
    copies its part; `from_host` makes a session on every rank with every part's digest, which
    goes on as the original does."""
    model = over_ranks(closing, "tiny")
    s = model.session()
    s.feed(tokens(14, seed=4))
    copy = s.host_copy()
    assert copy.nbytes > 0 and copy.frontier == 14
    back = model.from_host(copy)
    assert back.digests() == s.digests()
    assert torch.equal(back.feed([3, 4]), s.feed([3, 4])) and back.digests() == s.digests()
    with pytest.raises(hebrus.InvalidInput, match="a host copy of a session of this model"):
        model.from_host(s)


def test_the_engine_preempts_requests_over_ranks_to_host_memory_and_back(closing):
    """Four requests of 30 prompt tokens and 40 new ones need 20 blocks of 16 rows; every
    rank's pool has 12 (the same pool_bytes, the same parts). Requests are preempted (each
    rank's part to host memory) and come back; each answers exactly as it does alone."""
    from hebrus.sampling import Sampling
    from hebrus.scheduling.scheduler import Request, Scheduler
    probe = over_ranks(closing, "tiny")
    slot, block = probe.local.pool.slot_nbytes, probe.local.pool.block_nbytes
    probe.close()
    model = over_ranks(closing, "tiny", pool_bytes=slot + 2 * block + 4 * slot + 12 * block + block // 2)
    assert model.local.pool.free_blocks == 12 and model.local.pool.free_slots >= 4
    scheduler = Scheduler(model, chunk_size=16, prefill_tokens=64, spare_sessions=0, cache_bytes=0)
    requests = []
    for seed in range(4):
        got = []
        request = Request(key="k", prompt=tokens(30, seed=seed), max_tokens=40, sampling=Sampling(temperature=0.8),
                          seed=seed, stop_ids=frozenset(), emit=lambda kind, value, got=got: kind == "token" and got.append(value))
        request.got = got
        requests.append(request)
    scheduler.waiting.extend(requests)
    for _ in range(10_000):
        if not (scheduler.waiting or scheduler.running or scheduler.preempted):
            break
        if not scheduler.preempted:
            scheduler._take_waiting()
        scheduler._turn()
    assert scheduler.preemptions > 0 and scheduler.preempted.held == 0
    del scheduler
    gc.collect()
    model.session().feed([1])                   # a call: the workers let go what this process did
    assert model.local.pool.free_blocks == 12
    for request in requests:
        want = list(model.session().generate(request.prompt, max_new_tokens=40, temperature=0.8, seed=request.seed))
        assert request.got == want


def test_sessions_step_together_over_ranks_and_each_outcome_is_agreed(closing):
    """`hebrus.feed_many` of sessions over two ranks (fast mode: one pass): within 1e-12 of the
    same pass in one process (float64); a fault in one session's part of the pass on rank 1
    aborts that session alone, on every rank alike, its parts unchanged, the others published;
    so does one at the head, after the pass's last collective."""
    ids = [tokens(9, seed=i) for i in range(3)]
    one = hebrus.load("tiny", dtype=torch.float64, mode="fast")
    model = over_ranks(closing, "tiny", dtype=torch.float64, mode="fast")
    alone, split = [one.session() for _ in ids], [model.session() for _ in ids]
    want, got = hebrus.feed_many(alone, ids), hebrus.feed_many(split, ids)
    for w, g in zip(want, got):
        assert (g - w).abs().max().item() <= 1e-12 * max(1.0, w.abs().max().item())
    before = [s.digests() for s in split]
    with hebrus.inject("layers.1.qsa", "nonfinite", session=split[1], rank=1) as fault:
        results = hebrus.feed_many(split, [[5], [6], [7]])
    assert fault.fired
    assert isinstance(results[1], hebrus.NonFiniteError) and results[1].stage == "layers.1.qsa"
    assert "rank 1 of 2" in str(results[1])
    assert split[1].digests() == before[1]
    assert all(isinstance(r, torch.Tensor) for r in (results[0], results[2]))
    assert [s.frontier for s in split] == [10, 9, 10]
    with hebrus.inject("head", "structural", session=split[0], rank=1):    # after the pass's last collective
        results = hebrus.feed_many(split, [[1], [2], [3]])
    assert isinstance(results[0], hebrus.StructuralError) and results[0].stage == "head"
    assert [s.frontier for s in split] == [10, 10, 11]
    assert hebrus.feed_many(split, [[1], [2], [3]])[1].shape == (256,)      # the ranks go on together
    with pytest.raises(hebrus.InvalidInput, match="outs is not taken under tensor parallelism"):
        hebrus.feed_many(split, [[1], [2], [3]], outs=[None] * 3)


def test_the_server_steps_requests_together_over_ranks_and_a_failing_one_stays_alone(closing):
    """`hebrus serve --tensor-parallel 2`'s engine: concurrent requests, stepped together in
    one pass on every rank (fast mode, float64), answer as the same model's sessions do alone;
    one failed mid-decode (its fourth token's chunk aborted through the test-only fault hook on
    rank 0, stepped alone) aborts on every rank and answers an error, its neighbours untouched;
    then a prompt that begins with an earlier one is answered from the prefix cache (states
    kept on every rank), as a cold run answers it."""
    uvicorn, httpx = pytest.importorskip("uvicorn"), pytest.importorskip("httpx")
    from concurrent.futures import ThreadPoolExecutor

    from conftest import wait_until
    from hebrus import serve
    from hebrus.text import ByteTokenizer
    model = over_ranks(closing, "tiny", mode="fast", dtype=torch.float64)
    prompts = [f"Request {i}: once more unto the breach, dear friends, once more, or close the wall".encode()
               for i in range(4)]
    prompts.append(prompts[0] + b" up with our English dead")
    doomed = 2

    def fault(request):
        return "layers.1.qsa" if bytes(request.prompt) == prompts[doomed] and len(request.produced) == 3 else None
    app, scheduler = serve.build(model, "tiny", max_sessions=4, share_prefixes=True, fault=fault)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started), "the server did not start"

        def ask(i):
            return httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=PATIENCE,
                              json={"model": "tiny", "prompt": prompts[i].decode(), "max_tokens": 8, "temperature": 0})
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(ask, range(4)))
        replies.append(ask(4))
    finally:
        server.should_exit = True
        thread.join(10)
        scheduler.stop(drain_seconds=5)
    assert replies[doomed].status_code != 200 and "nonfinite" in replies[doomed].text
    assert scheduler.widest > 1                 # several requests' tokens in one pass over the ranks
    assert replies[4].json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    for i, reply in enumerate(replies):
        if i != doomed:
            decoder = ByteTokenizer().stream()
            ids = model.session().generate(list(prompts[i]), max_new_tokens=8)
            want = "".join(decoder.push(t) for t in ids) + decoder.flush()
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == want, i


def test_a_session_over_ranks_keeps_states_as_it_goes(closing):
    """`feed_keeping` and `feed_keeping_many` over ranks (what the prefix cache keeps): each kept
    state is a session on every rank, bit for bit what feeding its prefix gives (exact mode)."""
    model = over_ranks(closing, "tiny")
    ids = tokens(20, seed=5)
    s = model.session()
    _, kept = s.feed_keeping(ids, [7, 20])
    fed = model.session()
    fed.feed(ids[:7])
    assert kept[0].digests() == fed.digests() and kept[1].digests() == s.digests()
    other = model.session()
    [(_, more), (_, mine)] = hebrus.batching.feed_keeping_many([fed, other], [ids[7:12], ids[:3]], [[5], [2]])
    assert more[0].digests() == fed.digests() and torch.equal(more[0].feed([9]), fed.feed([9]))
    assert mine[0].frontier == 2 and other.frontier == 3


def test_what_cannot_be_split_is_refused_before_anything_runs(tmp_path, closing):
    with pytest.raises(hebrus.InvalidInput, match="tensor_parallel must be"):
        hebrus.load("tiny", tensor_parallel=0)
    with pytest.raises(hebrus.InvalidInput, match="rank_timeout"):
        hebrus.load("tiny", tensor_parallel=2, rank_timeout=-1)
    with pytest.raises(hebrus.InvalidInput, match="quantize must be one of"):
        hebrus.load("tiny", tensor_parallel=2, quantize="int3")
    with pytest.raises(hebrus.InvalidInput, match="rendezvous must be HOST:PORT"):
        hebrus.load("tiny", tensor_parallel=2, rendezvous="nowhere")
    from foreign import build
    with pytest.raises(hebrus.InvalidInput, match="kda layers: its heads \\(3\\) do not divide among 2 ranks"):
        hebrus.load(build("kimi_linear", tmp_path / "kimi")[0], tensor_parallel=2)
    with pytest.raises(hebrus.InvalidInput, match="gdn layers: its key heads \\(1\\) do not divide among 2"):
        hebrus.load(build("qwen3_5_moe", tmp_path / "moe")[0], tensor_parallel=2)
    model = over_ranks(closing, "tiny")            # and a model loads after refusals
    s = model.session()
    with pytest.raises(hebrus.InvalidInput, match="rank 5 does not exist"):
        with hebrus.inject("embed", "structural", rank=5):
            s.feed([1, 2])
    with pytest.raises(hebrus.InvalidInput, match="not available under tensor parallelism"):
        s.feed_prefix([1, 2], lambda logits: 1)
    with pytest.raises(hebrus.InvalidInput, match="not available on a tensor-parallel model"):
        model.with_mode("fast")
    with pytest.raises(hebrus.InvalidInput, match="one tensor-parallel model a process"):
        hebrus.load("tiny", tensor_parallel=2)
    with pytest.raises(hebrus.InvalidInput, match="steps only with the other ranks"):
        s.local.feed([1, 2])                    # rank 0's part alone: refused, not left waiting
    with pytest.raises(hebrus.InvalidInput, match="a worker's rank"):
        parallel.lose("embed", 0)
    with pytest.raises(hebrus.InvalidInput, match="not split over ranks"):
        with hebrus.inject("embed", "structural", rank=1):
            hebrus.load("tiny").session().feed([1, 2])
    assert s.feed([1, 2]).shape == (256,)


def test_a_kind_that_cannot_split_is_named(monkeypatch):
    from hebrus.layers.kind import KINDS
    from hebrus.layers.shard import shard_spec
    monkeypatch.setattr(type(KINDS["moe"]), "shards", "no")
    with pytest.raises(hebrus.InvalidInput, match="cannot be split over ranks yet \\(moe\\); kinds that can: "):
        shard_spec(hebrus.load("tiny").spec, 2)


def test_verify_runs_the_fault_matrix_on_every_rank():
    """`hebrus verify --tensor-parallel 2`: every stage x kind injected on each rank held, and
    the ranks within the dtype's tolerance of one rank (fast mode: one collective a stage)."""
    done = subprocess.run([sys.executable, "-m", "hebrus", "verify", "--model", "tiny", "--mode", "fast",
                           "--tensor-parallel", "2"], capture_output=True, text=True, timeout=PATIENCE,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "faults injected on rank 1 of 2" in done.stdout
    assert done.stdout.count("held") == 2 * 11 * 5             # two tables of 11 stages x 5 kinds
    assert " 0 failed" in done.stdout
