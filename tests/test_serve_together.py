"""How the server's decoding requests step together (`serve.together`): one batch re-made on any
change without graphs; with graphs, cohorts whose ended requests stay as ghosts, merged while the
newest is at least half the one before it. The cohort rules run here on the CPU (their batches
step eagerly; the CUDA test runs them from graphs), against each session stepped alone."""
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


def test_cohorts_keep_ghosts_merge_by_size_and_give_what_each_session_gives_alone(tiny_fast):
    model = tiny_fast
    together = Together(model, graphs=True)
    first = _asking(model, 4, seed=0)
    twins = {r.id: _twin(model, r) for r in first}
    live = list(first)
    _step_and_compare(together, model, live, twins, 0)
    assert [len(c.members) for c in together.cohorts] == [4] and together.made == 1

    first[1].ended = True                            # one of four ends: a ghost, the cohort stays
    live.remove(first[1])
    frontier = first[1].session.frontier
    _step_and_compare(together, model, live, twins, 1)
    assert together.made == 1 and first[1] in together.cohorts[0].members
    assert first[1].session.frontier == frontier + 1          # the ghost stepped (its dummy token)
    assert together.holds(first[1])

    newcomer = _asking(model, 1, seed=20)            # one joins: a cohort of its own (1 < 4 / 2)
    twins.update({r.id: _twin(model, r) for r in newcomer})
    live += newcomer
    _step_and_compare(together, model, live, twins, 2)
    assert [len(c.members) for c in together.cohorts] == [4, 1] and together.made == 2

    more = _asking(model, 2, seed=30)                # two more: [4, 2] merges (2 >= 4 / 2), ghost dropped
    twins.update({r.id: _twin(model, r) for r in more})
    live += more
    _step_and_compare(together, model, live, twins, 3)
    # [4 (one ghost), 1] and a new [2]: [1] and [2] merge, then [4] and [3], the ghost left out
    assert [len(c.members) for c in together.cohorts] == [6] and together.made == 5
    assert not together.holds(first[1])

    for r in first:                                  # the first cohort's requests all end
        r.ended = True
    live = [r for r in live if not r.ended]
    _step_and_compare(together, model, live, twins, 4)
    assert [len(c.members) for c in together.cohorts] == [3] and together.made == 6   # half were ghosts
    for step in range(5, 9):
        _step_and_compare(together, model, live, twins, step)
    assert sum(len(c.members) for c in together.cohorts) <= 2 * len(live)


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
    assert together.made == 2 and [len(c.members) for c in together.cohorts] == [2]
    together.let_go()
    assert not together.cohorts and not together.holds(asking[1])


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
