"""Progress on stderr through tqdm, behind the callable the library takes: `bar(done, total, what)`."""
from __future__ import annotations

import sys

from tqdm import tqdm


class ProgressBar:
    """A tqdm bar created on the first call (so `total` is known), closed when done == total;
    silent when the stream is not a terminal."""

    def __init__(self, label: str, stream=None, unit: str = "it"):
        self.label, self.stream, self.unit = label, sys.stderr if stream is None else stream, unit
        self.bar: tqdm | None = None

    def __call__(self, done: int, total: int, what: str = "") -> None:
        if self.bar is None:
            self.bar = tqdm(total=total, desc=self.label, unit=self.unit, file=self.stream, leave=True,
                            dynamic_ncols=True, mininterval=0.2, disable=None)   # off when not a terminal
        self.bar.update(done - self.bar.n)
        if what:
            self.bar.set_postfix_str(what[:60], refresh=False)
        if done >= total:
            self.bar.close()
