"""The session API: bad input changes nothing and says what is allowed; prefill, generate, out=."""
import numpy as np
import pytest
import torch

import hebrus
from hebrus.state.pool import Pool
from conftest import tokens


@pytest.fixture
def warm(tiny):
    s = tiny.session()
    s.feed([10, 20, 30])
    return s


@pytest.mark.parametrize("bad,message", [
    ([], "empty chunk"),
    ([1, 256], r"token id 256 at index 1 is outside the vocabulary \[0, 256\)"),
    ([-1], "outside the vocabulary"),
    ([1.5], "must be integers; item 0 is 1.5"),
    ([True], "must be integers"),
    ("hello", "got text"),
    (torch.tensor([1.0, 2.0]), "dtype torch.float32"),
    (torch.tensor([[1, 2]]), "one-dimensional"),
    (np.array([0.5]), "integers"),
    ({1, 2}, "list of ints"),
    ([2**70], "int64"),
])
def test_bad_input_raises_before_anything_is_touched(warm, bad, message):
    before = warm.digest()
    with pytest.raises(hebrus.InvalidInput, match=message):
        warm.feed(bad)
    assert warm.digest() == before and warm.frontier == 3


def test_invalid_input_is_a_value_error():
    assert issubclass(hebrus.InvalidInput, ValueError)


def test_context_limit(tiny):
    small = hebrus.Model(tiny.config.replace(max_context=8), dict(tiny.named_parameters()))
    s = small.session()
    s.feed([1] * 6)
    with pytest.raises(hebrus.InvalidInput, match=r"past its context limit of 8 \(2 tokens left\)"):
        s.feed([1, 2, 3])
    with pytest.raises(hebrus.InvalidInput, match="context limit"):
        s.prefill([1, 2, 3])
    with pytest.raises(hebrus.InvalidInput, match="context limit"):
        s.generate([1], max_new_tokens=5)
    assert s.frontier == 6
    s.feed([1, 2])
    assert s.frontier == 8


def test_accepted_id_containers_agree(tiny):
    ids = [5, 6, 7]
    results = [tiny.session().feed(x) for x in (ids, tuple(ids), torch.tensor(ids), np.array(ids, dtype=np.int32))]
    assert all(torch.equal(r, results[0]) for r in results)


@pytest.mark.parametrize("out", [torch.zeros(255), torch.zeros(256, dtype=torch.float64), [0.0] * 256])
def test_bad_out_buffer_is_rejected_untouched(warm, out):
    before = warm.digest()
    with pytest.raises(hebrus.InvalidInput, match="out must"):
        warm.feed([1], out=out)
    assert warm.digest() == before


def test_out_buffer_receives_the_logits(warm):
    out = torch.zeros(256)
    returned = warm.feed([4, 5], out=out)
    assert returned is out and torch.equal(out, warm.logits)


def test_feed_returns_a_new_tensor_each_time(warm):
    a = warm.feed([1])
    b = warm.feed([2])
    assert a.data_ptr() != b.data_ptr() and not torch.equal(a, b)


def test_prefill_equals_feeding_the_chunks(tiny):
    ids = tokens(50, seed=8)
    a = tiny.session()
    logits = a.prefill(ids, chunk_size=16)
    b = tiny.session()
    for i in range(0, 50, 16):
        last = b.feed(ids[i:i + 16])
    assert a.digest() == b.digest() and torch.equal(logits, last)


def test_prefill_failure_reports_the_tokens_published(tiny, monkeypatch):
    s = tiny.session()
    stage = next(st for st in tiny.stages if st.name == "layers.2.gdn")
    real, calls = stage.run, []

    def third_call_fails(txn, step):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        real(txn, step)

    monkeypatch.setattr(stage, "run", third_call_fails)
    ids = tokens(50, seed=8)
    with pytest.raises(hebrus.StructuralError, match="32 tokens of earlier chunks were") as info:
        s.prefill(ids, chunk_size=16)
    assert info.value.published == 32 and s.frontier == 32
    monkeypatch.undo()
    ref = tiny.session()
    ref.feed(ids[:32])
    assert s.digest() == ref.digest()


@pytest.mark.parametrize("kwargs,message", [
    ({"chunk_size": 0}, "chunk_size"), ({"chunk_size": 2.5}, "chunk_size"),
])
def test_prefill_rejects_bad_chunk_size(tiny, kwargs, message):
    with pytest.raises(hebrus.InvalidInput, match=message):
        tiny.session().prefill([1, 2], **kwargs)


def test_generate_is_greedy_and_deterministic(tiny):
    a = list(tiny.session().generate([1, 2, 3], max_new_tokens=10))
    b = list(tiny.session().generate([1, 2, 3], max_new_tokens=10))
    assert a == b and len(a) == 10


