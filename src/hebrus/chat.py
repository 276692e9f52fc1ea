"""Text at the edge: a checkpoint's tokenizer (`tokenizer.json` through `tokenizers`), its chat
template (rendered in a sandboxed `jinja2`) and its end-of-sequence ids. Presets and folders
without a tokenizer use the byte tokenizer (`hebrus.tokenizer`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hebrus.errors import InvalidInput
from hebrus.text import shown
from hebrus.tokenizer import StreamDecoder, encode


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
        try:
            self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:                        # tokenizers raises a bare Exception
            raise InvalidInput(f"{folder / 'tokenizer.json'}: cannot be read as a tokenizer ({exc})") from None
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if size > vocab_size:
            raise InvalidInput(f"{folder / 'tokenizer.json'} has {size} tokens but the model's vocabulary has "
                               f"{vocab_size}: the tokenizer does not belong to this model")
        self.name = "tokenizer.json"
        settings = _json(folder / "tokenizer_config.json")
        self.template = _template(folder, settings)
        self.special = {key: _token_text(settings.get(key)) for key in ("bos_token", "eos_token")}
        self.stop_ids = self._stop_ids(settings, vocab_size)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def stream(self):
        return _TokenStream(self.tokenizer)

    def chat(self, text: str) -> str:
        """The prompt for one user message, with the assistant's turn opened."""
        if self.template is None:
            return ByteText().chat(text)
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.template).render(
                messages=[{"role": "user", "content": text}], add_generation_prompt=True, **self.special)
        except TemplateError as exc:
            raise InvalidInput(f"the chat template of {self.folder} failed: {exc}") from None

    def _stop_ids(self, settings: dict, vocab_size: int) -> tuple[int, ...]:
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


def text_for(model) -> ByteText | CheckpointText:
    folder = getattr(model, "source", None)
    if folder is not None and (folder / "tokenizer.json").is_file():
        return CheckpointText(folder, model.spec.vocab_size)
    return ByteText()


def _json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"{file}: is not readable JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def _template(folder: Path, settings: dict) -> str | None:
    file = folder / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = settings.get("chat_template")
    if isinstance(template, list):                      # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(value) -> str:
    if isinstance(value, dict):                         # {"content": "<|im_end|>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""
