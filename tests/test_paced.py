"""A pass run a few stages at a time (`engine.paced`): the same work as in one call, whatever
runs between its stages; a failure in it is the one-call pass's."""
from __future__ import annotations

import pytest
import torch

import hebrus
from conftest import tokens
from hebrus.batching import feed_many
from hebrus.engine.paced import Paced, between_stages
from hebrus.errors import ChunkAborted


def _sessions(model, prompts):
    sessions = [model.session(decode="eager") for _ in prompts]
    for session, prompt in zip(sessions, prompts):
        session.feed(prompt)
    return sessions


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_a_pass_a_stage_at_a_time_is_the_pass_in_one_call_bit_for_bit(tiny, mode):
    """Chunks of three sessions fed a stage a turn, other sessions stepping between the stages,
    against forks fed the same chunks in one call: the same logits and the same states, bit for
    bit (the same work in the same order), and the sessions stepped between are what they are
    stepped alone."""
    model = tiny if mode == "exact" else tiny.with_mode("fast")
    feeding = _sessions(model, [tokens(5, seed=1), tokens(3, seed=2), tokens(9, seed=3)])
    twins = [s.fork() for s in feeding]
    stepping = _sessions(model, [tokens(4, seed=4), tokens(6, seed=5)])
    alone = [s.fork() for s in stepping]
    chunks = [tokens(7, seed=6), tokens(12, seed=7), tokens(1, seed=8)]
    paced = Paced(lambda: feed_many(feeding, chunks))
    turns = 0
    while not paced.advance(1):
        turns += 1
        feed_many(stepping, [turns % 50, (3 * turns) % 50])
        for twin, token in zip(alone, [turns % 50, (3 * turns) % 50]):
            twin.feed([token])
    assert turns >= len(model.stages) - 1 and paced.stages >= len(model.stages)
    results = paced.outcome()
    expected = feed_many(twins, chunks)
    for i, (got, want) in enumerate(zip(results, expected)):
        assert torch.equal(got, want), i
        assert feeding[i].frontier == twins[i].frontier and feeding[i].digest() == twins[i].digest(), i
    for session, twin in zip(stepping, alone):
        assert session.frontier == twin.frontier
        if mode == "exact":                 # (fast mode: a step of two is not one of one, bit for bit)
            assert session.digest() == twin.digest()


def test_a_session_that_aborts_mid_pass_fails_alone_and_the_fault_armed_where_the_pass_was_made_fires(tiny):
    """A fault armed (for one session) around the pass's making fires in it: that session aborts
    and publishes nothing, the other publishes, as in one call."""
    model = tiny.with_mode("fast")
    feeding = _sessions(model, [tokens(5, seed=1), tokens(6, seed=2)])
    before = (feeding[0].frontier, feeding[0].digest())
    stage = model.stages[len(model.stages) // 2].name
    with hebrus.inject(stage=stage, kind="nonfinite", session=feeding[0]):
        paced = Paced(lambda: feed_many(feeding, [tokens(4, seed=3), tokens(4, seed=4)]))
    while not paced.advance(2):
        pass
    first, second = paced.outcome()
    assert isinstance(first, ChunkAborted) and (feeding[0].frontier, feeding[0].digest()) == before
    assert isinstance(second, torch.Tensor) and feeding[1].frontier == 10
    feeding[0].feed([1])                    # its lock is free again: the pass let it go


def test_while_a_pass_waits_its_sessions_are_refused_and_the_callers_modes_are_its_own(tiny):
    """Between its stages the pass holds its sessions: a call on one is refused as busy, and
    changes nothing. torch's modes are the thread's: the pass runs in inference mode, its caller,
    meanwhile, in the modes it called `advance` in (a tensor it makes is an ordinary one)."""
    from hebrus.errors import InvalidInput
    model = tiny.with_mode("fast")
    session = _sessions(model, [tokens(5, seed=1)])[0]
    paced = Paced(lambda: feed_many([session], [tokens(4, seed=2)]))
    assert not paced.advance(1)
    with pytest.raises(InvalidInput, match="session busy"):
        session.feed([3])
    made = torch.zeros(2)
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled() and not made.is_inference()
    made += 1                               # (an inference tensor would refuse this here)
    with torch.no_grad():
        assert not paced.advance(1) and not torch.is_grad_enabled()
    assert torch.is_grad_enabled()
    paced.outcome()
    assert session.frontier == 9 and not torch.is_inference_mode_enabled()


def test_what_the_work_raises_comes_back_to_the_caller_and_advancing_asks_for_a_stage_at_least():
    stopped = []

    def work():
        between_stages()
        stopped.append(1)
        between_stages()
        raise KeyError("inside the pass")
    paced = Paced(work)
    with pytest.raises(ValueError, match="at least one stage"):
        paced.advance(0)
    assert not paced.advance(1) and stopped == [] and paced.stages == 1
    assert not paced.advance(1) and stopped == [1]
    assert paced.advance(1) and paced.done
    with pytest.raises(KeyError, match="inside the pass"):
        paced.outcome()
    assert paced.advance(3)                 # ended: advancing again does nothing


def test_between_stages_outside_a_paced_pass_does_nothing():
    between_stages()
    assert Paced(lambda: 7).outcome() == 7


def test_the_callers_modes_are_back_however_the_pass_stops_and_only_its_thread_advances_it():
    """A pass that ends inside an `advance` made under other modes than its first leaves the
    caller in the modes it called in; another thread may not advance it (and changes nothing);
    an interrupt inside the pass is raised in the caller at once."""
    import threading

    def work():
        with torch.inference_mode():
            between_stages()
        return 5
    paced = Paced(work)
    assert not paced.advance(1)
    refused = []
    thread = threading.Thread(target=lambda: refused.append(pytest.raises(RuntimeError, paced.advance, 1)))
    thread.start()
    thread.join()
    assert refused and "thread that made it" in str(refused[0].value) and paced.stages == 1
    with torch.inference_mode():
        assert paced.advance(1) and torch.is_inference_mode_enabled()
    assert not torch.is_inference_mode_enabled() and paced.outcome() == 5

    def interrupted():
        between_stages()
        raise KeyboardInterrupt
    paced = Paced(interrupted)
    paced.advance(1)
    with pytest.raises(KeyboardInterrupt):
        paced.advance(1)
