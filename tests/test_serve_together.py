"""How the server's decoding requests step together (`serve.together`): one batch, made again
on any change without graphs; with graphs, an ended request stays as a ghost until a request
joins or half are ghosts. The rules run here on the CPU (the batch steps eagerly; the CUDA test
runs it from graphs), against each session stepped alone."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
import torch

from conftest import tokens
from hebrus.serve.together import GHOST_TOKEN, Together

_ids = itertools.count()


@dataclass
class Asking:
    session: object
    id: int = field(default_factory=_ids.__next__)
    ended: bool = False


def _asking(model, n, seed):
    out = []
    for i in range(n):
        s = model.session(decode="eager")
        s.feed(tokens(5 + i, seed=seed + i))
        out.append(Asking(s))
    return out


def _twin(model, request):  # noqa: ARG001
    """A session at the same state as `request`'s, to step alone."""
    return request.session.fork(copy_rows=True)


def _step_and_compare(together, model, live, twins, step):
    chosen = {r.id: (7 * step + r.id) % model.spec.vocab_size for r in live}
    got = together.step(live, chosen)
    assert set(got) == {r.id for r in live}
    for r in live:
        want = twins[r.id].feed([chosen[r.id]])
        assert torch.allclose(got[r.id], want, atol=1e-5, rtol=1e-5), (step, r.id)


def test_ended_requests_stay_as_ghosts_until_one_joins_and_each_gets_what_it_gets_alone(tiny_fast):
    model = tiny_fast
    together = Together(model, graphs=True)
    first = _asking(model, 4, seed=0)
    twins = {r.id: _twin(model, r) for r in first}
    live = list(first)
    _step_and_compare(together, model, live, twins, 0)
    assert len(together.members) == 4 and together.made == 1

    first[1].ended = True                            # one of four ends: a ghost, the batch stays
    live.remove(first[1])
    frontier = first[1].session.frontier
    _step_and_compare(together, model, live, twins, 1)
    assert together.made == 1 and together.holds(first[1])
    assert first[1].session.frontier == frontier + 1          # the ghost stepped (its dummy token)

    newcomer = _asking(model, 1, seed=20)            # one joins: made again of the live ones
    twins.update({r.id: _twin(model, r) for r in newcomer})
    live += newcomer
    _step_and_compare(together, model, live, twins, 2)
    assert together.made == 2 and len(together.members) == 4 and not together.holds(first[1])

    for r in first[2:]:                              # two of four end: half are ghosts, made again
        r.ended = True
    live = [r for r in live if not r.ended]
    _step_and_compare(together, model, live, twins, 3)
    assert together.made == 3 and len(together.members) == 2
    for step in range(4, 8):
        _step_and_compare(together, model, live, twins, step)
    assert together.made == 3


def test_a_request_still_running_but_stepping_alone_is_never_a_ghost(tiny_fast):
    """A request left out of a turn while it still runs (the fault hook steps it alone) must not
    be stepped by its cohort too: its cohort is made again without it."""
    model = tiny_fast
    together = Together(model, graphs=True)
    asking = _asking(model, 4, seed=40)
    together.step(asking, {r.id: 1 for r in asking})
    alone = asking[2]
    frontier = alone.session.frontier
    together.step([r for r in asking if r is not alone], {r.id: 2 for r in asking})
    assert alone.session.frontier == frontier and not together.holds(alone)


def test_a_ghost_that_cannot_step_in_place_is_let_go(tiny_fast):
    model = tiny_fast
    together = Together(model, graphs=True)
    asking = _asking(model, 2, seed=50)
    together.step(asking, {r.id: 1 for r in asking})
    ghost = asking[0]
    ghost.ended = True
    held = ghost.session.fork()                     # its rows now shared: a step would copy them
    assert not ghost.session.image.room()
    together.step(asking[1:], {asking[1].id: 3})
    assert not together.holds(ghost) and held.frontier == ghost.session.frontier


def test_without_graphs_one_batch_is_made_again_on_any_change(tiny_fast):
    model = tiny_fast
    together = Together(model, graphs=False)
    asking = _asking(model, 3, seed=60)
    together.step(asking, {r.id: 1 for r in asking})
    together.step(asking, {r.id: 2 for r in asking})
    assert together.made == 1
    asking[0].ended = True
    together.step(asking[1:], {r.id: 3 for r in asking[1:]})
    assert together.made == 2 and len(together.members) == 2
    together.let_go()
    assert together.batch is None and not together.holds(asking[1])


