"""Byte-level text conversion, used only at the edges (CLI). Token id = byte value."""
from __future__ import annotations

import codecs
import unicodedata


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class StreamDecoder:
    """Turns ids into text as they arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return _printable(self._decoder.decode(bytes([token]) if 0 <= token < 256 else b"\xef\xbf\xbd"))

    def flush(self) -> str:
        return _printable(self._decoder.decode(b"", final=True))


# Bidirectional controls reorder what a terminal shows (U+202E makes text read backwards).
_BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _printable(text: str) -> str:
    """Control characters other than newline and tab would drive the terminal, and bidi
    controls would reorder it; each is shown as U+FFFD."""
    return "".join("\ufffd" if _hidden(c) else c for c in text)


def _hidden(c: str) -> bool:
    return c in _BIDI_CONTROLS or (c not in "\n\t" and unicodedata.category(c) == "Cc")
