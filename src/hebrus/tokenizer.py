"""Byte-level text conversion, used only at the edges (CLI). Token id = byte value."""
from __future__ import annotations

import codecs

from hebrus.errors import InvalidInput
from hebrus.text import hidden


def encode(text: str) -> list[int]:
    """UTF-8 bytes. Bytes that were not UTF-8 on the command line reach Python as escapes
    (U+DC80..U+DCFF) and come back as those bytes; any other lone surrogate is refused."""
    if not isinstance(text, str):
        raise InvalidInput(f"text must be a str, got {type(text).__name__}")
    try:
        return list(text.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"the text holds a lone surrogate U+{ord(exc.object[exc.start]):04X} at "
                           f"index {exc.start}, which has no UTF-8 encoding") from None


class StreamDecoder:
    """Turns ids into text as they arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return _printable(self._decoder.decode(bytes([token]) if 0 <= token < 256 else b"\xef\xbf\xbd"))

    def flush(self) -> str:
        return _printable(self._decoder.decode(b"", final=True))


def _printable(text: str) -> str:
    """Control characters other than newline and tab would drive the terminal, and bidi
    controls would reorder it; each is shown as U+FFFD."""
    return "".join("\ufffd" if hidden(c) else c for c in text)
