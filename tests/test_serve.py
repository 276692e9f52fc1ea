"""`hebrus serve` driven by real clients over loopback: the official `openai` package (streaming
and not) and raw `httpx` for what a client library would never send. The engine's outputs are
compared with `Session.generate` (exact mode: the same tokens), a failing request is shown to
leave the others untouched, and every refusal is shown to change nothing."""
from __future__ import annotations

import json
import socket
from pathlib import Path
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import PATIENCE, wait_until
from hebrus import serve
from hebrus.sampling import Sampling

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

KEYS = ["key-a", "key-b"]


def _get(*args, **kwargs):
    return httpx.get(*args, timeout=PATIENCE, **kwargs)


def _post(*args, **kwargs):
    return httpx.post(*args, timeout=PATIENCE, **kwargs)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=PATIENCE).status_code == 200
    except httpx.TransportError:
        return False


class Server:
    """A server of `model` on a loopback port: its app and engine in this process, or with
    `split`, as `hebrus serve` runs them: the engine here, the front end in a process of its own."""

    def __init__(self, model, keys=KEYS, split: bool = False, **options):
        if split:
            import contextlib
            self.scheduler = serve.engine(model, **options)
            listening = socket.socket()
            listening.bind(("127.0.0.1", 0))
            self.port = listening.getsockname()[1]
            self.split = contextlib.ExitStack()
            self.front = self.split.enter_context(serve.fronted(self.scheduler, "tiny", listening, keys,
                                                                log_level="error"))
            listening.close()
            self.url = f"http://127.0.0.1:{self.port}"
            assert wait_until(lambda: _healthy(self.url), step=0.05), "the server did not start"
            return
        self.split = None
        self.app, self.scheduler = serve.build(model, "tiny", api_key=keys, **options)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        assert wait_until(lambda: self.server.started), "the server did not start"
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key: str = KEYS[0]):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=PATIENCE)

    def close(self):
        if self.split is not None:
            self.split.close()
            return
        self.server.should_exit = True
        self.thread.join(10)
        self.scheduler.stop(drain_seconds=5)


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(tiny)
    yield s
    s.close()


def _greedy(model, prompt: bytes, n: int, **sampling) -> str:
    from hebrus.text import ByteTokenizer
    decoder = ByteTokenizer().stream()
    ids = list(model.session().generate(list(prompt), max_new_tokens=n, **sampling))
    return "".join(decoder.push(t) for t in ids) + decoder.flush()


def test_health_models_and_metrics(server):
    assert _get(server.url + "/health").json() == {"status": "ok"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    text = _get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).text
    assert "hebrus_requests_total" in text and "hebrus_queue_depth" in text


