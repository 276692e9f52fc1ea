"""Text in, text out: the tokenizer of a model, `hebrus.generate` and its stream, a session
continued in text, a conversation kept in one session, and the defaults every text-level entry
point shares (the README's table) held against each of them."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import hebrus
from hebrus import text
from hebrus.cli import _parser
from hebrus.sampling import Sampling
from hebrus.text import ByteTokenizer, Conversation, TextOptions

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


@pytest.fixture(scope="module")
def exact():
    return hebrus.load("shakespeare")


# ---- the defaults table ---------------------------------------------------------------------

def _table() -> dict[str, str]:
    table = README.split("### Defaults", 1)[1].split("| setting | default |", 1)[1].split("\n\n", 1)[0]
    return dict(re.findall(r"^\| ([a-z ]+) \| (.+) \|$", table, flags=re.M))


def test_the_readme_has_one_defaults_table_and_the_constants_are_it():
    table = _table()
    assert table["model"].startswith(f"`{text.MODEL}`") and table["mode"] == f"`{text.MODE}`"
    assert table["device"].startswith(f"`{text.DEVICE}`") and table["dtype"].startswith(f"`{text.DTYPE}`")
    assert table["max new tokens"].startswith(str(text.MAX_NEW_TOKENS))
    assert text.SAMPLING == Sampling(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    assert "temperature 1 with nothing cut" in table["sampling"] and "random" in table["seed"]


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_every_command_starts_from_the_table(command):
    argv = [command] + (["x"] if command == "generate" else [])
    args = _parser().parse_args(argv)
    assert (args.model, args.mode, args.device, args.dtype) == (text.MODEL, text.MODE, text.DEVICE, text.DTYPE)
    if command != "serve":
        assert args.max_new_tokens == text.MAX_NEW_TOKENS and args.seed is None
        assert all(getattr(args, name) is None for name in ("temperature", "top_p", "top_k", "min_p",
                                                            "repetition_penalty"))


@pytest.mark.parametrize("command", ["info", "verify", "bench", "download"])
def test_every_command_has_one_default_model(command):
    args = _parser().parse_args([command] + (["Org/Name"] if command == "download" else []))
    assert getattr(args, "model", text.MODEL) == text.MODEL


def test_a_model_named_to_the_text_api_loads_with_the_table():
    model = text.entry.load("tiny")
    assert (model.mode, model.device.type, str(model.dtype)) == ("fast", "cpu", "torch.float32")


def test_sampling_comes_from_the_generation_config_else_the_table(tmp_path, exact):
    assert TextOptions().sampling(ByteTokenizer()) == text.SAMPLING
    assert TextOptions().sampling(exact.tokenizer) == Sampling(temperature=0.8, top_p=1.0, top_k=0, min_p=0.0,
                                                               repetition_penalty=1.0)
    assert TextOptions(temperature=0.3, top_k=5).sampling(exact.tokenizer).temperature == 0.3
    folder = hebrus.load("tiny").save(tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_p": 0.9, "top_k": 20}))
    greedy = hebrus.load(folder).tokenizer
    assert TextOptions().sampling(greedy) == Sampling(temperature=0.0, top_p=0.9, top_k=20)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(hebrus.InvalidInput, match="generation_config.json: temperature"):
        TextOptions().sampling(hebrus.load(folder).tokenizer)


def test_the_server_takes_its_sampling_from_the_same_defaults(tmp_path):
    """A request that names no sampling option is sampled as the checkpoint says: here greedy."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from hebrus import serve
    folder = hebrus.load("tiny").save(tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    model = hebrus.load(folder, mode="fast")
    app, scheduler = serve.build(model, "m")
    try:
        with TestClient(app) as client:
            answers = {client.post("/v1/completions", json={"model": "m", "prompt": "Hail", "max_tokens": 8}).json()
                       ["choices"][0]["text"] for _ in range(3)}
    finally:
        scheduler.stop(drain_seconds=1)
    greedy = model.tokenizer.decode(model.session().generate(list(b"Hail"), max_new_tokens=8))
    assert answers == {greedy}


# ---- text in, text out ----------------------------------------------------------------------

def test_generate_is_the_token_path_through_the_tokenizer(exact):
    ids = exact.tokenizer.encode("ROMEO.\n")
    tokens = list(exact.session().generate(ids, max_new_tokens=30))
    assert hebrus.generate(exact, "ROMEO.\n", max_new_tokens=30, temperature=0) == exact.tokenizer.decode(tokens)
    seeded = [hebrus.generate(exact, "ROMEO.\n", max_new_tokens=20, seed=5) for _ in range(2)]
    assert seeded[0] == seeded[1]
    streams = [hebrus.stream_generate(exact, "x", max_new_tokens=1) for _ in range(2)]
    assert streams[0].seed != streams[1].seed                      # a new seed each time (2**-63 to collide)


def test_a_stream_counts_and_stops(exact):
    stream = hebrus.stream_generate(exact, "ROMEO.\n", max_new_tokens=200, temperature=0, stop="\n")
    pieces = list(stream)
    assert "\n" not in "".join(pieces) and stream.finish == "stop"
    assert stream.prompt_tokens == 7 and 0 < stream.generated <= 200 and len(stream.ids) == stream.generated
    whole = hebrus.stream_generate(exact, "ROMEO.\n", max_new_tokens=5, temperature=0)
    assert len(list(whole)) >= 1 and whole.finish == "length" and whole.generated == 5


def test_bad_options_are_refused_before_anything_runs(exact):
    for options, message in (({"temperature": -1}, "temperature"), ({"stop": ""}, "stop"),
                             ({"max_new_tokens": -1}, "max_new_tokens"), ({"speed": 2}, "unknown option"),
                             ({"seed": 2**70}, "seed")):
        with pytest.raises(hebrus.InvalidInput, match=message):
            hebrus.stream_generate(exact, "x", **options)
    with pytest.raises(hebrus.InvalidInput, match="role"):
        hebrus.generate(exact, [{"role": "wizard", "content": "x"}])


def test_the_context_limit_ends_a_generation():
    model = hebrus.load("tiny", mode="fast")
    s = model.session()
    s.prefill(list(range(60, 120)) * 17)                           # 1020 of 1024
    stream = s.generate_text("ab", max_new_tokens=50, temperature=0)
    list(stream)
    assert stream.context_ended and stream.generated == 2 and s.frontier == 1024


def test_a_session_continues_in_text(exact):
    s = exact.session()
    first = "".join(s.generate_text("ROMEO.\n", max_new_tokens=10, temperature=0))
    second = "".join(s.generate_text(" and", max_new_tokens=10, temperature=0))
    assert s.frontier == len("ROMEO.\n") + 10 + len(" and") + 10
    plain = list(exact.session().generate(exact.tokenizer.encode("ROMEO.\n"), max_new_tokens=10))
    assert first == exact.tokenizer.decode(plain) and second


# ---- a conversation in one session ----------------------------------------------------------

def test_each_turn_feeds_only_its_new_tokens_and_equals_a_fresh_session(exact):
    talk = Conversation(exact, system="Be brief.", max_new_tokens=30, temperature=0)
    first = talk.say("Who is there?")
    list(first)
    second = talk.say("Nay, answer me.")
    list(second)
    ids = exact.tokenizer.apply_chat_template(talk.messages[:-1])
    assert second.prompt_tokens < len(ids) - first.generated          # not the whole conversation again
    fresh = exact.session()
    fresh.feed(talk.held[:len(ids)])
    assert talk.held[:len(ids)] == ids
    reply = list(fresh.generate([], max_new_tokens=30, stop_ids=()))
    assert talk.messages[-1]["content"] == exact.tokenizer.decode(reply)[:len(talk.messages[-1]["content"])]


def test_a_turn_that_does_not_continue_resumes_from_the_prompts_fork(exact):
    """The reply is kept as its text, which the plain format escapes: a reply holding a role's
    line renders otherwise than its tokens, and the turn resumes from the fork at the prompt."""
    talk = Conversation(exact, max_new_tokens=8, temperature=0)
    list(talk.say("Hail"))
    talk.messages[-1]["content"] += "x"                          # what the session holds no longer matches
    stream = talk.say("Again")
    list(stream)
    assert stream.prompt_tokens > len(exact.tokenizer.encode("USER.\nAgain\n\nASSISTANT.\n"))
    assert talk.held == exact.tokenizer.apply_chat_template(talk.messages[:-1]) + stream.ids


def test_a_conversation_saves_and_loads(exact, tmp_path):
    talk = Conversation(exact, max_new_tokens=12, temperature=0)
    list(talk.say("Hail"))
    talk.save(tmp_path / "talk.hs")
    again = Conversation(exact, max_new_tokens=12, temperature=0)
    again.load(tmp_path / "talk.hs")
    assert again.messages == talk.messages and again.held == talk.held
    assert again.session.digest() == talk.session.digest()
    a, b = talk.say("More"), again.say("More")
    assert list(a) == list(b) and b.prompt_tokens == a.prompt_tokens
    plain = exact.session()
    plain.save(tmp_path / "plain.hs")
    with pytest.raises(hebrus.InvalidInput, match="not a saved conversation"):
        again.load(tmp_path / "plain.hs")
    data = bytearray((tmp_path / "talk.hs").read_bytes())
    at = data.find(b"Hail")
    data[at] = ord("J")
    (tmp_path / "talk.hs").write_bytes(bytes(data))
    with pytest.raises(hebrus.InvalidInput, match="note"):
        again.load(tmp_path / "talk.hs")


# ---- hebrus chat at a terminal --------------------------------------------------------------

class _Terminal:
    """A child process on a pseudo-terminal: what it writes, read up to a marker."""

    def __init__(self, argv: list[str], cwd: Path):
        import os
        import subprocess
        import sys
        self.os = os
        master, slave = os.openpty()
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "TERM": "xterm",
               "HOME": str(cwd)}
        self.process = subprocess.Popen([sys.executable, "-m", "hebrus", *argv], stdin=slave, stdout=slave,
                                        stderr=slave, env=env, cwd=cwd, start_new_session=True)
        os.close(slave)
        self.master, self.seen = master, ""

    def until(self, marker: str) -> str:
        """Everything written since the last call, up to and with the next `marker`."""
        import select
        import time
        from conftest import PATIENCE
        deadline, start = time.monotonic() + PATIENCE, len(self.seen)
        while marker not in self.seen[start:]:
            assert time.monotonic() < deadline, f"never saw {marker!r}; saw {self.seen[start:]!r}"
            ready, _, _ = select.select([self.master], [], [], 1.0)
            if ready:
                try:
                    data = self.os.read(self.master, 4096)
                except OSError:
                    data = b""
                assert data, f"the process ended before {marker!r}; saw {self.seen[start:]!r}"
                self.seen += re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", data.decode(errors="replace"))
        end = self.seen.index(marker, start) + len(marker)
        out, self.seen = self.seen[start:end], self.seen[:start] + self.seen[end:]
        return out

    def send(self, line: str) -> None:
        self.os.write(self.master, line.encode())

    def close(self) -> int:
        from conftest import PATIENCE
        try:
            return self.process.wait(timeout=PATIENCE)
        finally:
            self.os.close(self.master)


