"""Text at the edge: a checkpoint's tokenizer (`tokenizer.json` through `tokenizers`), its chat
template (rendered in a sandboxed `jinja2`, in a child process with a time and memory limit) and
its end-of-sequence ids. Presets and folders without a tokenizer use the byte tokenizer
(`hebrus.tokenizer`). Every file here is untrusted input, read like a checkpoint's."""
from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from hebrus.errors import InvalidInput
from hebrus.text import shown
from hebrus.tokenizer import StreamDecoder, encode
from hebrus.weights.files import read_json, read_text, regular_file

RENDER_SECONDS = 5.0            # a chat template that takes longer is refused
RENDER_BYTES = 1 << 30          # the memory a template's rendering may use
RENDER_CHARS = 1 << 22          # the longest prompt a template may produce


class ByteText:
    """Token id = byte; no chat template, no end-of-sequence id."""
    name = "bytes"
    stop_ids: tuple[int, ...] = ()
    template = None

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def stream(self):
        return _ByteStream()

    def chat(self, text: str) -> str:
        raise InvalidInput("--chat needs a checkpoint with a chat template (tokenizer_config.json or "
                           "chat_template.jinja); this model has none")

    def conversation(self, messages: list[dict[str, str]]) -> str:
        """A whole conversation as a prompt, for a model without a chat template: each message
        as its role in capitals, a full stop and its text (the way the shipped model's plays
        name their speakers), then the assistant's name, opening its turn."""
        return _plain_conversation(messages)

    def conversation_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(_plain_conversation(messages))


class _ByteStream:
    def __init__(self):
        self.decoder = StreamDecoder()

    def push(self, token: int) -> str:
        return self.decoder.push(token)

    def flush(self) -> str:
        return self.decoder.flush()


class CheckpointText:
    """A checkpoint's tokenizer, template and stop ids."""

    def __init__(self, folder: Path, vocab_size: int):
        from tokenizers import Tokenizer
        self.folder = folder
        file = regular_file(folder / "tokenizer.json")
        try:
            self.tokenizer = Tokenizer.from_str(read_text(file))
        except InvalidInput:
            raise
        except Exception as exc:                        # tokenizers raises a bare Exception
            raise InvalidInput(f"{file}: cannot be read as a tokenizer ({exc})") from None
        ids = self.tokenizer.get_vocab(with_added_tokens=True).values()
        size = max(ids, default=-1) + 1
        if size > vocab_size:
            raise InvalidInput(f"{file} has token ids up to {size - 1} but the model's vocabulary has "
                               f"{vocab_size}: the tokenizer does not belong to this model")
        self.name = "tokenizer.json"
        settings = _json(folder / "tokenizer_config.json")
        self.template = _template(folder, settings)
        self.special = {key: _token_text(settings.get(key)) for key in ("bos_token", "eos_token")}
        self.stop_ids = self._stop_ids(vocab_size)
        self._literally = None                          # the tokenizer that ignores special tokens

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidInput(f"text must be a str, got {type(text).__name__}")
        bad = next((i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF), None)
        if bad is not None:
            what = (f"the byte 0x{ord(text[bad]) - 0xDC00:02X}, which is not UTF-8" if ord(text[bad]) >= 0xDC80
                    else f"a lone surrogate U+{ord(text[bad]):04X}")
            raise InvalidInput(f"the text holds {what} at index {bad}; this model's tokenizer takes "
                               f"Unicode text")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def stream(self):
        return _TokenStream(self.tokenizer)

    def chat(self, text: str) -> str:
        """The prompt for one user message, with the assistant's turn opened."""
        if self.template is None:
            return ByteText().chat(text)
        context = {"messages": [{"role": "user", "content": text}], "add_generation_prompt": True, **self.special}
        return _render(self.template, context, self.folder)

    def conversation(self, messages: list[dict[str, str]]) -> str:
        """A whole conversation (`{"role", "content"}` dicts) through the chat template, the
        assistant's turn opened; without a template, as `ByteText.conversation` writes it."""
        if self.template is None:
            return _plain_conversation(messages)
        context = {"messages": messages, "add_generation_prompt": True, **self.special}
        return _render(self.template, context, self.folder)

    def conversation_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation's token ids with what the messages say taken as text only: a
        special token typed inside a message (`<|im_start|>system`, say) is encoded as its
        characters, never as the token, so no message can open a turn of another role. The
        template is rendered with a marker in place of each message's text; the template's
        own text is encoded as usual, each message's text literally."""
        if self.template is None:
            return self._literal(_plain_conversation(messages))
        marked = [dict(m, content=f"\ue000{i}\ue001") for i, m in enumerate(messages)]
        context = {"messages": marked, "add_generation_prompt": True, **self.special}
        parts = re.split("\ue000(\\d+)\ue001", _render(self.template, context, self.folder))
        ids = []
        for j, part in enumerate(parts):
            if j % 2 == 0:
                ids += self.encode(part)
            elif int(part) < len(messages):
                ids += self._literal(messages[int(part)]["content"])
        return ids

    def _literal(self, text: str) -> list[int]:
        self.encode(text)                                # its checks (Unicode) first
        if self._literally is None:
            from tokenizers import Tokenizer
            self._literally = Tokenizer.from_str(self.tokenizer.to_str())
            self._literally.encode_special_tokens = True
        return self._literally.encode(text, add_special_tokens=False).ids

    def _stop_ids(self, vocab_size: int) -> tuple[int, ...]:
        """generation_config.json's eos_token_id, else config.json's, else the tokenizer's eos token."""
        for file in ("generation_config.json", "config.json"):
            ids = _json(self.folder / file).get("eos_token_id")
            if ids is not None:
                ids = ids if isinstance(ids, list) else [ids]
                if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
                    raise InvalidInput(f"{self.folder / file}: eos_token_id must be token ids below {vocab_size}, "
                                       f"got {shown(ids)}")
                return tuple(ids)
        eos = self.special.get("eos_token")
        token = self.tokenizer.token_to_id(eos) if eos else None
        return (token,) if token is not None else ()


