"""A one-line progress bar on stderr (no dependency)."""
from __future__ import annotations

import sys
import time


class ProgressBar:
    def __init__(self, label: str, stream=None, width: int = 28):
        stream = sys.stderr if stream is None else stream
        self.label, self.stream, self.width = label, stream, width
        self.started = time.perf_counter()
        self.tty = hasattr(stream, "isatty") and stream.isatty()

    def __call__(self, done: int, total: int, what: str) -> None:
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        line = f"{self.label} [{bar}] {done}/{total} {time.perf_counter() - self.started:5.1f}s {what}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:120])
            if done == total:
                self.stream.write("\n")
        elif done == total or done % max(total // 10, 1) == 0:
            self.stream.write(line + "\n")
        self.stream.flush()