def test_a_completion_is_what_the_session_generates(server, tiny):
    reply = server.client().completions.create(model="tiny", prompt="When shall we", max_tokens=12,
                                                temperature=0)
    assert reply.choices[0].text == _greedy(tiny, b"When shall we", 12, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == 13 and reply.usage.completion_tokens == 12
    sampled = server.client().completions.create(model="tiny", prompt="When shall we", max_tokens=12,
                                                  temperature=0.9, seed=7, extra_body={"top_k": 20})
    assert sampled.choices[0].text == _greedy(tiny, b"When shall we", 12, temperature=0.9, top_k=20, seed=7)


def test_chat_streams_what_it_answers_whole(server):
    client = server.client()
    messages = [{"role": "user", "content": "Who is there?"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    pieces, usage, reasons = [], None, []
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == whole.choices[0].message.content
    assert reasons[-1] == whole.choices[0].finish_reason == "length"
    assert usage.completion_tokens == whole.usage.completion_tokens == 10


def test_chat_takes_text_parts_and_refuses_what_it_cannot_do(server):
    url, auth = server.url + "/v1/chat/completions", {"Authorization": f"Bearer {KEYS[0]}"}
    parts = {"model": "tiny", "max_tokens": 3, "temperature": 0,
             "messages": [{"role": "user", "content": [{"type": "text", "text": "Who is "}, {"type": "text", "text": "there?"}]}]}
    plain = dict(parts, messages=[{"role": "user", "content": "Who is there?"}])
    a, b = _post(url, json=parts, headers=auth), _post(url, json=plain, headers=auth)
    assert a.status_code == b.status_code == 200
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]
    for bad, message in [({"role": "wizard", "content": "x"}, "role"), ({"role": "user", "content": 5}, "content"),
                         ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "content")]:
        reply = _post(url, json=dict(plain, messages=[bad]), headers=auth)
        assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text
    reply = _post(url, json=dict(plain, tools=[{"type": "function"}]), headers=auth)
    assert reply.status_code == 400 and "tools.0.function" in reply.json()["error"]["message"]
    weather = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    reply = _post(url, json=dict(plain, tools=weather), headers=auth)       # the tiny model writes no tool calls
    assert reply.status_code == 400 and "no tool-call format" in reply.json()["error"]["message"]
    assert _post(url, json=dict(plain, tools=weather, tool_choice="none"), headers=auth).status_code == 200
    assert _post(url, json=dict(plain, messages=[]), headers=auth).status_code == 400


def test_a_stop_string_ends_the_text_before_it(server, tiny):
    full = _greedy(tiny, b"When shall we", 16, temperature=0)
    stop = full[5:7]
    reply = server.client().completions.create(model="tiny", prompt="When shall we", max_tokens=16,
                                                temperature=0, stop=[stop])
    assert reply.choices[0].text == full[:full.index(stop)] and reply.choices[0].finish_reason == "stop"


def test_a_later_turn_feeds_only_its_new_tokens_and_only_for_its_key(server, tiny):
    """Prompts as token ids (a random model's bytes are not always UTF-8 text): the second turn
    starts with the first turn's prompt and output, which it finds kept."""
    opening = list(b"Fair is foul")
    server.client().completions.create(model="tiny", prompt=opening, max_tokens=6, temperature=0)
    said = list(tiny.session().generate(opening, max_new_tokens=6))
    follow = opening + said + list(b" and foul is fair")
    again = server.client().completions.create(model="tiny", prompt=follow, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == len(opening) + 6
    other = server.client(KEYS[1]).completions.create(model="tiny", prompt=follow, max_tokens=4, temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].text == again.choices[0].text        # the same state either way


def test_a_prompt_sharing_a_cached_prefix_cut_inside_a_block_reports_its_cached_tokens(server, tiny):
    """Prompts of 150 token ids that share their first 100 (k = 64: the cut lies inside a
    block): the second finds the state at 64 and keeps one at 100, the third finds that; a salt
    sees only its own."""
    base = [(7 * i) % 256 for i in range(100)]
    client = server.client(KEYS[1])
    asks = [base + [(i + s) % 256 for i in range(50)] for s in (1, 2, 3)]
    cached = [client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
              .usage.prompt_tokens_details.cached_tokens for ids in asks]
    assert cached == [0, 64, 100]
    salted = [client.completions.create(model="tiny", prompt=asks[0], max_tokens=2, temperature=0,
                                        extra_body={"cache_salt": "s"}).usage.prompt_tokens_details.cached_tokens
              for _ in range(2)]
    assert salted == [0, 150]                   # the first salted request fed it all, and left it kept


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": "hot"}', 400, "temperature"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "hi", "n": 17}', 400, "n"),
    (b'{"model": "tiny", "prompt": "hi", "stop": 5}', 400, "stop"),
    (b'{"model": "tiny", "prompt": [1, 999]}', 400, "token ids"),
    (b'{"model": "tiny", "prompt": ""}', 400, "no tokens"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 5000}', 400, "context limit"),
    (b'{"model": "gpt-4", "prompt": "hi"}', 404, "does not exist"),
    (b'{"model": "tiny"}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": "hi", "logprobs": 6}', 400, "logprobs"),
    (b'{"model": "tiny", "prompt": "hi", "echo": true}', 400, "echo is not supported"),
    (b'{"model": "tiny", "prompt": "hi", "logit_bias": {"1": 5}}', 400, "logit_bias is not supported"),
    (b'{"model": "tiny", "prompt": "hi", "best_of": 0}', 400, "best_of is not supported"),
    (b'{"model": "tiny", "prompt": "hi", "something_new": 1}', 400, "something_new: this server does not take"),
    (b'{"model": "tiny", "prompt": []}', 400, "no prompt"),
    (b'{"model": "tiny", "prompt": ["hi", ""]}', 400, "no tokens"),
    (b'{"model": "tiny", "prompt": "hi", "presence_penalty": 3}', 400, "presence_penalty"),
    (b'{"model": "tiny", "prompt": "hi", "response_format": {"type": "json_schema"}}', 400, "needs its"),
    (b'{"model": "tiny", "prompt": "hi", "response_format": {"type": "regex", "regex": "("}}', 400, "regular"),
    (b'{"model": "tiny", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": '
     b'{"name": "x", "schema": {"type": "object", "if": {}}}}}', 400, "if"),
])
def test_bad_requests_are_refused_and_change_nothing(server, body, status, message):
    kept = dict(server.scheduler.cache.entries)
    reply = _post(server.url + "/v1/completions", content=body,
                  headers={"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["type"]
    assert server.scheduler.depth == (0, 0) and dict(server.scheduler.cache.entries) == kept


def test_keys_sizes_and_unknown_fields(server):
    url = server.url + "/v1/completions"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert _post(url, json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert _post(url, json=body).status_code == 401
    assert _post(url, json=body, headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 200
    huge = {"model": "tiny", "prompt": "x" * (2 << 20)}
    reply = _post(url, json=huge, headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert reply.status_code == 413 and "over" in reply.json()["error"]["message"]


@pytest.mark.parametrize("split", [False, True], ids=["one process", "front end apart"])
def test_one_failing_request_leaves_31_others_as_a_clean_run_gives_them(tiny, split):
    """32 concurrent streaming requests; one is failed mid-decode (its fourth token's transaction
    aborts through the test-only fault hook, the real nonfinite path); the other 31 stream what
    each would alone."""
    prompts = [f"Request {i}: tomorrow, and tomorrow".encode() for i in range(32)]
    doomed = 13

    def fault(request):
        if bytes(request.prompt) == prompts[doomed] and len(request.produced) == 3:
            return "layers.1.qsa"
        return None
    server = Server(tiny, fault=fault, max_sessions=32, split=split)
    try:
        def ask(i):
            pieces = []
            try:
                for chunk in server.client().completions.create(model="tiny", prompt=prompts[i].decode(),
                                                                max_tokens=8, temperature=0.8, seed=i,
                                                                stream=True):
                    pieces.append(chunk.choices[0].text if chunk.choices else "")
            except openai.APIError as exc:
                return "".join(pieces), exc
            return "".join(pieces), None
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(ask, range(32)))
        for i, (text, exc) in enumerate(results):
            if i == doomed:
                assert exc is not None and "nonfinite" in str(exc), (text, exc)
                assert len(text) <= 4          # three committed, the fourth sent as its step began
            else:
                assert exc is None
                assert text == _greedy(tiny, prompts[i], 8, temperature=0.8, seed=i), i
        assert 'hebrus_aborted_transactions_total{kind="nonfinite",stage="layers.1.qsa"} 1.0' in \
            _get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).text
    finally:
        server.close()


@pytest.mark.parametrize("split", [False, True], ids=["one process", "front end apart"])
def test_overload_is_a_429_with_retry_after(tiny, split):
    server = Server(tiny, max_waiting=0, split=split)
    try:
        reply = _post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"},
                      headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
    finally:
        server.close()


def test_a_client_gone_mid_stream_frees_its_request(server):
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEYS[0]}"},
                      timeout=PATIENCE,
                      json={"model": "tiny", "prompt": "Out, out", "max_tokens": 500, "stream": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                break
    assert wait_until(lambda: server.scheduler.depth == (0, 0))


def test_fast_mode_steps_requests_together_and_isolates_a_failure(tiny_fast):
    """Fast mode steps the decoding requests together in one pass (a `Batch`); the failing one
    is stepped alone under its fault and ends in a 500 before anything streamed; the others
    complete, each with what it makes alone."""
    doomed = b"Lay on, Macduff"

    def fault(request):
        return "head" if bytes(request.prompt) == doomed and not request.produced else None
    server = Server(tiny_fast, fault=fault, max_sessions=8)
    try:
        def ask(prompt):
            try:
                return server.client().completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                                          temperature=0).choices[0].text
            except openai.InternalServerError as exc:
                return exc
        prompts = [f"Speak {i}" for i in range(7)] + [doomed.decode()]
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(ask, prompts))
        assert all(isinstance(r, str) for r in results[:7])
        assert isinstance(results[7], openai.InternalServerError) and results[7].code == "aborted_nonfinite"
        assert server.scheduler.widest > 1   # several requests' tokens in one pass
        for prompt, text in zip(prompts[:7], results[:7]):
            assert text == _greedy(tiny_fast, prompt.encode(), 8, temperature=0.0), prompt
    finally:
        server.close()


def test_the_command_refuses_bad_arguments():
    import io
    from contextlib import redirect_stderr
    from hebrus.cli import main
    err = io.StringIO()
    with redirect_stderr(err):
        assert main(["serve", "--model", "tiny", "--port", "70000"]) == 2
        assert main(["serve", "--model", "tiny", "--max-sessions", "0"]) == 2
        assert main(["serve", "--model", "tiny", "--prefill-tokens", "0"]) == 2
        assert main(["serve", "--model", "tiny", "--prefill-chunk", "0"]) == 2
        assert main(["serve", "--model", "tiny", "--gather-ms", "-1"]) == 2
        assert main(["serve", "--model", "tiny", "--passes", "paced", "--tensor-parallel", "2"]) == 2
    assert "--port must lie in" in err.getvalue() and "--max-sessions" in err.getvalue()
    assert "--prefill-tokens must be at least 1" in err.getvalue()
    assert "--prefill-chunk must be at least 1" in err.getvalue()
    assert "--passes paced stops a prompt pass between its stages" in err.getvalue()
    assert "--gather-ms must be from 0 to 100, got -1.0" in err.getvalue()


def test_a_turn_feeds_prompts_up_to_its_budget_oldest_first_and_steps_every_decoding_request(tiny):
    """The engine loop's turns driven by hand: 8 prompt tokens a turn (a chunk is never cut by
    the budget, and a turn always feeds one), the oldest request's first; the request already
    decoding makes a token every turn."""
    from hebrus.sampling import Sampling
    from hebrus.scheduling.scheduler import Request, Scheduler
    scheduler = Scheduler(tiny, chunk_size=8, prefill_tokens=8)
    events = []

    def asking(n, tag):
        return Request(key="", prompt=list(range(1, n + 1)), max_tokens=50, sampling=Sampling(), seed=0,
                       stop_ids=frozenset(), emit=lambda kind, value: events.append((tag, kind)), keep=False)
    running, first, second = asking(3, "running"), asking(20, "first"), asking(12, "second")
    scheduler.running = [running]
    scheduler._turn()                                   # its 3 prompt tokens, then its first token
    scheduler.running += [first, second]
    fed = []
    for _ in range(5):
        events.clear()
        scheduler._turn()
        fed.append((first.fed, second.fed))
        assert ("running", "token") in events
    assert fed == [(8, 0), (16, 0), (20, 8), (20, 12), (20, 12)]   # 4 tokens left 4 of the budget
    assert len(running.produced) == 6


def test_an_idle_loop_gathers_a_burst_of_requests_into_one_pass(tiny):
    """With `gather`, an idle loop woken by one request waits while more keep arriving: four
    submitted a moment apart (well within the gap) are fed in one pass; it waits no longer once
    they fill every place (a gap of 30 s is never waited out). On the CPU the default is not to
    wait; a negative gap is refused."""
    from hebrus.scheduling.scheduler import Request, Scheduler
    assert Scheduler(tiny).gather == 0
    with pytest.raises(ValueError, match="gather"):
        Scheduler(tiny, gather=-1)
    for gather, places in ((0.5, 8), (30.0, 4)):
        scheduler, done = Scheduler(tiny, max_sessions=places, gather=gather), []
        passes = []
        real = scheduler._pass
        scheduler._pass = lambda feeding, *rest: (passes.append(len(feeding)), real(feeding, *rest))[1]
        scheduler.start()
        began = time.monotonic()
        try:
            for i in range(4):
                scheduler.submit(Request(key="", prompt=list(f"Burst {i}".encode()), max_tokens=2, sampling=Sampling(),
                                         seed=i, stop_ids=frozenset(), keep=False,
                                         emit=lambda kind, value: kind != "token" and done.append(kind)))
                time.sleep(0.02)
            assert wait_until(lambda: len(done) == 4)
        finally:
            scheduler.stop(drain_seconds=1)
        assert done == ["done"] * 4 and passes[0] == 4
        if gather == 30.0:
            assert time.monotonic() - began < gather             # the places full, it waited no longer


def test_sigterm_finishes_the_requests_in_flight_then_exits(tmp_path):
    """`hebrus serve` as a process: SIGTERM while a stream runs; the stream still ends with its
    finish reason and [DONE], new connections are refused, and the process exits 0."""
    import os
    import signal
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    process = subprocess.Popen([sys.executable, "-m", "hebrus", "serve", "--model", "tiny", "--mode", "exact",
                                "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _healthy(url), step=0.05), "the server did not start"
        lines = []
        with httpx.stream("POST", url + "/v1/completions", timeout=PATIENCE,
                          json={"model": "tiny", "prompt": "Double, double", "max_tokens": 60, "stream": True}) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 2:
                        process.send_signal(signal.SIGTERM)
        assert lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in lines[-2]
        assert process.wait(timeout=PATIENCE) == 0
    finally:
        process.kill()
        process.wait()


def test_a_bounded_load_test_reports_throughput_and_time_to_first_token(server, capsys):
    """24 streaming requests, 8 at a time, over loopback: every one answered in full; the
    throughput and p50/p99 time to first token are printed (speed lives in `bench --serve`)."""
    import asyncio
    from hebrus.bench.serve import load, prompts
    asks = prompts(256, 24, 16, seed=3)
    point = asyncio.run(load(server.url, "tiny", asks, 8, 8, key=KEYS[0]))
    assert point["requests"] == 24 and point["events_per_s"] > 0
    assert point["ttft_ms_p50"] <= point["ttft_ms_p99"]
    with capsys.disabled():
        print(f"\nload test: {point['requests_per_s']:.1f} requests/s, {point['output_tokens_per_s']:.0f} tokens/s, "
              f"TTFT p50 {point['ttft_ms_p50']:.0f} ms, p99 {point['ttft_ms_p99']:.0f} ms")


def test_a_request_that_cannot_start_fails_alone(tiny):
    """The engine loop itself: a request whose admission raises (here a seed its generator
    refuses, which the HTTP side would never pass) gets the error; the one beside it finishes."""
    from hebrus.sampling import Sampling
    from hebrus.scheduling.scheduler import Request, Scheduler
    scheduler = Scheduler(tiny)
    events = {0: [], 1: []}
    done = threading.Event()

    def emitter(i):
        def emit(kind, value):
            events[i].append((kind, value))
            if kind != "token" and all(e and e[-1][0] != "token" for e in events.values()):
                done.set()
        return emit
    requests = [Request(key="k", prompt=list(b"Hail"), max_tokens=3, sampling=Sampling(), seed=seed,
                        stop_ids=frozenset(), emit=emitter(i)) for i, seed in enumerate([2**70, 5])]
    for request in requests:
        scheduler.submit(request)
    scheduler.start()
    try:
        assert done.wait(PATIENCE)
        assert events[0][-1][0] == "error" and [k for k, _ in events[1]] == ["token"] * 3 + ["done"]
    finally:
        scheduler.stop(drain_seconds=1)


def test_what_a_hostile_client_sends_is_refused_in_openai_shape(server):
    """Found by a review: deep nesting, a chunked body past the limit, unknown routes and
    methods; each a 4xx with an OpenAI-style body, nothing in the engine touched."""
    url, auth = server.url + "/v1/completions", {"Authorization": f"Bearer {KEYS[0]}"}
    deep = _post(url, content=b"[" * 100000 + b"]" * 100000, headers=auth)
    assert deep.status_code == 400 and "not valid JSON" in deep.json()["error"]["message"]

    def chunks():
        for _ in range(40):
            yield b"x" * 65536
    big = _post(url, content=chunks(), headers=auth)
    assert big.status_code == 413 and "over" in big.json()["error"]["message"]
    for method, path, status in [("GET", "/v1/completions", 405), ("POST", "/v1/nothing", 404),
                                 ("POST", "/v1/completions/", 404), ("PUT", "/v1/chat/completions", 405)]:
        reply = httpx.request(method, server.url + path, headers=auth)
        assert reply.status_code == status and reply.json()["error"]["message"], (method, path, reply.text)
    assert server.scheduler.depth == (0, 0)


def test_unseeded_sampling_differs_and_a_gone_client_is_let_go(server):
    client = server.client()
    outs = {client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=1.0).choices[0].text
            for _ in range(3)}
    assert len(outs) > 1
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=0.3,
                   json={"model": "tiny", "prompt": "Tomorrow", "max_tokens": 900, "temperature": 0})
    assert wait_until(lambda: server.scheduler.depth == (0, 0))


def test_an_end_of_sequence_id_is_counted_not_shown():
    from hebrus.serve.reply import Answer, Reply
    from hebrus.serve.metrics import Metrics

    class Text:
        stop_ids = (0,)

        def stream(self):
            from hebrus.text import ByteTokenizer
            return ByteTokenizer().stream()
    job = type("Job", (), {"stop_ids": frozenset({0}), "cached": 0, "cancelled": threading.Event(), "logprobs": None})()
    answer = Answer([Reply(0, Text(), (), job)], False, "tiny", 3, Metrics(), time.monotonic())
    for token in b"ok":
        assert answer.take(0, "token", token)
    answer.take(0, "token", 0)
    answer.take(0, "done", "stop")
    whole = answer.whole()
    assert whole["choices"][0]["text"] == "ok" and whole["usage"]["completion_tokens"] == 3


def test_without_api_keys_nothing_is_kept_for_anyone(tiny):
    server = Server(tiny, keys=None)
    try:
        client = server.client()
        opening = list(b"my password is hunter2")
        client.completions.create(model="tiny", prompt=opening, max_tokens=4, temperature=0)
        said = list(tiny.session().generate(opening, max_new_tokens=4))
        again = client.completions.create(model="tiny", prompt=opening + said + [65], max_tokens=2, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == 0 and not server.scheduler.cache.entries
    finally:
        server.close()



def test_an_idle_engine_makes_spare_sessions_and_a_request_takes_one(tiny):
    """While idle the loop makes `spare_sessions` new sessions; a request is admitted with one of
    them (made before it came) and the loop makes another once idle again. A spare is a new
    session like any other: the request's tokens equal `Session.generate`'s."""
    from hebrus.sampling import Sampling
    from hebrus.scheduling.scheduler import Request, Scheduler
    scheduler = Scheduler(tiny, spare_sessions=2)
    scheduler.start()
    try:
        deadline = time.monotonic() + PATIENCE
        while len(scheduler.spares) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        made = list(scheduler.spares)
        assert len(made) == 2
        got, held, done = [], [], threading.Event()

        def emit(kind, value):
            if kind == "token":
                got.append(value)
                held.append(request.session)
            else:
                done.set()
        request = Request(key="k", prompt=list(b"Hail"), max_tokens=4, sampling=Sampling(temperature=1.0), seed=3,
                          stop_ids=frozenset(), emit=emit)
        scheduler.submit(request)
        assert done.wait(PATIENCE)
        assert any(held[0] is s for s in made) and request.session is None   # let go once it ended
        while len(scheduler.spares) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(scheduler.spares) == 2 and not any(held[0] is s for s in scheduler.spares)
        assert got == list(tiny.session().generate(list(b"Hail"), max_new_tokens=4, temperature=1.0, seed=3))
    finally:
        scheduler.stop(drain_seconds=1)
    none = Scheduler(tiny, spare_sessions=0)
    none.start()
    try:
        time.sleep(0.1)
        assert none.spares == []
    finally:
        none.stop(drain_seconds=1)
    with pytest.raises(ValueError, match="spare_sessions"):
        Scheduler(tiny, spare_sessions=-1)


def test_the_outbox_keeps_each_queue_in_order_and_wakes_the_loop_once_for_a_burst():
    """Events put from another thread reach their queues in order, and a burst put while the
    loop is busy (one engine turn's tokens) wakes it once, not once per event. A loop that is
    closed drops what is put for it, and the outbox does not keep it alive."""
    import asyncio
    import gc
    import weakref
    from hebrus.serve.outbox import Outbox

    async def scenario():
        loop = asyncio.get_running_loop()
        outbox, wakes = Outbox(loop), []
        drain = outbox._drain
        outbox._drain = lambda: (wakes.append(1), drain())
        queues = [asyncio.Queue() for _ in range(3)]
        for turn in range(5):
            busy, done = threading.Event(), threading.Event()

            def engine(turn=turn):
                busy.wait(5)
                for i, q in enumerate(queues):
                    outbox.put(q, (turn, i))
                done.set()
            thread = threading.Thread(target=engine)
            thread.start()
            loop.call_soon(lambda: (busy.set(), done.wait(5)))    # the loop busy while the turn puts
            await asyncio.sleep(0.02)
            thread.join()
        got = [[q.get_nowait() for _ in range(q.qsize())] for q in queues]
        return got, len(wakes)
    got, wakes = asyncio.run(scenario())
    assert got == [[(turn, i) for turn in range(5)] for i in range(3)]
    assert wakes == 5                           # 15 events
    loop = asyncio.new_event_loop()
    outbox, queue = Outbox(loop), asyncio.Queue()
    loop.close()
    outbox.put(queue, 1)
    outbox.put(queue, 2)
    assert outbox.items == [] and queue.empty()
    gone = weakref.ref(loop)
    del loop
    gc.collect()
    assert gone() is None


def test_an_engine_that_cannot_make_a_spare_serves_all_the_same(tiny, monkeypatch):
    """Making a spare session fails (no memory for one now): the loop stops trying until a
    request is admitted, the request makes its own session and is served, and after it the
    spares are made again."""
    from hebrus.sampling import Sampling
    from hebrus.scheduling.scheduler import Request, Scheduler
    made, real = [], tiny.session

    def session(*args, **kwargs):
        made.append(threading.current_thread().name)
        if len(made) == 1:
            raise RuntimeError("no memory for a session now")
        return real(*args, **kwargs)
    monkeypatch.setattr(tiny, "session", session)
    scheduler = Scheduler(tiny, spare_sessions=2)
    scheduler.start()
    try:
        deadline = time.monotonic() + PATIENCE
        while not scheduler.settled and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert made == ["hebrus-engine"] and scheduler.spares == []     # tried once, then waits
        got, done = [], threading.Event()
        scheduler.submit(Request(key="k", prompt=list(b"Hail"), max_tokens=3, sampling=Sampling(), seed=1,
                                 stop_ids=frozenset(),
                                 emit=lambda kind, value: got.append(kind) if kind == "token" else done.set()))
        assert done.wait(PATIENCE) and got == ["token"] * 3
        while len(scheduler.spares) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(scheduler.spares) == 2
    finally:
        scheduler.stop(drain_seconds=1)
    assert scheduler.spares == []                                       # given back with the loop


# ---- the front end in a process of its own (`serve.link`, as `hebrus serve` runs) ----------------
def test_with_the_front_end_apart_every_answer_is_the_one_in_one_process(tiny):
    """The same requests to a server in one process and to one whose front end runs apart:
    greedy, sampled with n = 2 and streamed, constrained by a regex, with logprobs, a prompt
    found cached (its usage's cached tokens): the same answers; a client gone mid-stream frees its request in the engine's process too."""
    bodies = [{"prompt": "Double, double", "max_tokens": 12, "temperature": 0},
              {"prompt": "Toil and trouble", "max_tokens": 9, "temperature": 0.8, "seed": 7, "n": 2, "stream": True},
              {"prompt": "Fire burn", "max_tokens": 8, "seed": 3, "response_format": {"type": "regex", "regex": "ab+c"}},
              {"prompt": "and cauldron", "max_tokens": 5, "temperature": 0, "logprobs": 2},
              {"prompt": "Double, double", "max_tokens": 12, "temperature": 0}]   # its prompt found cached
    answers = {}
    for split in (False, True):
        server = Server(tiny, split=split)
        try:
            got = []
            for body in bodies:
                reply = _post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEYS[0]}"},
                              json={"model": "tiny", **body})
                assert reply.status_code == 200, reply.text
                if body.get("stream"):
                    chunks = [json.loads(line[6:]) for line in reply.text.splitlines()
                              if line.startswith("data: {")]
                    got.append(sorted((c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks
                                      if c["choices"]))
                else:
                    got.append([(c["text"], c["finish_reason"], c["logprobs"]) for c in reply.json()["choices"]]
                               + [reply.json()["usage"]])
            answers[split] = got
            if split:
                test_a_client_gone_mid_stream_frees_its_request(server)
        finally:
            server.close()
    assert answers[True] == answers[False]
    assert answers[True][-1][-1]["prompt_tokens_details"]["cached_tokens"] > 0
    assert answers[False][0][0][0] == _greedy(tiny, b"Double, double", 12, temperature=0)


def test_the_relay_sends_a_turns_events_as_one_message(tiny):
    """The engine's end of the link: four requests decoding together send their tokens a turn
    at a time (one message carrying each request's token), each request's events in order."""
    from hebrus.scheduling.scheduler import Scheduler
    from hebrus.serve.link import Relay

    class Conn:
        def __init__(self):
            self.sent = []

        def send(self, message):
            self.sent.append(message)

        def recv(self):
            raise EOFError
    scheduler, conn = Scheduler(tiny, max_sessions=4), Conn()
    relay = Relay(scheduler, conn)
    for i in range(4):
        relay._submit([(i, {"key": "k", "prompt": list(f"Voice {i}".encode()), "max_tokens": 6,
                            "sampling": Sampling(), "seed": i, "stop_ids": frozenset(), "keep": False, "salt": "",
                            "logprobs": None}, None, [])])
    scheduler.start()
    try:
        assert wait_until(lambda: sum(len(m[1]) for m in conn.sent) == 4 * 8)
    finally:
        scheduler.stop(drain_seconds=1)
    events = [e for m in conn.sent for e in m[1]]
    for i in range(4):
        assert [kind for j, kind, _ in events if j == i] == ["cached"] + ["token"] * 6 + ["done"]
    assert len(conn.sent) <= 7 and all({j for j, _, _ in m[1]} == {0, 1, 2, 3} for m in conn.sent)


def test_what_crosses_the_link_and_what_happens_when_the_engine_is_gone():
    """An abort crosses whole (its kind, stage and text); an error that cannot be pickled crosses
    as a RuntimeError naming it. The engine's end closing fails what is running, refuses what
    comes after, and tells the front end (which then stops)."""
    import multiprocessing
    import pickle
    from hebrus.errors import NonFiniteError
    from hebrus.scheduling.scheduler import Request
    from hebrus.serve.link import Link, _portable
    abort = pickle.loads(pickle.dumps(_portable(NonFiniteError("layers.1.qsa", "inf in h", 3))))
    assert type(abort) is NonFiniteError and (abort.stage, abort.detail, abort.published) == ("layers.1.qsa",
                                                                                              "inf in h", 3)

    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}{b}")
    odd = _portable(Odd("no ", "pickle"))
    assert type(odd) is RuntimeError and str(odd) == "Odd: no pickle"
    here, there = multiprocessing.Pipe()
    lost, events = threading.Event(), []
    link = Link(here, share_prefixes=False, lost=lost.set)
    job = Request(key="k", prompt=[1, 2], max_tokens=3, sampling=Sampling(), seed=0, stop_ids=frozenset(),
                  emit=lambda kind, value: events.append((kind, value)))
    link.submit(job)
    assert there.recv()[0] == "submit"
    there.close()
    assert lost.wait(PATIENCE)
    assert events[0][0] == "error" and "the engine stopped" in str(events[0][1])
    with pytest.raises(RuntimeError, match="the engine stopped"):
        link.submit(Request(key="k", prompt=[1], max_tokens=1, sampling=Sampling(), seed=0, stop_ids=frozenset(),
                            emit=lambda kind, value: None))


