"""Conversations as prompts: a checkpoint's chat template (rendered in a sandboxed `jinja2`, in a
child process with a time and memory limit), or, for a model without one, the plain format:
each message's role in capitals, a full stop, and its text, the way the shipped model's plays
name their speakers."""
from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from hebrus.errors import InvalidInput
from hebrus.show import shown
from hebrus.weights.files import read_text

RENDER_SECONDS = 5.0            # a chat template that takes longer is refused
RENDER_BYTES = 1 << 30          # the memory a template's rendering may use
RENDER_CHARS = 1 << 22          # the longest prompt a template may produce

ROLES = ("system", "user", "assistant", "developer", "tool")
_MARKERS = frozenset(f"{role.upper()}." for role in ROLES)
PLAIN_STOPS = ("\n\n",)         # in the plain format a speech ends with a blank line


EXTRA = {"tool_calls": list, "tool_call_id": str, "name": str}     # what a message may hold besides


def checked(messages) -> list[dict[str, str]]:
    """`messages` as a list of {"role", "content"} dicts of strings, the role one of ROLES; an
    assistant's message may hold `tool_calls` ({"id", "type", "function": {"name",
    "arguments"}} dicts, its arguments a JSON object's text or the object), a tool's its
    `tool_call_id`, and any its `name`."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidInput("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidInput(f"message {i} must be a dict with a string 'role' and a string 'content', got "
                               f"{shown(m)}")
        if m["role"] not in ROLES:
            raise InvalidInput(f"message {i} has the role {shown(m['role'])}; roles are: {', '.join(ROLES)}")
        message = {"role": m["role"], "content": m["content"]}
        for key, kind in EXTRA.items():
            if m.get(key) is not None:
                if not isinstance(m[key], kind):
                    raise InvalidInput(f"message {i}: {key} must be a {kind.__name__}")
                message[key] = _calls(m[key], i) if key == "tool_calls" else m[key]
        out.append(message)
    return out


def _calls(calls: list, i: int) -> list[dict]:
    """An assistant's tool calls as templates read them: each function's arguments an object."""
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidInput(f"message {i}: a tool call is {{'function': {{'name': ..., 'arguments': ...}}}}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise InvalidInput(f"message {i}: the arguments of a call of {function['name']!r} are not JSON") from None
        if not isinstance(arguments, dict):
            raise InvalidInput(f"message {i}: the arguments of a call of {function['name']!r} must be a JSON object")
        out.append({**call, "function": {"name": function["name"], "arguments": arguments}})
    return out


def plain(messages: list[dict[str, str]]) -> str:
    """Each message as `ROLE.` on a line of its own, then its text and a blank line; then the
    assistant's line, opening its turn. A line of a message's text that reads as a role's line
    (whatever its case and the space around it) is escaped with a backslash, so no message can
    open a turn of another role."""
    return "".join(f"{m['role'].upper()}.\n{_escaped(m['content'])}\n\n" for m in messages) + "ASSISTANT.\n"


def _escaped(text: str) -> str:
    return "\n".join("\\" + line if line.strip().upper() in _MARKERS else line for line in text.split("\n"))


def find(folder: Path, settings: dict) -> str | None:
    """The folder's chat template: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or named templates of which "default" is taken)."""
    file = folder / "chat_template.jinja"
    if os.path.lexists(file):
        return read_text(file)
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = [t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"]
        template = named[0] if named else None
    if template is not None and not isinstance(template, str):
        raise InvalidInput(f"{folder / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                           f"{{name, template}}, got {shown(template)}")
    return template


def render(template: str, messages: list[dict[str, str]], special: dict[str, str], folder: Path | None,
           tools: list[dict] | None = None) -> str:
    """The conversation through the template, the assistant's turn opened (`tools`: the
    functions it may call, OpenAI's {"type": "function", "function": {...}} dicts)."""
    context = {"messages": messages, "add_generation_prompt": True, **special}
    if tools:
        context["tools"] = tools
    return _render(template, context, folder)


def pieces(template: str, messages: list[dict[str, str]], special: dict[str, str],
           folder: Path | None, tools: list[dict] | None = None) -> list[tuple[bool, str]]:
    """The rendered conversation as (is the template's own text, text) pieces, so that the
    template's text and the messages' can be encoded differently (the messages' literally: a
    special token typed in a message stays its characters). Rendered twice, with a marker in
    place of each message's text and with the text itself: where the template changes a
    message's text (trims it, drops an earlier reply's reasoning), each message's piece is what
    the template made of it, found between the template's own pieces; InvalidInput where that
    cannot be told for certain."""
    marked = [dict(m, content=f"\ue000{i}\ue001") for i, m in enumerate(messages)]
    parts = re.split("\ue000(\\d+)\ue001", render(template, marked, special, folder, tools))
    own, said = parts[0::2], [messages[int(i)]["content"] if int(i) < len(messages) else None for i in parts[1::2]]
    if None in said:
        raise InvalidInput(f"the chat template of {folder} writes a message that is not in the conversation")
    text = render(template, messages, special, folder, tools)
    if "".join(o + m for o, m in zip(own, said + [""])) == text:
        return [(True, own[0])] + [piece for m, o in zip(said, own[1:]) for piece in ((False, m), (True, o))]
    return _aligned(own, said, text, folder)


def _aligned(own: list[str], said: list[str], text: str, folder: Path | None) -> list[tuple[bool, str]]:
    """`text` split into the template's pieces `own` and, between them, what it made of each
    message of `said` (some part of it): each split the only one possible."""
    if not text.startswith(own[0]):
        raise InvalidInput(f"the chat template of {folder} writes different text around different messages; "
                           f"hebrus cannot tell its text from theirs")
    out, at = [(True, own[0])], len(own[0])
    for k, message in enumerate(said):
        after = own[k + 1]
        last = k == len(said) - 1
        ends = [len(text) - len(after)] if last else [j for j in _starts(text, after, at)]
        fits = [j for j in ends if j >= at and text.startswith(after, j) and text[at:j] in message]
        if len(fits) != 1:
            raise InvalidInput(f"the chat template of {folder} changes a message's text in a way hebrus cannot "
                               f"tell apart from its own text; the message cannot be encoded safely")
        out += [(False, text[at:fits[0]]), (True, after)]
        at = fits[0] + len(after)
    return out


def _starts(text: str, part: str, at: int) -> list[int]:
    """Where `part` occurs in `text` from `at` on (every position, for an empty part)."""
    found, j = [], text.find(part, at)
    while j != -1:
        found.append(j)
        j = text.find(part, j + 1) if j < len(text) else -1
    return found


def _render(template: str, context: dict[str, Any], folder: Path | None) -> str:
    """The template rendered in a child process (fork) limited to RENDER_SECONDS and RENDER_BYTES,
    so a template that loops or grows without end is refused instead of hanging the caller.
    Where fork is unavailable it renders here, sandboxed but unlimited."""
    import multiprocessing
    try:
        ctx = multiprocessing.get_context("fork")
    except ValueError:
        return _render_here(template, context, folder)
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_render_child, args=(template, context, folder, send), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(RENDER_SECONDS):
            raise InvalidInput(f"the chat template of {folder} took more than {RENDER_SECONDS:g} s to render")
        ok, value = receive.recv()
    except EOFError:
        raise InvalidInput(f"the chat template of {folder} failed: its rendering ran out of memory or "
                           f"crashed") from None
    finally:
        child.kill()
        child.join()
        receive.close()
    if not ok:
        raise InvalidInput(value)
    return value


def _render_child(template, context, folder, send) -> None:
    import resource
    try:
        resource.setrlimit(resource.RLIMIT_AS, (RENDER_BYTES, RENDER_BYTES))
    except (ValueError, OSError):
        pass
    try:
        send.send((True, _render_here(template, context, folder)))
    except InvalidInput as exc:
        send.send((False, str(exc)))
    except BaseException as exc:                        # MemoryError, anything: report, never hang
        send.send((False, f"the chat template of {folder} failed: {type(exc).__name__}"))


def _render_here(template: str, context: dict[str, Any], folder: Path | None) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class TemplateRaised(Exception):
        pass

    def raise_exception(message):
        raise TemplateRaised(message)

    def tojson(value, indent=None):
        return json.dumps(value, ensure_ascii=False, indent=indent)

    def strftime_now(form: str) -> str:
        return datetime.now().strftime(form)

    # What chat templates in the wild use: {% break %} / {% continue %}, tojson that keeps
    # non-ASCII text, today's date, and raising an error with a message.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        parts, size = [], 0
        for part in env.from_string(template).generate(**context):
            size += len(part)
            if size > RENDER_CHARS:
                raise InvalidInput(f"the chat template of {folder} produced more than {RENDER_CHARS} characters")
            parts.append(part)
        return "".join(parts)
    except InvalidInput:
        raise
    except Exception as exc:                            # any error of the template's own making
        raise InvalidInput(f"the chat template of {folder} failed: {type(exc).__name__}: "
                           f"{shown(str(exc))}") from None