def test_hebrus_chat_at_a_terminal(tmp_path):
    """A conversation through a pseudo-terminal: a reply streams and its counts follow, /save,
    /reset and /load keep and bring back the session, the up arrow recalls the last line,
    Ctrl-D leaves."""
    term = _Terminal(["chat", "--model", "tiny", "--temperature", "0", "--max-new-tokens", "6"], tmp_path)
    try:
        assert "hebrus chat with tiny" in term.until("> ")
        term.send("Hail\r")
        reply = term.until("> ")
        assert "generation: 6 tokens" in reply and "prompt: " in reply
        term.send("/save talk.hs\r")
        assert "saved 2 messages" in term.until("> ")
        term.send("/reset\r")
        assert "forgotten" in term.until("> ")
        term.send("/load talk.hs\r")
        assert "loaded 2 messages" in term.until("> ")
        term.send("\x1b[A\r")                                   # the up arrow: /load talk.hs again
        assert "loaded 2 messages" in term.until("> ")
        term.send("/nope\r")
        assert "unknown command /nope" in term.until("> ")
        term.send("\x04")                                       # Ctrl-D
    finally:
        code = term.close()
    assert code == 0 and (tmp_path / "talk.hs").is_file()


# ---- found by reading the change ------------------------------------------------------------

def test_the_server_applies_the_checkpoints_repetition_penalty(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from hebrus import serve
    folder = hebrus.load("tiny").save(tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "repetition_penalty": 3.0}))
    model = hebrus.load(folder, mode="fast")
    app, scheduler = serve.build(model, "m")
    try:
        with TestClient(app) as client:
            served = client.post("/v1/completions", json={"model": "m", "prompt": "Hail", "max_tokens": 12}).json()
    finally:
        scheduler.stop(drain_seconds=1)
    penalised = model.session().generate(list(b"Hail"), max_new_tokens=12, repetition_penalty=3.0)
    assert served["choices"][0]["text"] == model.tokenizer.decode(penalised)
    assert served["choices"][0]["text"] == hebrus.generate(model, "Hail", max_new_tokens=12)