def test_neither_end_of_the_link_blocks_the_other_when_the_front_end_falls_behind():
    """Found by a review: with both ends sending while holding a lock the other's reader needed,
    a front end that fell behind for a moment, an engine message larger than the pipe's buffer,
    a /metrics count and a long prompt left every thread waiting for good. Each end sends from a
    thread of its own now: all of it arrives."""
    import multiprocessing
    from hebrus.scheduling.scheduler import Request
    from hebrus.serve.link import Link, Relay

    class Loop:                         # the engine loop where the relay reaches it
        model, after_turn = None, None

        def __init__(self):
            self.got = []

        def submit(self, *requests):
            self.got += requests

        def counts(self):
            return {"running": len(self.got)}

    def job(prompt, emit):
        return Request(key="k", prompt=prompt, max_tokens=4, sampling=Sampling(), seed=0, stop_ids=frozenset(),
                       emit=emit)
    here, there = multiprocessing.Pipe()
    loop, seen, slow = Loop(), [], threading.Event()
    relay = Relay(loop, here)
    relay.start()
    link = Link(there, share_prefixes=False)

    def emit(kind, value):
        if not slow.is_set():           # the front end busy for a moment
            slow.set()
            time.sleep(1.0)
        seen.append(kind)
    link.submit(job([1, 2, 3], emit))
    assert wait_until(lambda: loop.got)
    engine_emit = loop.got[0].emit
    engine_emit("token", 5)
    relay.flush()
    big = list(range(300_000))          # a turn's message far larger than the pipe's buffer
    engine = threading.Thread(target=lambda: (engine_emit("logprobs", big), relay.flush()), daemon=True)
    engine.start()
    counted = []
    asking = threading.Thread(target=lambda: counted.append(link.counts(timeout=PATIENCE)), daemon=True)
    asking.start()
    link.submit(job(list(range(200_000)), lambda kind, value: None))
    engine.join(PATIENCE)
    asking.join(PATIENCE)
    assert not engine.is_alive() and not asking.is_alive() and counted
    assert wait_until(lambda: len(loop.got) == 2 and seen == ["token", "logprobs"])
    link.close()


