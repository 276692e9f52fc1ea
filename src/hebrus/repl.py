"""`hebrus chat`: a conversation at the terminal. Each line typed is a user's message; the reply
streams as it comes, with a line of counts after it. The conversation stays in one session
(`hebrus.text.Conversation`), so a turn feeds only its new tokens. Lines are edited and
recalled with the arrow keys where `readline` is available."""
from __future__ import annotations

import sys

from hebrus.errors import ChunkAborted, InvalidInput
from hebrus.show import escaped
from hebrus.text import Conversation, summary
from hebrus.text.tokenizers import printable

HELP = """commands:
  /reset        forget the conversation (a system message stays)
  /save FILE    save the conversation (a session snapshot, with the messages kept in it)
  /load FILE    continue a conversation /save wrote
  /help         this list
  /quit         leave (Ctrl-D too)"""


def run(model, name: str, system: str | None = None, progress=None, read=input, out=None, err=None,
        **options) -> int:
    """Talk until /quit or end of input; 0."""
    out, err = out or sys.stdout, err or sys.stderr
    _readline()
    conversation = Conversation(model, system, **options)
    print(f"hebrus chat with {name}; /help for commands, Ctrl-D to leave", file=err, flush=True)
    while True:
        try:
            line = read("> ")
        except EOFError:
            print(file=out)
            return 0
        except KeyboardInterrupt:
            print("^C", file=out)
            continue
        except UnicodeDecodeError:
            print("hebrus: that line is not UTF-8 text; type it again", file=err, flush=True)
            continue
        if line.startswith("/"):
            if _command(conversation, line, out, err) == "quit":
                return 0
        elif line.strip():
            _turn(conversation, line, progress, out, err)


def _turn(conversation: Conversation, line: str, progress, out, err) -> None:
    """One reply, streamed; Ctrl-C stops it where it is (what was said so far is kept). A line
    the tokenizer refuses, or a failed chunk, is said and the conversation goes on."""
    try:
        stream = conversation.say(line, progress=progress)
        for piece in stream:
            out.write(printable(piece))
            out.flush()
    except KeyboardInterrupt:
        out.write(" ^C")
    except (ChunkAborted, InvalidInput) as exc:
        out.write("\n")
        print(escaped(f"hebrus: {exc}"), file=err, flush=True)
        if "context limit" in str(exc):
            print("(the conversation is as long as this model can hold: /reset starts a new one)", file=err,
                  flush=True)
        return
    out.write("\n")
    out.flush()
    print(summary(stream), file=err, flush=True)


def _command(conversation: Conversation, line: str, out, err) -> str | None:
    word, _, rest = line.strip().partition(" ")
    rest = rest.strip()
    try:
        if word in ("/quit", "/exit"):
            return "quit"
        if word == "/help":
            print(HELP, file=out)
        elif word == "/reset":
            conversation.reset()
            print("(the conversation is forgotten)", file=err)
        elif word in ("/save", "/load") and not rest:
            print(f"{word} needs a file: {word} FILE", file=err)
        elif word == "/save":
            conversation.save(rest)
            print(f"(saved {_count(len(conversation.messages), 'message')}, "
                  f"{_count(conversation.session.frontier, 'token')}, to {rest})", file=err)
        elif word == "/load":
            conversation.load(rest)
            print(f"(loaded {_count(len(conversation.messages), 'message')}, "
                  f"{_count(conversation.session.frontier, 'token')}, from {rest})", file=err)
        else:
            print(f"unknown command {word}; /help lists them", file=err)
    except (InvalidInput, OSError) as exc:
        print(escaped(f"hebrus: {exc}"), file=err)
    err.flush()
    return None


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _readline() -> None:
    """Line editing and recall of earlier lines for `input`, where the platform has it."""
    try:
        import readline  # noqa: F401
    except ImportError:
        pass