def test_a_stop_near_the_context_limit_is_a_stop_not_the_limit():
    model = hebrus.load("tiny", mode="fast")
    s = model.session()
    s.prefill(list(range(60, 120)) * 17)
    stream = s.generate_text("ab", max_new_tokens=50, temperature=0, stop=[chr(c) for c in range(1, 256)] + ["\ufffd"])
    list(stream)
    assert stream.finish == "stop" and not stream.context_ended


def test_a_prompt_past_the_context_is_refused_before_anything_is_fed():
    model = hebrus.load("tiny", mode="fast")
    s = model.session()
    s.feed([1, 2, 3])
    with pytest.raises(hebrus.InvalidInput, match="context limit of 1024 tokens \\(1021 left\\)"):
        list(s.generate_text("x" * 1100))
    assert s.frontier == 3


def test_none_means_the_default_for_every_option(exact):
    stream = hebrus.stream_generate(exact, "x", max_new_tokens=None, temperature=None, stop=None, seed=None)
    assert stream.options.max_new_tokens == text.MAX_NEW_TOKENS and stream.options.stop == ()


def test_a_seed_given_to_a_conversation_draws_anew_each_turn(exact):
    talk = Conversation(exact, max_new_tokens=4, seed=3)
    first, second = talk.say("Hail"), talk.say("Hail")
    assert (first.seed, second.seed) == (3, 4)
    assert talk.say("Hail", seed=9).seed == 9                 # a seed for one turn is that turn's


