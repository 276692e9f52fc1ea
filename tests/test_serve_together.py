"""How the server's decoding requests step together: each turn, one `Batch` of the sessions of
the requests decoding that turn. A request joins as soon as its prompt is fed and leaves when
it ends; nothing else is stepped. The engine loop's turns run here by hand on the CPU (fast
mode from the static step plan, uncaptured: the work a CUDA graph captures), against each
request run alone."""
from __future__ import annotations

import pytest
import torch

from conftest import tokens
from hebrus.sampling import Sampling
from hebrus.serve.scheduler import Request, Scheduler

# (prompt length, new tokens, turn it arrives at): prompts of 8 a turn are fed while others decode
ARRIVALS = [(3, 4, 0), (12, 9, 1), (20, 3, 1), (5, 6, 4), (9, 2, 6)]


def _asking(i: int, prompt: int, new: int, got: dict, key: str = "") -> Request:
    got[i] = []
    return Request(key=key, prompt=tokens(prompt, seed=prompt), max_tokens=new, sampling=Sampling(temperature=0.8),
                   seed=i, stop_ids=frozenset(), emit=lambda kind, value: got[i].append(value) if kind == "token" else None,
                   keep=bool(key))


def _turns(scheduler: Scheduler, got: dict, key: str = "", each_turn=None) -> list[Request]:
    """Run the loop's turns by hand, the requests of ARRIVALS arriving at their turns, until all
    have ended; `each_turn(requests)` is called after every turn."""
    requests = []
    for turn in range(100):
        requests += [_asking(i, p, n, got, key) for i, (p, n, at) in enumerate(ARRIVALS) if at == turn]
        scheduler.running += [r for r in requests if r.session is None and r not in scheduler.running]
        if not scheduler.running and len(requests) == len(ARRIVALS):
            return requests
        scheduler._turn()
        if each_turn is not None:
            each_turn(requests)
    raise AssertionError("the requests did not end")


def test_requests_joining_and_leaving_mid_run_each_get_what_they_get_alone(tiny):
    """Exact mode: every request's tokens are bit for bit what its session generates alone,
    whoever decodes beside it, turn after turn."""
    got = {}
    requests = _turns(Scheduler(tiny, chunk_size=8, prefill_tokens=8), got)
    for i, request in enumerate(requests):
        alone = tiny.session().generate(request.prompt, max_new_tokens=request.max_tokens, temperature=0.8, seed=i)
        assert got[i] == list(alone), i


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tolerance: float = 2e-5) -> None:
    scale = max(float(b.abs().max()), 1.0)
    assert float((a - b).abs().max()) <= tolerance * scale, what


def test_one_pass_steps_exactly_the_requests_decoding_and_none_that_ended(tiny_fast):
    """Fast mode from the plan: each turn with a request decoding runs one planned step, of the
    requests decoding that turn; a request that ended is never stepped again (its state stays
    as it left it), and its kept conversation is its own session. Each request's state is what
    an eager session fed the same tokens holds."""
    model = tiny_fast
    runner = model.steps(capture=False)
    scheduler = Scheduler(model, chunk_size=8, prefill_tokens=8, decode="planned")
    got, ended, widths = {}, {}, []

    def each_turn(requests):
        decoding = [r for r in requests if r.session is not None and len(r.produced) + (r not in scheduler.running) > 0]
        widths.append(runner.uncaptured)
        for r in requests:
            if r.session is not None and r not in scheduler.running and r.id not in ended:
                ended[r.id] = (r.session.frontier, r.session.digest())
            if r.id in ended:
                assert (r.session.frontier, r.session.digest()) == ended[r.id], r.id
        del decoding
    ran = runner.uncaptured
    requests = _turns(scheduler, got, key="key", each_turn=each_turn)
    turns_decoding = sum(1 for i in range(len(widths)) if widths[i] > (widths[i - 1] if i else ran))
    assert runner.uncaptured - ran == turns_decoding
    assert scheduler.widest == 3
    for i, request in enumerate(requests):
        session = request.session
        assert session.frontier == len(request.prompt) + len(got[i]) and got[i] == request.produced
        assert scheduler.kept.find("key", request.prompt + request.produced)[0] is session
        twin = model.session(decode="eager")
        _close(session.logits, twin.feed(request.prompt + request.produced), f"request {i}")


def test_the_server_with_requests_ending_at_different_times_answers_as_sessions_alone(tiny_fast):
    """Requests of different lengths arriving together, so they end at different turns; each
    greedy answer is what its session gives alone, and a later turn from a kept conversation
    too."""
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import KEYS, Server, _greedy
    server = Server(tiny_fast, max_sessions=8)
    try:
        client = server.client()

        def ask(i):
            return client.completions.create(model="tiny", prompt=f"Speak {i}, speak", max_tokens=3 + 4 * i,
                                             temperature=0).choices[0].text
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
        for i, text in enumerate(answers):
            assert text == _greedy(tiny_fast, f"Speak {i}, speak".encode(), 3 + 4 * i, temperature=0.0), i
        assert server.scheduler.widest > 1
        opening = list(b"Speak 2, speak")             # token ids: a random model's bytes are not always text
        follow = opening + list(tiny_fast.session().generate(opening, max_new_tokens=11)) + list(b" more")
        again = server.client(KEYS[0]).completions.create(model="tiny", prompt=follow, max_tokens=6, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == len(opening) + 11
        assert again.choices[0].text == _greedy(tiny_fast, bytes(follow), 6, temperature=0.0)
    finally:
        server.close()


def test_a_route_the_model_cannot_take_is_refused(tiny):
    from hebrus.errors import InvalidInput
    with pytest.raises(InvalidInput, match="planned"):
        Scheduler(tiny, decode="planned")