def test_one_http_requests_prompts_are_taken_or_refused_together(tiny):
    """`Scheduler.submit` of several prompts (one HTTP request's): none waits unless all can."""
    from hebrus.scheduling.scheduler import Overloaded, Request, Scheduler
    scheduler = Scheduler(tiny, max_waiting=2)

    def ask():
        return Request(key="k", prompt=[1, 2], max_tokens=1, sampling=Sampling(), seed=0, stop_ids=frozenset(),
                       emit=lambda kind, value: None)
    scheduler.submit(ask())
    with pytest.raises(Overloaded):
        scheduler.submit(ask(), ask())
    assert len(scheduler.waiting) == 1
    scheduler.submit(ask())
    assert len(scheduler.waiting) == 2


@pytest.mark.parametrize("group", [False, True], ids=["SIGTERM to the server", "Ctrl-C to its process group"])
def test_a_signal_while_the_front_end_starts_ends_the_server_cleanly(group):
    """`hebrus serve` told to stop as soon as its front end's process exists, while it is most
    likely still starting (found by a review: the front end died by the signal and the command
    exited 1): it exits 0 either way, and Ctrl-C leaves no traceback of the front end's: its
    process starts with SIGINT blocked (until it serves), which its mask shows."""
    import os
    import signal
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    process = subprocess.Popen([sys.executable, "-m", "hebrus", "serve", "--model", "tiny", "--mode", "exact",
                                "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, start_new_session=group)
    masks = []

    def front_started():                # the front end's process spawned (not the resource tracker)
        try:
            children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
            for c in children:
                if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes():
                    status = Path(f"/proc/{c}/status").read_text()
                    masks.append(int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16))
                    return True
        except (OSError, StopIteration):
            pass
        return False
    try:
        assert wait_until(front_started, step=0.005), "no front end was started"
        assert masks[0] & (1 << (signal.SIGINT - 1)), "the front end started with Ctrl-C unblocked"
        if group:
            os.killpg(process.pid, signal.SIGINT)
        else:
            process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=PATIENCE)
        assert process.returncode == 0
        assert b"Traceback" not in err, err.decode(errors="replace")
    finally:
        process.kill()
        process.wait()