def test_a_batch_that_cannot_step_is_let_go_with_no_request_stepped(tiny_fast):
    """Something other than one session's abort (here a session already at its context limit)
    raises out of the step; no request has been stepped, so the caller may step each alone."""
    model = tiny_fast
    together = Together(model, graphs=True)
    asking = _asking(model, 2, seed=70)
    full = model.session(decode="eager")
    full.feed(tokens(model.spec.max_context, seed=71))
    asking.append(type(asking[0])(full))
    frontiers = [r.session.frontier for r in asking]
    with pytest.raises(Exception):
        together.step(asking, {r.id: 1 for r in asking})
    assert together.batch is None and [r.session.frontier for r in asking] == frontiers


def test_the_ghost_token_is_in_every_vocabulary():
    assert GHOST_TOKEN == 0


@pytest.mark.parametrize("graphs", [False, True])
def test_the_server_with_requests_ending_at_different_times_answers_as_sessions_alone(tiny_fast, graphs):
    """Requests of different lengths arriving together, so they end at different turns (ghosts,
    merges); each greedy answer is what its session gives alone, and a later turn from a kept
    conversation (copied out of a ghost) too."""
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import KEYS, Server, _greedy
    server = Server(tiny_fast, max_sessions=8)
    server.scheduler.together = Together(tiny_fast, graphs=graphs)
    try:
        client = server.client()

        def ask(i):
            return client.completions.create(model="tiny", prompt=f"Speak {i}, speak", max_tokens=3 + 4 * i,
                                             temperature=0).choices[0].text
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
        for i, text in enumerate(answers):
            assert text == _greedy(tiny_fast, f"Speak {i}, speak".encode(), 3 + 4 * i, temperature=0.0), i
        assert server.scheduler.together.widest > 1
        opening = list(b"Speak 2, speak")             # token ids: a random model's bytes are not always text
        follow = opening + list(tiny_fast.session().generate(opening, max_new_tokens=11)) + list(b" more")
        again = server.client(KEYS[0]).completions.create(model="tiny", prompt=follow, max_tokens=6, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == len(opening) + 11
        assert again.choices[0].text == _greedy(tiny_fast, bytes(follow), 6, temperature=0.0)
    finally:
        server.close()


@pytest.mark.parametrize("join_turns", [16, 1])
def test_with_graphs_requests_wait_to_join_while_prompts_are_fed_and_answer_as_alone(tiny_fast, join_turns):
    """The engine loop's turns by hand, with the graph rules: a request whose prompt is fed sends
    its first token at once but joins the batch only when no prompt is left to feed (one remade
    batch for the burst) or after `join_turns` turns; each greedy answer is its session's alone."""
    from hebrus.sampling import Sampling
    from hebrus.serve.scheduler import Request, Scheduler
    model = tiny_fast
    scheduler = Scheduler(model, chunk_size=8, prefill_tokens=8, join_turns=join_turns)
    scheduler.together = Together(model, graphs=True)
    got = {}

    def asking(n, tag):
        got[tag] = []
        return Request(key="", prompt=tokens(n, seed=n), max_tokens=8, sampling=Sampling(temperature=0.0),
                       seed=0, stop_ids=frozenset(),
                       emit=lambda kind, value: got[tag].append(value) if kind == "token" else None, keep=False)
    running, first, second = asking(3, "running"), asking(12, "first"), asking(20, "second")
    scheduler.running = [running]
    scheduler._turn()
    scheduler.running += [first, second]
    made = []
    for turn in range(12):
        scheduler._turn()
        made.append(scheduler.together.made)
    # turn 1 feeds the first prompt's 8, turn 2 its last 4 (its first token goes out), turns 2-4
    # the second's; with 16 turns to wait, both join at turn 4, when no prompt is left to feed
    if join_turns == 16:
        assert made[:5] == [1, 1, 1, 2, 2] and first.held == 2 and second.held == 0
    else:
        assert made[:5] == [1, 1, 2, 3, 3] and first.held == 1
    for tag, request in (("running", running), ("first", first), ("second", second)):
        assert request.ended and request.pending is None
        assert got[tag] == list(model.session().generate(request.prompt, max_new_tokens=8, temperature=0.0)), tag
