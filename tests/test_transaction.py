"""A failed chunk publishes nothing: for every stage × fault kind, and for real failures."""
import gc

import pytest
import torch

import hebrus
from hebrus.state.pool import Pool
from conftest import tokens
from hebrus.state.image import Image

WARM, CHUNK = tokens(7, seed=11), tokens(9, seed=12)
STAGES = hebrus.load("tiny").stage_names
SENTINEL = 4242.0


@pytest.fixture(scope="module")
def references(tiny, tiny_fast):
    """Digest and logits after WARM + CHUNK with nothing failing, per mode."""
    out = {}
    for model in (tiny, tiny_fast):
        s = model.session()
        s.feed(WARM)
        logits = s.feed(CHUNK)
        out[model.mode] = (s.digest(), logits)
    return out


def _warm_session(model, **kw):
    s = model.session(**kw)
    s.feed(WARM)
    return s


def _assert_held(s, before, frontier, sentinel):
    assert s.digest() == before, "public state changed"
    assert s.frontier == frontier, "frontier moved"
    assert bool((sentinel == SENTINEL).all()), "caller's buffer was written"


@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("kind", hebrus.FAULT_KINDS)
@pytest.mark.parametrize("stage", STAGES)
def test_injected_fault_publishes_nothing_and_the_next_chunk_is_unaffected(tiny, stage, kind, mode, references):
    model = tiny.with_mode(mode) if mode != tiny.mode else tiny
    s = _warm_session(model)
    before, frontier = s.digest(), s.frontier
    sentinel = torch.full((256,), SENTINEL)
    with pytest.raises(hebrus.ChunkAborted) as info:
        with hebrus.inject(stage=stage, kind=kind):
            s.feed(CHUNK, out=sentinel)
    assert (info.value.kind, info.value.stage) == (kind, stage)
    assert isinstance(info.value, hebrus.errors.ERROR_CLASSES[kind])
    _assert_held(s, before, frontier, sentinel)
    digest, logits = references[mode]
    again = s.feed(CHUNK, out=sentinel)
    assert s.digest() == digest
    assert torch.equal(again, logits) and torch.equal(sentinel, logits)


def test_fault_fires_once_then_the_block_is_harmless(tiny):
    s = tiny.session()
    with hebrus.inject(stage="head", kind="nonfinite") as fault:
        with pytest.raises(hebrus.NonFiniteError):
            s.feed([1, 2])
        s.feed([1, 2])
    assert fault.fired and s.frontier == 2


def test_unknown_fault_kind_and_stage_are_rejected(tiny):
    with pytest.raises(ValueError, match="kinds are"):
        with hebrus.inject(stage="head", kind="meteor"):
            pass
    s = tiny.session()
    with pytest.raises(hebrus.InvalidInput, match="stages are"):
        with hebrus.inject(stage="layers.9.gdn", kind="status"):
            s.feed([1])
    assert s.frontier == 0


# ---- real failures, not injected ------------------------------------------------------------

def _model_with(tiny, **overrides):
    """A model whose weights go bad after loading (loading itself refuses non-finite weights)."""
    model = hebrus.Model(tiny.config, {k: v.clone() for k, v in tiny.named_parameters()}, mode=tiny.mode)
    params = dict(model.named_parameters())
    for name, fill in overrides.items():
        params[name].view(-1)[0] = fill
    return model


