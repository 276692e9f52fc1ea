"""One-token steps from the static step plan (the work a CUDA graph captures), run uncaptured on
the CPU against the eager runner: same logits and state within fast mode's tolerance, the same
discrete choices, storage growth between plans, and failures that publish nothing."""
from __future__ import annotations

import pytest
import torch

from conftest import poisoned as with_nan_row
from conftest import tokens
from hebrus.errors import DeviceStatusError, InvalidInput, NonFiniteError
from hebrus.state.step import StepBatch

STEPS = 24


@pytest.fixture(scope="module")
def models(fast_models):
    return fast_models


def _state(session) -> dict[str, torch.Tensor]:
    image = session.image
    return {spec.name: image.value(spec.name).clone() for spec in image.specs}


def _decode(model, decode, prompt, steps, vocab):
    s = model.session(decode=decode)
    s.feed(prompt)
    ids = tokens(steps, seed=7, vocab=vocab)
    return s, [s.feed([t]) for t in ids]


def _close(a, b, name, tolerance=2e-5):
    if not a.is_floating_point():
        assert torch.equal(a, b), name
        return
    scale = max(float(b.abs().max()), 1.0)
    assert float((a - b).abs().max()) <= tolerance * scale, name


@pytest.mark.parametrize("name", ["tiny", "qwen3_5", "qwen3_5_moe"])
def test_planned_steps_match_eager(models, name):
    model = models[name]
    vocab = model.spec.vocab_size
    prompt = tokens(10, seed=3, vocab=vocab)     # row logs hold 16 rows: the steps grow them twice
    planned, got = _decode(model, "planned", prompt, STEPS, vocab)
    eager, want = _decode(model, "eager", prompt, STEPS, vocab)
    for step, (a, b) in enumerate(zip(got, want)):
        _close(a, b, f"logits of step {step}")
    assert planned.frontier == eager.frontier == len(prompt) + STEPS
    # rows 16 and 32 needed storage to grow: those steps ran eager, the others from the plan
    assert planned._steps.uncaptured == STEPS - 2
    a, b = _state(planned), _state(eager)
    for owner in b:
        _close(a[owner], b[owner], owner)
    if "moe" in model.spec.ffns:
        assert torch.equal(planned.image.rows("routes"), eager.image.rows("routes"))


def test_planned_steps_over_a_scattered_table_match_eager(models):
    """Two planned sessions growing in turn take blocks between each other's, so their tables
    are not runs of consecutive blocks: the plan gathers their rows through the table (not one
    view of the storage), and still steps as the eager runner does."""
    from hebrus.state.pool import first_of_run
    model = models["tiny"]
    vocab = model.spec.vocab_size
    pair = [model.session(decode="planned") for _ in range(2)]
    eager = [model.session(decode="eager") for _ in range(2)]
    for step in range(40):
        for i in range(2):
            token = tokens(1, seed=100 * i + step, vocab=vocab)
            _close(pair[i].feed(token), eager[i].feed(token), f"session {i}, step {step}")
    assert any(first_of_run(s.image.public.table) is None for s in pair)
    assert all(s._steps.uncaptured > 30 for s in pair)       # most steps ran from the plan
    for s, e in zip(pair, eager):
        a, b = _state(s), _state(e)
        for owner in b:
            _close(a[owner], b[owner], owner)


def test_a_nan_step_publishes_nothing_and_the_next_step_is_clean(models):
    """A real NaN (a token whose embedding row is NaN) aborts the planned step; its K/V rows
    past the frontier are wiped before the next step attends over the whole storage."""
    model = models["qwen3_5"]
    bad = 5
    poisoned = with_nan_row(model, bad)
    prompt = tokens(10, seed=3, vocab=model.spec.vocab_size - 1)
    prompt = [t if t != bad else bad + 1 for t in prompt]
    s = poisoned.session(decode="planned")
    s.feed(prompt)
    before, out = s.digest(), torch.full((model.spec.vocab_size,), 7.0)
    with pytest.raises(NonFiniteError):
        s.feed([bad], out=out)
    assert s.digest() == before and torch.equal(out, torch.full_like(out, 7.0))
    assert s.image.tail_dirty
    after = s.feed([bad + 1])
    ref = poisoned.session(decode="eager")
    ref.feed(prompt)
    _close(after, ref.feed([bad + 1]), "logits after the aborted step")
    assert torch.isfinite(after).all()


def test_a_device_range_failure_publishes_nothing(models):
    """A token id past the vocabulary that reaches the device (the boundary check bypassed)
    sets the status bit inside the planned step; nothing is published."""
    model = models["tiny"]
    s = model.session(decode="planned")
    s.feed(tokens(4))
    before = s.digest()
    with pytest.raises(DeviceStatusError, match="token_range"):
        with torch.inference_mode():
            s._steps.step(torch.tensor([model.spec.vocab_size + 3]), None)
    assert s.digest() == before
    s.feed([1])                                     # and the session goes on


def test_decode_is_checked(tiny, models):
    with pytest.raises(InvalidInput, match="decode must be one of"):
        models["tiny"].session(decode="fastest")
    with pytest.raises(InvalidInput, match="runs exact mode"):
        tiny.session(decode="planned")
    with pytest.raises(InvalidInput, match="captures CUDA graphs"):
        models["tiny"].session(decode="graph")
    assert models["tiny"].session().decode == "eager"          # auto on the CPU


def test_a_replay_asks_the_budget_what_the_stages_asked(models):
    """`restart` (before each graph replay) hears the stages' requests as one: it refuses under
    exactly the budgets under which running the stages refuses."""
    from hebrus.engine.eager import run_stages, transaction
    from hebrus.errors import AllocationError
    model = models["tiny"]
    s = model.session(decode="planned")
    s.feed(tokens(5))

    def planned():
        return transaction(model, [s.image], [s.budget], [1], planned=True)

    def step(txn):
        return StepBatch.planned(torch.tensor([3]), txn.public["frontier"].view(1))

    with torch.inference_mode():
        txn = planned()
        run_stages(model, txn, step(txn))
        txn.restart()                                   # no limit: nothing refused
        needed = txn.parts[0].peak[0]
        assert needed > 0
        for limit, refused in ((s.budget.held + needed - 1, True), (s.budget.held + needed, False)):
            s.budget.limit = limit
            outcomes = []
            for attempt in (txn.restart, lambda: (lambda t: run_stages(model, t, step(t)))(planned())):
                try:
                    attempt()
                    outcomes.append(False)
                except AllocationError:
                    outcomes.append(True)
            assert outcomes == [refused, refused], (limit, outcomes)
    s.budget.limit = None
    s.budget.begin()
    s.feed([4])


def test_storage_growth_retires_the_plan_at_once(models):
    """An eager chunk that grows row storage drops whatever was captured for the old storage
    (here: the warm parities; on a GPU the graphs holding the old tensors) right after it."""
    model = models["qwen3_5"]
    s = model.session(decode="planned")
    s.feed(tokens(10, vocab=model.spec.vocab_size))          # 16 rows
    s.feed([1])
    s.feed([2])
    assert s._steps.warm == {0, 1}
    s.feed(tokens(10, seed=4, vocab=model.spec.vocab_size))  # eager, grows to 32 rows
    assert s._steps.warm == set() and not s._steps.graphs
    s.feed([3])
    assert s._steps.uncaptured == 3
