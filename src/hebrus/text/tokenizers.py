"""A model's tokenizer: its checkpoint's `tokenizer.json` (through `tokenizers`), or bytes (token
id = byte) for presets and folders without one; its chat template, end-of-sequence ids and
sampling defaults (`generation_config.json`). Every file here is untrusted input, read like a
checkpoint's."""
from __future__ import annotations

import abc
import codecs
import functools
import os
import re
from pathlib import Path
from typing import Any

from hebrus import arguments
from hebrus.errors import InvalidInput
from hebrus.show import hidden, shown
from hebrus.text import templates
from hebrus.weights.files import read_json, read_text, regular_file


class _Tokenizer(abc.ABC):
    """What both kinds share: chat through the template (or the plain format without one),
    stop ids, and the checkpoint's sampling defaults."""
    name: str
    folder: Path | None
    template: str | None = None
    special: dict[str, str] = {}
    stop_ids: tuple[int, ...] = ()

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """`text`'s ids."""

    @abc.abstractmethod
    def literal(self, text: str) -> list[int]:
        """`text`'s ids with anything that looks like a special token taken as its characters."""

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = True,
                            tools: list[dict] | None = None) -> list[int] | str:
        """A conversation (`{"role", "content"}` dicts) with the assistant's turn opened: its ids
        (`tokenize`), in which what the messages say is always text (a special token typed in a
        message is its characters, so no message can open a turn of another role), or its text.
        Without a chat template, the plain format (`templates.plain`). `tools`: the functions the
        assistant may call (OpenAI's {"type": "function", "function": {...}} dicts), for a
        template that takes them (`takes_tools`; InvalidInput otherwise)."""
        messages = templates.checked(messages)
        if tools and not self.takes_tools:
            raise InvalidInput("this model's chat template does not take tools")
        self._no_special_text(tools, [{k: v for k, v in m.items() if k not in ("role", "content")} for m in messages])
        if self.template is None:
            text = templates.plain(messages)
            return self.literal(text) if tokenize else text
        if not tokenize:
            return templates.render(self.template, messages, self.special, self.folder, tools)
        ids = []
        for own, piece in templates.pieces(self.template, messages, self.special, self.folder, tools):
            ids += self.encode(piece) if own else self.literal(piece)
        return ids

    special_texts: tuple[str, ...] = ()            # the text of each special token

    def _no_special_text(self, *values) -> None:
        """InvalidInput where a string in `values` (tools, tool calls, names: what the template
        writes as its own text, encoded with special tokens) holds a special token's text, which
        would open a turn of another role; a message's content is encoded literally instead."""
        if not self.special_texts:
            return
        for text in _strings(values):
            found = next((t for t in self.special_texts if t in text), None)
            if found is not None:
                raise InvalidInput(f"a tool, tool call or name holds the special token {found!r}; only a "
                                   f"message's content may")

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template renders `tools` (the plain format does not)."""
        return self.template is not None and "tools" in self.template

    @property
    def chat_stops(self) -> tuple[str, ...]:
        """Texts that end an assistant's turn besides the stop ids: in the plain format, the
        blank line before the next speaker."""
        return templates.PLAIN_STOPS if self.template is None else ()

    @functools.cached_property
    def generation_config(self) -> dict[str, Any]:
        """The checkpoint's sampling defaults (`generation_config.json`), checked, read once:
        any of temperature, top_p, top_k, min_p, repetition_penalty; {} when it has none."""
        return sampling_defaults(self.folder)


class ByteTokenizer(_Tokenizer):
    """Token id = byte; no chat template (the plain format), no end-of-sequence id."""
    name = "bytes"

    def __init__(self, folder: Path | None = None):
        self.folder = folder

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes. Bytes that were not UTF-8 on the command line reach Python as escapes
        (U+DC80..U+DCFF) and come back as those bytes; any other lone surrogate is refused."""
        if not isinstance(text, str):
            raise InvalidInput(f"text must be a str, got {type(text).__name__}")
        try:
            return list(text.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError as exc:
            raise InvalidInput(f"the text holds a lone surrogate U+{ord(exc.object[exc.start]):04X} at "
                               f"index {exc.start}, which has no UTF-8 encoding") from None

    literal = encode

    def decode(self, ids) -> str:
        """The text of `ids` (bytes that are not UTF-8, and ids past a byte, as U+FFFD; control
        characters are the model's, kept)."""
        stream = self.stream()
        return "".join(stream.push(int(i)) for i in ids) + stream.flush()

    def stream(self) -> "ByteStream":
        return ByteStream()

    def bytes_of(self, token: int) -> bytes:
        """The byte a token stands for (none past a byte)."""
        return bytes([token]) if 0 <= token < 256 else b""


class ByteStream:
    """Turns ids into text as they arrive, holding back incomplete UTF-8 sequences (bytes that
    are not UTF-8, and ids past a byte, come out as U+FFFD). The text is the model's as it is;
    what prints it to a terminal hides control characters (`printable`)."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(bytes([token]) if 0 <= token < 256 else b"\xef\xbf\xbd")

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class CheckpointTokenizer(_Tokenizer):
    """A checkpoint's tokenizer.json, chat template and stop ids."""

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
        self.template = templates.find(folder, settings)
        self.special = {key: _token_text(settings.get(key)) for key in ("bos_token", "eos_token")}
        self.stop_ids = self._stop_ids(vocab_size)
        self._literally = None                          # the tokenizer that ignores special tokens
        self._byte_level: bool | None = None            # whether its vocabulary is byte-level (`bytes_of`)
        self.special_texts = tuple(t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special)

    def encode(self, text: str) -> list[int]:
        _check_unicode(text)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def literal(self, text: str) -> list[int]:
        _check_unicode(text)
        if self._literally is None:
            from tokenizers import Tokenizer
            self._literally = Tokenizer.from_str(self.tokenizer.to_str())
            self._literally.encode_special_tokens = True
        return self._literally.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        stream = self.stream()
        return "".join(stream.push(int(i)) for i in ids) + stream.flush()

    def stream(self) -> "TokenStream":
        return TokenStream(self.tokenizer)

    def bytes_of(self, token: int) -> bytes:
        """The bytes a token stands for, a piece of a character's too: read from its name in a
        byte-level vocabulary (each byte one printable character) or a byte-fallback one
        (`<0xNN>`), else the UTF-8 of its decoding; none for an id the tokenizer does not know."""
        name = self.tokenizer.id_to_token(token)
        if name is None:
            return b""
        fallback = _BYTE_PIECE.fullmatch(name)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if self._byte_level is None:
            self._byte_level = '"ByteLevel"' in self.tokenizer.to_str()
        if self._byte_level and all(c in _UNBYTE for c in name):
            return bytes(_UNBYTE[c] for c in name)
        return self.tokenizer.decode([token], skip_special_tokens=False).encode()

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


def _byte_characters() -> dict[str, int]:
    """A byte-level vocabulary's character for each byte, inverted: printable Latin-1 bytes stand
    for themselves, the others for 256 + their rank among them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_UNBYTE = _byte_characters()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenStream:
    """Text as ids arrive, holding back bytes of a character split across tokens (an id the
    tokenizer does not know comes out as U+FFFD; what is still held back when the ids end is
    dropped, as the tokenizer's own streaming decoder does)."""

    def __init__(self, tokenizer):
        from tokenizers.decoders import DecodeStream
        self.tokenizer, self.decoder = tokenizer, DecodeStream(skip_special_tokens=False)

    def push(self, token: int) -> str:
        if self.tokenizer.id_to_token(token) is None:   # an id the tokenizer does not know
            return "\ufffd"
        try:
            return self.decoder.step(self.tokenizer, token) or ""
        except Exception:
            return "\ufffd"

    def flush(self) -> str:
        return ""


def _strings(value):
    """Every string inside nested lists, tuples and dicts (keys too)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def tokenizer_for(model) -> ByteTokenizer | CheckpointTokenizer:
    """The model's tokenizer: its checkpoint's tokenizer.json when the folder has one, else bytes."""
    folder = getattr(model, "source", None)
    if folder is not None and os.path.lexists(folder / "tokenizer.json"):
        return CheckpointTokenizer(folder, model.spec.vocab_size)
    return ByteTokenizer(folder)


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(folder: Path | None) -> dict[str, Any]:
    """The sampling fields of `folder`'s generation_config.json, each checked as an argument
    would be ({} without the file); `do_sample: false` means greedy (temperature 0)."""
    if folder is None:
        return {}
    file = folder / "generation_config.json"
    data = _json(file)
    out = {}
    for key in SAMPLING_FIELDS:
        if data.get(key) is not None:
            try:
                out[key] = arguments.sampling_option(key, data[key])
            except InvalidInput as exc:
                raise InvalidInput(f"{file}: {exc}") from None
    if data.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def _check_unicode(text) -> None:
    if not isinstance(text, str):
        raise InvalidInput(f"text must be a str, got {type(text).__name__}")
    bad = next((i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF), None)
    if bad is not None:
        what = (f"the byte 0x{ord(text[bad]) - 0xDC00:02X}, which is not UTF-8" if ord(text[bad]) >= 0xDC80
                else f"a lone surrogate U+{ord(text[bad]):04X}")
        raise InvalidInput(f"the text holds {what} at index {bad}; this model's tokenizer takes Unicode text")


def printable(text: str) -> str:
    """Control characters other than newline and tab would drive the terminal, and bidi
    controls would reorder it; each is shown as U+FFFD."""
    return "".join("\ufffd" if hidden(c) else c for c in text)


def _json(file: Path) -> dict[str, Any]:
    """An optional JSON object file: {} when absent; an error when it is there but is not one."""
    if not os.path.lexists(file):
        return {}
    data = read_json(file)
    if not isinstance(data, dict):
        raise InvalidInput(f"{file}: must hold a JSON object, got {shown(data)}")
    return data


def _token_text(value) -> str:
    if isinstance(value, dict):                         # {"content": "<|im_end|>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""