def test_real_nan_in_a_layer_is_caught_at_that_layer(tiny):
    model = _model_with(tiny, **{"layers.2.gdn.out_proj.weight": float("inf")})
    s = model.session()
    before = s.digest()
    sentinel = torch.full((256,), SENTINEL)
    with pytest.raises(hebrus.NonFiniteError) as info:
        s.feed(CHUNK, out=sentinel)
    assert info.value.stage == "layers.2.gdn"
    _assert_held(s, before, 0, sentinel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_finite_checks_largest_magnitudes_are_the_infinity_norm(dtype):
    """What a finite check reduces each written tensor to (on the CPU the max of the absolute
    values, elsewhere the ∞-norm): the ∞-norm's value, non-finite exactly when a value is, and a
    tensor of the dtype's largest finite values finite."""
    from hebrus.state.status import _norms
    g = torch.Generator().manual_seed(5)
    big = torch.finfo(dtype).max
    cases = [torch.randn(7, 33, generator=g).to(dtype), torch.randn(40, 3, generator=g).to(dtype)[::2],
             torch.full((5,), big, dtype=dtype), torch.full((5,), -big, dtype=dtype), torch.tensor(-2.5, dtype=dtype)]
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(9, generator=g).to(dtype)
        t[4] = bad
        cases.append(t)
    order, vectors = _norms(cases)
    assert sorted(order) == list(range(len(cases))) and len(vectors) == 2    # the strided case apart
    assert all(v.dim() == 1 and v.dtype == dtype for v in vectors)
    for t, n in zip([cases[i] for i in order], torch.cat(vectors)):
        want = t.double().abs().max()
        assert bool(torch.isfinite(n)) == bool(torch.isfinite(t).all())
        if bool(torch.isfinite(t).all()):
            assert float(n) == float(want)


def test_real_exception_inside_a_stage_is_structural(tiny, monkeypatch):
    s = _warm_session(tiny)
    before = s.digest()
    qsa = next(st for st in tiny.stages if st.name == "layers.3.qsa")

    def broken(*args, **kwargs):
        raise ValueError("shape mismatch deep inside")

    monkeypatch.setattr(qsa, "attn", broken)
    with pytest.raises(hebrus.StructuralError, match="shape mismatch") as info:
        s.feed(CHUNK)
    assert info.value.stage == "layers.3.qsa"
    assert s.digest() == before


def test_real_memory_error_inside_a_stage_is_an_allocation_failure(tiny, monkeypatch):
    s = _warm_session(tiny)
    before = s.digest()
    ffn = next(st for st in tiny.stages if st.name == "layers.0.ffn")
    monkeypatch.setattr(ffn.feed.moe, "route", lambda h, start: (_ for _ in ()).throw(MemoryError("no room")))
    with pytest.raises(hebrus.AllocationError) as info:
        s.feed(CHUNK)
    assert info.value.stage == "layers.0.ffn" and s.digest() == before


def test_memory_budget_refuses_growth_and_leaves_storage_alone(tiny):
    """A budget with room for one block of rows and a token's intermediates: one token at a time
    fills the block, then the chunk that needs a second block is refused, taking nothing."""
    block = Pool.block_bytes(tiny.owners, tiny.pool.block_rows)
    s = tiny.session(memory_budget=Pool.slot_bytes(tiny.owners) + 2 * block - 1)
    unlimited = tiny.session()
    for t in tokens(16, seed=3):
        assert torch.equal(s.feed([t]), unlimited.feed([t]))
    gc.collect()                                          # no other session's blocks come back meanwhile
    table, free, before = s.image.public.table, tiny.pool.free_blocks, s.digest()
    assert len(table) == 1 and before == unlimited.digest()
    with pytest.raises(hebrus.AllocationError, match=r"1 block of 16 rows") as info:
        s.feed([1])
    assert info.value.stage == "layers.0.ffn"             # the first stage to write rows (the routes)
    assert s.image.public.table == table and s.digest() == before and tiny.pool.free_blocks == free


def test_session_budget_smaller_than_its_banks_is_refused_up_front(tiny):
    with pytest.raises(ValueError, match="memory_budget"):
        tiny.session(memory_budget=100)


def test_device_status_bit_from_an_out_of_range_id(tiny):
    """Bypass input validation to show the device-side check: the id is flagged (and clamped so
    the gather stays in bounds), and validation turns the bit into an error."""
    s = _warm_session(tiny)
    before = s.digest()
    with pytest.raises(hebrus.DeviceStatusError, match="token_range") as info:
        s._transact(torch.tensor([3, 256, 4]), None)
    assert info.value.stage == "embed" and s.digest() == before


def test_ple_checks_the_token_range_itself(tiny, monkeypatch):
    """Every stage that indexes checks its own range: with the embed stage's check gone, the
    out-of-range id is still caught by the PLE stage, and nothing is published."""
    s = _warm_session(tiny)
    before = s.digest()
    embed = next(st for st in tiny.stages if st.name == "embed")
    def unchecked(txn, step):
        step.streams = embed.table[step.ids.clamp(0, 255)].unsqueeze(1).expand(-1, 4, -1).contiguous()
    monkeypatch.setattr(embed, "run", unchecked)
    with pytest.raises(hebrus.DeviceStatusError, match="token_range") as info:
        s._transact(torch.tensor([3, 256, 4]), None)
    assert info.value.stage == "ple" and s.digest() == before


def test_device_status_bit_from_an_out_of_range_route(tiny, monkeypatch):
    s = _warm_session(tiny)
    before = s.digest()
    ffn = next(st for st in tiny.stages if st.name == "layers.1.ffn")
    real = ffn.feed.moe.route
    monkeypatch.setattr(ffn.feed.moe, "route", lambda h, start: (real(h, start)[0], real(h, start)[1] + 100))
    with pytest.raises(hebrus.DeviceStatusError, match="route_range") as info:
        s.feed(CHUNK)
    assert info.value.stage == "layers.1.ffn" and s.digest() == before


def test_banked_owner_left_unwritten_is_a_structural_error(tiny, monkeypatch):
    s = _warm_session(tiny)
    before = s.digest()
    gdn = next(st for st in tiny.stages if st.name == "layers.2.gdn")

    class Forgetful:
        def __init__(self, txn):
            self._txn = txn

        def __getattr__(self, name):
            return getattr(self._txn, name)

        def write(self, name, value):
            if not name.endswith("recurrent"):
                self._txn.write(name, value)

    run = gdn.run
    monkeypatch.setattr(gdn, "run", lambda txn, step: run(Forgetful(txn), step))
    with pytest.raises(hebrus.StructuralError, match="layers.2.gdn.recurrent") as info:
        s.feed(CHUNK)
    assert info.value.stage == "validate" and s.digest() == before


# ---- the mechanism --------------------------------------------------------------------------

def test_exactly_one_publication_per_successful_chunk(tiny, monkeypatch):
    calls = []
    real = Image.publish
    monkeypatch.setattr(Image, "publish", lambda self, record: (calls.append(record), real(self, record)))
    s = tiny.session()
    s.feed([1, 2, 3])
    with pytest.raises(hebrus.ChunkAborted):
        with hebrus.inject(stage="head", kind="status"):
            s.feed([4])
    s.prefill(tokens(10), chunk_size=4)
    assert len(calls) == 1 + 3
    assert [r.frontier for r in calls] == [3, 7, 11, 13]


def test_banks_ping_pong_without_copies(tiny):
    s = tiny.session()
    banks = [dict(b) for b in s.image.banks]
    s.feed([1])
    assert s.image.public.bank == 1
    s.feed([2])
    assert s.image.public.bank == 0
    for old, new in zip(banks, s.image.banks):
        assert all(old[k] is new[k] for k in old), "bank tensors are reused, never reallocated"


def test_failed_growth_keeps_old_storage_public(tiny):
    s = tiny.session()
    s.feed(tokens(10))
    gc.collect()                                          # no other session's blocks come back meanwhile
    table, free = s.image.public.table, tiny.pool.free_blocks
    with pytest.raises(hebrus.NonFiniteError):
        with hebrus.inject(stage="layers.3.ffn", kind="nonfinite"):
            s.feed(tokens(40, seed=9))                    # needs more blocks than the table has
    assert s.image.public.table == table and len(table) * tiny.pool.block_rows < 50
    assert tiny.pool.free_blocks == free                  # the blocks it took went back


def test_public_tensors_are_not_written_by_a_failing_chunk(tiny):
    s = _warm_session(tiny)
    public = {k: v.clone() for k, v in s.image.banks[s.image.public.bank].items()}
    rows = {spec.name: s.image.rows(spec.name) for spec in s.image.appended}
    with pytest.raises(hebrus.ChunkAborted):
        with hebrus.inject(stage="head", kind="command"):
            s.feed(CHUNK)
    for k, v in s.image.banks[s.image.public.bank].items():
        assert torch.equal(v, public[k]), k
    for name, old in rows.items():
        assert torch.equal(s.image.rows(name), old), name


def test_float64_faults_hold_too(tiny64):
    s = tiny64.session()
    s.feed(WARM)
    before = s.digest()
    for kind in hebrus.FAULT_KINDS:
        with pytest.raises(hebrus.ChunkAborted):
            with hebrus.inject(stage="layers.1.qsa", kind=kind):
                s.feed(CHUNK)
        assert s.digest() == before


def test_every_step_context_offers_what_stages_use(tiny_fast):
    """A transaction (of one session and of several) and the bench's in-place contexts all
    satisfy StepContext."""
    from hebrus.bench import InPlaceSession, _InPlaceContext, _InPlaceLanes
    from hebrus.engine.graphs import Inputs
    from hebrus.engine.eager import transaction
    from hebrus.state.context import StepContext
    s, other = tiny_fast.session(), tiny_fast.session()
    txn = transaction(tiny_fast, [s.image], [s.budget], [1])
    several = transaction(tiny_fast, [s.image, other.image], [s.budget, other.budget], [1, 3])
    inplace = InPlaceSession(tiny_fast)
    ids = torch.tensor([1])
    from hebrus.training import SequenceContext
    contexts = [txn, several, _InPlaceContext(inplace, ids, 0),
                _InPlaceLanes(tiny_fast.pool, Inputs(tiny_fast.pool, 2, 1, 8, False).step), SequenceContext(tiny_fast.spec, ids, torch.float32)]
    assert all(isinstance(c, StepContext) for c in contexts)
    txn.abort()
    several.abort()


@pytest.mark.parametrize("defer", [False, True])
def test_several_sessions_checks_say_each_sessions_own(defer):
    """The checks of a step of four sessions, folded (both bounds of a range in one reduction, a
    sum per tensor): each session hears of its own non-finite value or index out of range, and of
    nothing in another's row, whichever way a tensor comes (a row per session, a token's rows, a
    tensor named for one session)."""
    from hebrus.state.status import DeviceChecks
    checks = DeviceChecks(defer=defer, lengths=[1, 1, 1, 1])
    per_session = torch.zeros(4, 3, 5)
    per_session[2, 1, 4] = float("nan")                                        # session 2's row
    tokens = torch.zeros(4, 7, dtype=torch.bfloat16)
    tokens[3, 0] = float("inf")                                                # session 3's token
    strided = torch.zeros(5, 4).t()                                            # rows not contiguous
    strided[0, 2] = float("-inf")                                              # session 0's
    named = torch.zeros(6)
    named[1] = float("nan")                                                    # named for session 1
    checks.finite(0, [(per_session, None), (tokens, None)])
    checks.finite(1, [(strided, None), (named, 1)])
    indices = torch.tensor([[0, 1], [2, 9], [3, -1], [4, 4]])                   # session 1 past, 2 below
    checks.check_range(2, indices, 9, 1 << 3)
    checks.check_range(3, torch.tensor([8, 0, 0, 0]), 9, 1 << 4, lower=None)   # a row each, no lower bound
    checks.flag(4, torch.tensor([False, False, False, True]), 1 << 5)
    read = checks.read()
    assert [nonfinite for _, nonfinite in read] == [{1}, {1}, {0}, {0}]
    assert [words for words, _ in read] == [{}, {2: 1 << 3}, {2: 1 << 3}, {4: 1 << 5}]


def test_a_ragged_steps_checks_by_token_say_each_sessions_own_cells():
    """Tensors of a row per token in a step of sessions of 2, 1 and 3 tokens, written at several
    stages (cells) and added up by session together when the checks fold: each session hears of
    the cells where its own tokens wrote a non-finite value, in whatever order the cells came,
    beside a tensor of a row per session and one named for a session."""
    from hebrus.state.status import DeviceChecks
    checks = DeviceChecks(lengths=[2, 1, 3])
    first = torch.zeros(6, 4)
    first[1, 2] = float("nan")                                                 # session 0's second token
    second = torch.zeros(6, 2, 3, dtype=torch.bfloat16)
    second[5, 1, 0] = float("inf")                                             # session 2's last token
    third = torch.zeros(6, 3)
    third[2, 0] = float("-inf")                                                # session 1's token
    per_session = torch.zeros(3, 5)
    per_session[2, 4] = float("nan")
    checks.finite(7, [(first, None), (per_session, None)])
    checks.finite(2, [(second, None)])
    checks.finite(4, [(third, None), (torch.tensor([float("nan")]), 0)])
    assert [nonfinite for _, nonfinite in checks.read()] == [{7, 4}, {4}, {2, 7}]


def test_checks_joined_keep_their_order_whatever_their_mix():
    """The fold's values, whatever their mix (scalars and vectors; rows of several sessions;
    float32, bfloat16 and int64, in runs or interleaved), come out as the stacked values in
    float64, in order; a run in one copy (each run of one dtype)."""
    from hebrus.state.status import joined
    together = torch.tensor([1.5, float("nan"), -2.0, 4.0])
    half = torch.tensor([0.25, float("inf")], dtype=torch.bfloat16)
    apart = [torch.tensor(7, dtype=torch.int64), torch.tensor(-3.0)]
    mixes = [list(together.unbind()), [*together.unbind(), *apart, *half.unbind()],
             [apart[0], *together[1:3].unbind(), apart[1], together[0]],        # a run inside, a lone one from it
             [*half.unbind(), *together.unbind()], apart, [together[3]],
             [torch.arange(3.0), torch.arange(3.0) + 1],                         # rows: stacked, flattened
             [torch.arange(3.0), together, half, torch.tensor([9.0])]]           # one session's vector per launch
    for values in mixes:
        want = torch.cat([v.reshape(-1).to(torch.float64) for v in values])
        got = joined(values)
        assert got.dtype == torch.float64 and torch.equal(got.nan_to_num(), want.nan_to_num())
        assert torch.equal(got.isnan(), want.isnan())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [1, 3])