class _TokenStream:
    """Text as ids arrive, holding back bytes of a character split across tokens."""

    def __init__(self, tokenizer):
        from tokenizers.decoders import DecodeStream
        self.tokenizer, self.decoder = tokenizer, DecodeStream(skip_special_tokens=False)

    def push(self, token: int) -> str:
        try:
            return self.decoder.step(self.tokenizer, token) or ""
        except Exception:                               # an id the tokenizer does not know
            return "\ufffd"

    def flush(self) -> str:
        return ""


ROLES = ("system", "user", "assistant", "developer", "tool")
_MARKERS = frozenset(f"{role.upper()}." for role in ROLES)


def _plain_conversation(messages: list[dict[str, str]]) -> str:
    """Each message as `ROLE.` on a line of its own, then its text; the assistant's turn opened.
    A line of a message's text that reads as a role's line (whatever its case and the space
    around it) is escaped with a backslash, so no message can open a turn of another role."""
    return "".join(f"{m['role'].upper()}.\n{_escaped(m['content'])}\n\n" for m in messages) + "ASSISTANT.\n"


def _escaped(text: str) -> str:
    return "\n".join("\\" + line if line.strip().upper() in _MARKERS else line for line in text.split("\n"))


def text_for(model) -> ByteText | CheckpointText:
    """The model's text: its checkpoint's tokenizer.json when the folder has one, else bytes."""
    folder = getattr(model, "source", None)
    if folder is not None and os.path.lexists(folder / "tokenizer.json"):
        return CheckpointText(folder, model.spec.vocab_size)
    return ByteText()


def _render(template: str, context: dict[str, Any], folder: Path) -> str:
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


def _render_here(template: str, context: dict[str, Any], folder: Path) -> str:
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


def _json(file: Path) -> dict[str, Any]:
    """An optional JSON object file: {} when absent; an error when it is there but is not one."""
    if not os.path.lexists(file):
        return {}
    data = read_json(file)
    if not isinstance(data, dict):
        raise InvalidInput(f"{file}: must hold a JSON object, got {shown(data)}")
    return data


def _template(folder: Path, settings: dict) -> str | None:
    file = folder / "chat_template.jinja"
    if os.path.lexists(file):
        return read_text(file)
    template = settings.get("chat_template")
    if isinstance(template, list):                      # named templates: take "default"
        named = [t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"]
        template = named[0] if named else None
    if template is not None and not isinstance(template, str):
        raise InvalidInput(f"{folder / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                           f"{{name, template}}, got {shown(template)}")
    return template


def _token_text(value) -> str:
    if isinstance(value, dict):                         # {"content": "<|im_end|>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""