def test_generate_commits_every_token_it_yields(tiny):
    s = tiny.session()
    out = list(s.generate([1, 2, 3], max_new_tokens=5))
    ref = tiny.session()
    ref.feed([1, 2, 3] + out)
    assert s.digest() == ref.digest() and s.frontier == 8


def test_generate_continues_an_existing_session(tiny):
    s = tiny.session()
    first = list(s.generate([1, 2, 3], max_new_tokens=4))
    more = list(s.generate([], max_new_tokens=4))
    whole = list(tiny.session().generate([1, 2, 3], max_new_tokens=8))
    assert first + more == whole


def test_sampling_uses_the_seed(tiny):
    runs = [list(tiny.session().generate([7], max_new_tokens=12, temperature=1.0, seed=s)) for s in (0, 0, 1)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_tiny_top_p_is_greedy(tiny):
    greedy = list(tiny.session().generate([7, 8], max_new_tokens=8))
    nucleus = list(tiny.session().generate([7, 8], max_new_tokens=8, temperature=0.7, top_p=1e-9, seed=3))
    assert greedy == nucleus


@pytest.mark.parametrize("kwargs,message", [
    ({"max_new_tokens": -1}, "max_new_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"chunk_size": 0}, "chunk_size"),
    ({"seed": 1.5}, "seed"),
])
def test_generate_checks_arguments_eagerly(tiny, kwargs, message):
    s = tiny.session()
    with pytest.raises(hebrus.InvalidInput, match=message):
        s.generate([1], **kwargs)
    with pytest.raises(hebrus.InvalidInput, match="empty chunk"):
        s.generate([])
    assert s.frontier == 0


def test_threads_feeding_one_session_serialise(tiny):
    import threading
    s = tiny.session()
    chunks = [[i, i + 1] for i in range(0, 40, 2)]
    threads = [threading.Thread(target=s.feed, args=(c,)) for c in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.frontier == 40
    assert s.image.rows("routes").shape[0] == 40     # every chunk published whole, none lost


def test_a_reservation_grows_row_logs_once_to_its_size():
    """`reserve=N`: the first chunk takes blocks for N rows at once; later chunks up to N take
    none; the state equals an unreserved session's; a budget that cannot hold the reservation
    takes blocks as needed instead."""
    model = hebrus.load("tiny")
    reserved, plain = model.session(reserve=300), model.session()
    blocks = model.pool.blocks_for(300)
    for chunk in ([1, 2, 3], list(range(40)), [7] * 100):
        reserved.feed(chunk)
        plain.feed(chunk)
        assert len(reserved.image.public.table) == blocks
    assert reserved.digest() == plain.digest()
    table = reserved.image.public.table
    reserved.feed(list(range(150)))
    assert reserved.image.public.table == table                              # 293 rows: no block taken
    block = Pool.block_bytes(model.owners, model.pool.block_rows)
    tight = model.session(reserve=300, memory_budget=model.session().budget.held + 5 * block)
    tight.feed([1, 2, 3])                       # the reservation is refused whole: one block, as needed
    assert len(tight.image.public.table) == 1 and tight.frontier == 3
    with pytest.raises(hebrus.InvalidInput, match=r"reserve must lie in \[0, 1024\]"):
        model.session(reserve=2000)
    with pytest.raises(hebrus.InvalidInput, match="reserve"):
        model.session(reserve=-1)


def test_a_reservation_never_makes_a_chunk_fail():
    """Reservations are asked for after every stage's own requests, each alone, and skipped when
    refused: at every budget where a plain session's chunk publishes, a reserved one's does too."""
    model = hebrus.load("tiny")
    probe = model.session()
    probe.feed([1, 2, 3])
    row_bytes = Pool.block_bytes(model.owners, model.pool.block_rows) // model.pool.block_rows
    held = model.session().budget.held
    published = 0
    for rows in range(0, 400, 13):
        outcome = {}
        for reserve in (0, 300):
            s = model.session(reserve=reserve, memory_budget=held + rows * row_bytes)
            try:
                s.feed([1, 2, 3])
                outcome[reserve] = s.digest()
            except hebrus.AllocationError:
                outcome[reserve] = None
        if outcome[0] is not None:
            published += 1
            assert outcome[300] == outcome[0], rows
    assert 0 < published < 31                   # the sweep crosses the budget where chunks start to fit


def test_sampling_many_at_once_equals_sampling_each_alone(monkeypatch):
    """`sample_many` (the greedy ones chosen by one argmax over their stack, the sampled ones by
    one distribution and one draw over theirs, each from its own generator) gives what `sample`
    gives each alone, ties to the smaller id included, and leaves each generator where `sample`
    leaves it; one it cannot sample from fails alone, the stack it would have joined too."""
    import hebrus.sampling
    from hebrus.sampling import Sampling, sample, sample_many
    gen = torch.Generator().manual_seed(4)
    logits = [torch.randn(50, generator=gen) for _ in range(7)]
    logits[2][[5, 9]] = 100.0                                   # a tie: the smaller id
    hows = [Sampling(), Sampling(temperature=0.8), Sampling(), Sampling(temperature=1.0, top_k=5),
            Sampling(), Sampling(), Sampling(temperature=0.5)]
    gens_alone = [torch.Generator().manual_seed(i) for i in range(7)]
    alone = [sample(x, h, g) for x, h, g in zip(logits, hows, gens_alone)]
    stacked = []
    real_stack = torch.stack
    monkeypatch.setattr(hebrus.sampling.torch, "stack", lambda xs: stacked.append(len(xs)) or real_stack(xs))
    gens_many = [torch.Generator().manual_seed(i) for i in range(7)]
    many = sample_many(logits, hows, gens_many)
    monkeypatch.undo()
    assert many == alone and many[2] == 5 and stacked == [4, 3]   # the greedy ones together, the sampled ones
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(gens_alone, gens_many))
    empty = torch.empty(0)
    broken = sample_many([logits[0], None, empty, empty, logits[1]], [Sampling()] * 5, [None] * 5)
    assert broken[0] == alone[0] and broken[4] == sample(logits[1], Sampling(), None)
    assert all(isinstance(b, Exception) for b in broken[1:4])


def test_distributions_and_draws_of_many_rows_are_each_rows_alone():
    """Every row of `distributions` and `draws` is what that row gets alone, bit for bit, for
    any mix of temperatures, top_k, top_p and min_p (each row's operations are its own)."""
    from hebrus.sampling import Sampling, distribution, distributions, draw, draws
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(12, 300, generator=gen) * 4
    logits[3, 7:] = float("-inf")                              # seven ids left
    hows = [Sampling(temperature=t, top_p=p, top_k=k, min_p=m)
            for t, p, k, m in zip([0.2, 1.0, 3.0] * 4, [1.0, 0.9, 0.3, 1.0] * 3, [0, 0, 3, 50] * 3,
                                  [0.0, 0.1, 0.0] * 4)]
    together = distributions(logits, hows)
    for b in range(12):
        assert torch.equal(together[b], distribution(logits[b], hows[b])), b
    seeds = range(100, 112)
    many = draws(together, [torch.Generator().manual_seed(s) for s in seeds])
    assert many == [draw(together[b], torch.Generator().manual_seed(s)) for b, s in enumerate(seeds)]
    assert many[3] < 7 and all(together[b, many[b]] > 0 for b in range(12))


def test_rows_that_need_no_order_are_what_the_sorted_filters_give():
    """Rows at any temperature with min_p but no top_k or top_p skip the sort: their weights
    are `by_order`'s (the sorted filters, the readable twin) bit for bit, a row with ties and
    one with ids ruled out included."""
    from hebrus.sampling import Sampling, by_order, distributions
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(6, 500, generator=gen) * 3
    logits[1, :40] = logits[1, 40]                             # ties at the top
    logits[2, 9:] = float("-inf")
    hows = [Sampling(temperature=t, min_p=m) for t, m in zip([0.3, 0.8, 1.0, 2.0, 0.8, 1.5],
                                                             [0.0, 0.2, 0.0, 0.05, 0.5, 0.0])]
    got = distributions(logits, hows)
    scaled = torch.stack([(row.double() - row.double().max()) / h.temperature for row, h in zip(logits, hows)])
    want = by_order(torch.softmax(scaled, dim=-1), hows)
    assert torch.equal(got, want)
    assert (got[2, 9:] == 0).all() and (got[4] == 0).any() and (got[0] > 0).all()


def test_a_prompt_is_fed_in_the_models_prefill_chunk_unless_told(tiny, monkeypatch):
    """`prefill`, `generate` and the text API feed a prompt in chunks of `model.prefill_chunk`
    (512 on a CPU) when no chunk size is named, and in the named one when it is; the state is
    the same either way (exact mode)."""
    fed = []
    original = hebrus.Session._transact

    def spy(self, ids, out):
        fed.append(len(ids))
        return original(self, ids, out)

    monkeypatch.setattr(hebrus.Session, "_transact", spy)
    assert tiny.prefill_chunk == 512
    prompt = [1 + i % 200 for i in range(600)]
    default, named = tiny.session(), tiny.session()
    default.prefill(prompt)
    assert fed == [512, 88]
    fed.clear()
    named.prefill(prompt, chunk_size=250)
    assert fed == [250, 250, 100] and named.digest() == default.digest()
    fed.clear()
    list(tiny.session().generate(prompt, max_new_tokens=2))
    assert fed == [512, 88, 1, 1]                   # each generated token is committed by its own
    fed.clear()
    list(tiny.session().generate_text("x" * 600, max_new_tokens=1, temperature=0))
    assert fed[0] == 512 and sum(fed[:-1]) == len(tiny.tokenizer.encode("x" * 600))
