"""A session or a generator every rank holds under one number: calls on it run on every rank
(`ParallelModel.call`); what it holds reads rank 0's."""
from __future__ import annotations

import hashlib
import os
import secrets
import weakref

from hebrus.errors import InvalidInput
from hebrus.parallel.calls import SET


class Mirror:
    """An object every rank holds under one number."""

    def __init__(self, owner, number: int, local):
        self._owner, self._number, self._local = owner, number, local
        weakref.finalize(self, owner.dropped, number)

    def _run(self, method: str, *args, **kwargs):
        return self._owner.call(self._number, method, args, kwargs, self._local)

    def __getattr__(self, name: str):
        """What it holds reads rank 0's."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._local, name)


class ParallelSession(Mirror):
    """A session on every rank. `feed`, `prefill`, `generate`, `fork`, `constrain`,
    `feed_keeping` (its sessions on every rank), `host_copy` (a `ParallelHostCopy`) and `save`
    run on every rank; `generate_text` here, driving them; what it holds (`frontier`, `logits`,
    ...) reads rank 0's; `digests()` gives every rank's digest of its part, `digest()` one of
    them all. `save(path)` writes a file a rank, rank 0's `path`, rank r's `path.rank{r}`
    (each atomic, with its part's digest and fingerprint, and the note kept inside a record of
    the save), which `ParallelModel.restore(path)` reads back."""

    CALLS = ("feed", "prefill", "generate", "fork", "constrain", "host_copy", "feed_keeping")

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self.CALLS:
            def call(*args, **kwargs):
                if name == "generate" and kwargs.get("seed", 0) is None:
                    kwargs["seed"] = secrets.randbits(62)         # one draw for every rank
                return self._run(name, *args, **kwargs)
            return call
        value = getattr(self._local, name)
        if callable(value):
            raise InvalidInput(f"session.{name}() is not available under tensor parallelism yet; these are: "
                               f"{', '.join(self.CALLS + ('generate_text', 'save', 'digest', 'digests'))}")
        return value

    @property
    def over_ranks(self):
        """The `ParallelModel` this session's ranks belong to (`hebrus.feed_many` takes several
        sessions through it)."""
        return self._owner

    @property
    def local(self):
        """This process's part of the session (rank 0's `Session`): to read, never to feed (it
        steps only with the other ranks, through this session)."""
        return self._local

    def generate_text(self, prompt, **options):
        """`Session.generate_text`: the text level runs here, each of its steps on every rank."""
        from hebrus.text.generation import stream_text
        return stream_text(self, prompt, **options)

    def save(self, path, note: str | None = None) -> None:
        """Write every rank's part, each to its own file (`rank_file`), all marked as one save:
        first beside it (`path.saving`, each rank's), then, once every rank has written its
        part, each moved over its file. A rank that cannot write its part leaves every rank's
        file as it was."""
        staged = f"{os.fspath(path)}.saving"
        try:
            self._run("save", staged, note=note, **{SET: secrets.token_hex(8)})
        except BaseException:
            try:
                self._owner.call(0, "discard", (staged,), {})
            except Exception:           # what is left of it is said by the save's own error
                pass
            raise
        self._owner.call(0, "settle", (staged, path), {})

    def digests(self) -> list[str]:
        """Each rank's digest of the part of the session it holds, rank by rank."""
        return self._run("digests")

    def digest(self) -> str:
        """SHA-256 of every rank's digest (`digests`), in rank order: it changes when any part
        does."""
        return hashlib.sha256(" ".join(self.digests()).encode()).hexdigest()


class ParallelIterator(Mirror):
    """A generator every rank holds: each step runs on every rank."""

    def __iter__(self):
        return self

    def __next__(self):
        return self._run("__next__")


class ParallelHostCopy(Mirror):
    """A session's published state in host memory on every rank, each rank's part
    (`Session.host_copy`): `ParallelModel.from_host` makes a session of it on every rank; what
    it holds (`nbytes`, `frontier`) reads rank 0's."""