class _Compiling:
    """A grammar whose start waits for the test (the relay starts it on a thread of its own)."""
    entered, gate = threading.Event(), threading.Event()

    def start(self, tokenizer, vocab_size):
        _Compiling.entered.set()
        assert _Compiling.gate.wait(PATIENCE)
        return None


def test_a_cancel_or_a_gone_front_end_reaches_a_request_whose_grammar_was_compiling():
    """Found by a review: a request made after its grammar compiled is cancelled if its cancel
    came meanwhile, and if the front end went away meanwhile (it was not)."""
    import multiprocessing
    from hebrus.serve.link import Relay

    class Loop:
        model, after_turn = type("Model", (), {"tokenizer": None, "spec": type("Spec", (), {"vocab_size": 8})})(), None

        def __init__(self):
            self.got = []

        def submit(self, *requests):
            self.got += requests
    fields = {"key": "k", "prompt": [1, 2], "max_tokens": 4, "sampling": Sampling(), "seed": 0,
              "stop_ids": frozenset(), "keep": False, "salt": "", "logprobs": None}
    for gone in (False, True):
        _Compiling.entered.clear()
        _Compiling.gate.clear()
        here, there = multiprocessing.Pipe()
        loop = Loop()
        relay = Relay(loop, here)
        relay.start()
        there.send(("submit", [(7, fields, _Compiling(), [])]))
        assert _Compiling.entered.wait(PATIENCE)
        if gone:
            there.close()
            assert wait_until(lambda: relay.closed)
        else:
            there.send(("cancel", 7))
            assert wait_until(lambda: 7 in relay.early)
        _Compiling.gate.set()
        assert wait_until(lambda: loop.got)
        assert loop.got[0].cancelled.is_set(), gone
        assert wait_until(lambda: not relay.compiling and not relay.early)
        if not gone:
            there.close()


def test_a_front_end_that_cannot_start_leaves_no_engine_loop_running(tiny):
    """`fronted` whose process cannot be started (here an argument the spawn cannot pickle)
    stops the loop it started (found by a review)."""
    scheduler = serve.engine(tiny)
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    try:
        with pytest.raises(Exception):
            with serve.fronted(scheduler, lambda: None, listening):
                pass
    finally:
        listening.close()
    assert wait_until(lambda: not scheduler.thread.is_alive())