def test_rows_reduced_together_give_each_sessions_least_and_largest_value(dtype, count):
    """The reduction of a group of row tensors is each session's least and largest value over
    all of them, exactly as the whole stack reduced at once, with a NaN, an infinity or a
    lone non-finite tensor in one session's rows."""
    from hebrus.state.status import _least_largest
    g = torch.Generator().manual_seed(count)
    rows = [torch.randn(4, 33, generator=g).to(dtype) for _ in range(count)]
    rows[-1][1, 32] = float("nan")
    rows[0][2, 0] = float("-inf")
    rows[count // 2][3, 5] = float("inf")
    got = _least_largest(rows)
    whole = torch.stack(rows)
    want = torch.stack((whole.amin(dim=(0, 2)), whole.amax(dim=(0, 2))))
    assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert got[:, 1].isnan().all() and got[0, 2] == float("-inf") and got[1, 3] == float("inf")


def test_rows_reduced_together_are_traced_to_their_stages():
    """Tensors of a row per session, of one dtype and row length, are reduced together; a
    non-finite result is traced to the stages whose tensors hold the value in that session's row
    (two stages at once, when both do), and to every stage of the reduction if the values are
    gone by the time they are read."""
    from hebrus.state.status import DeviceChecks
    checks = DeviceChecks(defer=True, lengths=[1, 1, 1])
    a, b, c = torch.zeros(3, 4), torch.zeros(3, 2, 2), torch.zeros(3, 6, dtype=torch.bfloat16)
    a[1, 3] = b[1, 0, 1] = float("inf")
    c[2, 5] = float("nan")
    checks.finite(0, [(a, None)])
    checks.finite(1, [(b, None), (c, None)])
    checks.finite(2, [(torch.zeros(3, 4), None), (torch.zeros(3, 5), None)])
    checks.fold()
    assert len(checks._row_groups) == 3                      # float32 rows of 4 and of 5, bfloat16 rows of 6
    assert [nonfinite for _, nonfinite in checks.read()] == [set(), {0, 1}, {1}]
    a[1, 3] = b[1, 0, 1] = 0.0                                 # gone before the second look
    assert [nonfinite for _, nonfinite in checks.read()][1] == {0, 1, 2}
