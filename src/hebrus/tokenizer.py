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


def _printable(text: str) -> str:
    """Control characters other than newline and tab would drive the terminal; show U+FFFD."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else "\ufffd" for c in text)
