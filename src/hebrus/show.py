"""Showing untrusted text: values cut short, characters that would drive a terminal escaped.

Used where messages quote what a caller or a file supplied, and where generated text is printed.
"""
from __future__ import annotations

import unicodedata
from typing import Any


def shown(value: Any) -> str:
    """repr(value), cut short: a value from an untrusted file can be as long as the file."""
    try:
        text = repr(value)
    except ValueError:                      # an int too long to print
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 60 else f"{text[:50]}... ({len(text)} characters)"


# Bidirectional controls reorder what a terminal shows (U+202E makes text read backwards).
_BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def hidden(c: str) -> bool:
    """Would this character drive or reorder a terminal (a control other than newline and tab,
    or a bidi control)?"""
    return c in _BIDI_CONTROLS or (c not in "\n\t" and unicodedata.category(c) == "Cc")


def escaped(text: str, lines: bool = True) -> str:
    """`text` with every such character written as an escape (newlines too unless `lines`):
    for messages that quote names from untrusted files."""
    return "".join(c.encode("unicode_escape").decode() if hidden(c) or (c == "\n" and not lines) else c
                   for c in text)