def test_a_note_is_limited_as_the_file_holds_it(tmp_path, exact):
    s = exact.session()
    from hebrus.snapshot import NOTE_BYTES, read_note
    with pytest.raises(hebrus.InvalidInput, match="as JSON"):
        s.save(tmp_path / "a", note="\x01" * (NOTE_BYTES // 5))     # six bytes each as JSON
    with pytest.raises(hebrus.InvalidInput, match="lone surrogate"):
        s.save(tmp_path / "b", note="\udce9")
    s.save(tmp_path / "c", note="fine ☃")
    assert read_note(tmp_path / "c") == "fine ☃"


def test_the_server_socket_listens_only_once_serving(tmp_path):
    import socket
    from hebrus.cli import _listening
    held = _listening("127.0.0.1", 0)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(held.getsockname(), timeout=30).close()
    finally:
        held.close()
    with socket.create_server(("127.0.0.1", 0)) as other:          # another server, serving
        with pytest.raises(hebrus.InvalidInput, match="in use"):
            _listening("127.0.0.1", other.getsockname()[1])


@pytest.mark.parametrize("value, message", [("²", "whole number"), ("0", "HEBRUS_THREADS must lie"),
                                            ("99999999", "whole number")])
def test_hebrus_threads_is_checked(value, message, monkeypatch, capsys):
    from hebrus.cli import main
    monkeypatch.setenv("HEBRUS_THREADS", value)
    assert main(["info", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_line_the_tokenizer_refuses_does_not_end_the_chat(tmp_path):
    """A line that is not text (a byte that is not UTF-8) is said to be refused; the next is
    answered."""
    import io
    from hebrus import repl
    from foreign import build
    from test_text import write_tokenizer
    folder, _ = build("qwen3_5", tmp_path, vocab_size=320)
    write_tokenizer(folder)
    lines = iter(["caf\udce9", "hi"])

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    out, err = io.StringIO(), io.StringIO()
    assert repl.run(hebrus.load(folder, mode="fast"), "m", read=read, out=out, err=err, max_new_tokens=3,
                    temperature=0) == 0
    assert "not UTF-8" in err.getvalue() and "generation: 3 tokens" in err.getvalue()
