"""Session: one conversation's state, and the public calls that run its chunks as transactions
(each through a runner of `hebrus.engine`: eager for any chunk, planned or CUDA-graph steps for
one token).

Arguments are checked before anything begins; any failure after that raises a `ChunkAborted`
and publishes nothing.

Concurrent callers: a session runs one transaction at a time. Everything that depends on the
session's state (the room left in the context, the logits a call returns, `digest()`, `logits`)
is checked or read under the session's lock, so a reader sees one published image, never a
bank being written. `prefill` holds the lock for all its chunks; `generate` takes it once per
transaction, so other callers' chunks may land between its tokens. `frontier` is one read of
the published record and needs no lock.
"""
from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator, NamedTuple

import torch

from hebrus import arguments, faults
from hebrus.engine import eager
from hebrus.engine.graphs import decode_route
from hebrus.errors import AllocationError, ChunkAborted, InvalidInput, note_published
from hebrus.sampling import Sampling, constrained, counted, penalise, sample
from hebrus import speculate as speculation
from hebrus.state.budget import MemoryBudget, Refused
from hebrus.state.constraint import checked
from hebrus.state.image import Image
from hebrus.state.pool import Pool, PoolFull
from hebrus.show import shown
from hebrus.text.generation import stream_text


class HostCopy(NamedTuple):
    """A session's published state in host memory (`Session.host_copy`): its frontier, every
    banked owner's value, every appended owner's rows below the frontier, and its constraint."""
    frontier: int
    banked: dict
    rows: dict
    constraint: object = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for part in (self.banked, self.rows) for t in part.values())


class Session:
    def __init__(self, model, memory_budget: int | None = None, decode: str = "auto", reserve: int = 0,
                 journal=None, image=None):
        # `image`: what makes the session's image (a fork's), instead of a fresh slot
        if memory_budget is not None:
            memory_budget = arguments.positive_int("memory_budget (bytes, or None for no limit)", memory_budget)
        reserve = arguments.reserve(reserve, model.spec.max_context)
        decode = decode_route(model, decode)
        self.model = model
        self.config, self.spec = model.config, model.spec
        self.budget = MemoryBudget(memory_budget)
        try:
            self.budget.hold(Pool.slot_bytes(model.owners), "the session's two banks")
        except Refused as exc:
            raise InvalidInput(f"memory_budget too small for a session of this model: {exc}") from None
        self.image = _allocate(image or (lambda: Image(model.pool)), "the session's slot in the state pool")
        self._stage_names = model.stage_names
        self.decode = decode
        self.reserve = reserve                  # rows every row log grows to at once, when granted
        self._steps = model.steps(capture=decode == "graph") if decode in ("planned", "graph") else None
        self.journal = None                     # a `hebrus.journal.Journal`: each chunk on disk before its flip
        if journal is not None:
            from hebrus.journal import Journal
            self.journal = Journal(journal, model.fingerprint, model.spec.max_context, empty=True)
        self._lock = threading.RLock()          # one call at a time per session (see _exclusive)
        self._inside: int | None = None         # the thread running a call on this session

    def _exclusive(self):
        """Hold the session lock. Another thread waits; the thread already inside (a signal
        handler or a hook that calls back into the session) is refused, not left waiting for
        itself forever."""
        return exclusive([self])

    # ---- reading the public image ----------------------------------------------------------
    @property
    def frontier(self) -> int:
        return self.image.public.frontier

    def digest(self) -> str:
        with self._exclusive():
            return self.image.digest()

    @property
    def logits(self) -> torch.Tensor:
        """A copy of the last committed token's logits."""
        with self._exclusive():
            return self.image.read(eager.OUTPUT).clone()

    @property
    def constraint(self):
        """What the session's next tokens must satisfy (`hebrus.state.constraint.Constraint`), or
        None: one more owner, published with every chunk (the value after the chunk's tokens)."""
        return self.image.public.constraint

    def constrain(self, constraint) -> None:
        """From now on, every token fed to this session must be one `constraint` allows (a chunk
        holding one it does not is refused, nothing changed), and `generate` samples only those;
        each chunk's flip publishes the constraint's value after its tokens, with the rest of
        the session's state. None lifts it. (`hebrus.text.grammar` makes constraints: a JSON
        schema, a regular expression, a grammar.)"""
        try:
            constraint = checked(constraint)
        except TypeError as exc:
            raise InvalidInput(str(exc)) from None
        if constraint is not None and self.journal is not None:
            raise InvalidInput("a journaled session takes no constraint (a journal does not record one)")
        with self._exclusive():
            self.image.publish(self.image.public._replace(constraint=constraint))

    # ---- transactions ----------------------------------------------------------------------
    def fork(self, copy_rows: bool = False) -> "Session":
        """A new session at this one's frontier with the same state: banked values copied into
        a slot of its own, row blocks shared (no row is copied, whatever the context length).
        The two then diverge independently: a chunk that writes into a shared block writes a
        copy of it (one block, `block_rows` rows), so neither ever sees the other's later rows.
        `copy_rows`: the fork gets blocks of its own holding a copy of the rows instead, and
        this session's blocks stay its own alone (neither copies a block on its next write).
        The fork's budget counts the blocks its table holds. The fork has this
        session's memory budget limit, decode route and reservation, and no journal.
        AllocationError when the pool has no slot (or, copying, no blocks) for it."""
        with self._exclusive():
            fork = Session(self.model, memory_budget=self.budget.limit, decode=self.decode, reserve=self.reserve,
                           image=lambda: self.image.fork(copy_rows))
            fork.budget.held = fork.image.held_bytes()
            return fork

    def save(self, path, note: str | None = None) -> None:
        """Write the published state to the file `path` atomically (a temporary file, flushed,
        renamed over it), with its digest and the model's fingerprint: `model.restore(path)`
        gives back this session exactly. `note`: text kept with it (`hebrus.snapshot.read_note`),
        such as the conversation a chat was at."""
        from hebrus import snapshot
        with self._exclusive():
            if self.constraint is not None:
                raise InvalidInput("a session with a constraint cannot be saved (a constraint is not kept in a file); "
                                   "lift it first (constrain(None))")
            snapshot.write(self.image, path, self.model.fingerprint, note)

    def _restore(self, path) -> None:
        """Install a saved image into this fresh session, every check passed first (`snapshot.read`);
        InvalidInput (the session unusable, nothing else touched) when the file is not this
        model's, is damaged (the digest of what was read must be the digest recorded), or holds
        what no session of this model publishes. The session owns what it read: the file can
        change or go afterwards."""
        from hebrus import snapshot
        frontier, banked, rows = snapshot.read(path, self.image, self.model.fingerprint, self.spec.max_context)
        self._install(HostCopy(frontier, banked, rows), "the saved session")

    def host_copy(self) -> "HostCopy":
        """The published state copied to host memory: every banked value and the rows below the
        frontier. `Model.from_host` makes a session of it, this one exactly (the same digest);
        what a server does with a session it preempts."""
        with self._exclusive():
            record, image = self.image.public, self.image
            return HostCopy(record.frontier,
                            {s.name: image.value(s.name, record).to("cpu", copy=True) for s in image.banked},
                            {s.name: image.value(s.name, record).cpu() for s in image.appended},   # rows: copies already
                            record.constraint)

    def _install(self, copy: "HostCopy", what: str) -> None:
        """A fresh session's state from `copy`, whose values are checked to be this model's."""
        pool = self.model.pool
        try:
            self.budget.hold(pool.blocks_for(copy.frontier) * pool.block_nbytes, f"{what}'s rows")
        except Refused as exc:
            raise InvalidInput(f"memory_budget too small for {what}: {exc}") from None
        for name, value in copy.banked.items():
            self.image.banks[0][name].copy_(value)
        _allocate(lambda: self.image.install(copy.rows, copy.frontier, copy.constraint),
                  f"{what}'s rows in the state pool")

    def feed(self, ids, out: torch.Tensor | None = None) -> torch.Tensor:
        """Run one chunk as one transaction; return the last position's logits (a new tensor,
        or `out`, which is written only if the chunk publishes)."""
        chunk = self._ids(ids)
        self._check_out(out)
        self._check_faults()
        with self._exclusive():
            self._check_room(len(chunk))
            self._check_constraint(chunk)
            return self._transact(chunk, out)

    def feed_keeping(self, ids, marks) -> tuple[torch.Tensor, list["Session | None"]]:
        """`feed(ids)`, and for each count m of `marks` (increasing, from 1 to len(ids)) a new
        session holding exactly what feeding `ids[:m]` gives this one (exact mode: bit for bit;
        fast mode: within its bound, the chunk's stateful stages running in pieces that end at
        the marks): its banked values as they stood after token m, kept as the chunk passed,
        and this session's rows below it, their blocks shared. Returns (the logits, the
        sessions); a session the pool has no slot for is None (the chunk is published all the
        same). What a prefix cache keeps. A journaled session refuses (its journal records whole
        chunks)."""
        chunk = self._ids(ids)
        marks = arguments.marks(marks, len(chunk))
        self._check_faults()
        if self.journal is not None:
            raise InvalidInput("a journaled session feeds whole chunks: feed_keeping keeps no journal record")
        with self._exclusive():
            self._check_room(len(chunk))
            self._check_constraint(chunk)
            record, every = self.image.public, marks if marks[-1] == len(chunk) else marks + (len(chunk),)
            with torch.inference_mode():
                kept = eager.run_marked(self.model, self.image, self.budget, chunk, None, every, self.reserve)
                return self.image.read(eager.OUTPUT).clone(), self._kept_at(record, chunk, marks, kept)

    def _kept_at(self, record, chunk, marks: tuple[int, ...], kept: dict) -> list["Session | None"]:
        """The new sessions after each of `marks` of `chunk` fed from `record` (the public one
        before it), from the values kept after them (`kept`: by owner, [len(marks) or one more,
        ...]) and the record's constraint after the chunk's first tokens; None where the pool has
        no slot (on any rank of a model over ranks)."""
        ids = chunk.tolist() if record.constraint is not None else ()
        sessions = [self._prefix_at(record.frontier + m, {name: values[j] for name, values in kept.items()},
                                    record.constraint and record.constraint.after(ids[:m]))
                    for j, m in enumerate(marks)]
        ranks = self.model.ranks            # over tensor-parallel ranks: kept where every rank kept its part
        return sessions if ranks is None else ranks.kept_everywhere(sessions)

    def _prefix_at(self, frontier: int, banked: dict, constraint=None) -> "Session | None":
        """A new session at `frontier` of this one's rows with `banked` values and `constraint`,
        or None when the pool has no slot for it (or the device no memory)."""
        banked[eager.FRONTIER] = torch.tensor(frontier, dtype=torch.int64, device=self.model.device)
        try:
            kept = Session(self.model, memory_budget=self.budget.limit, decode=self.decode, reserve=self.reserve,
                           image=lambda: self.image.prefix(frontier, banked, constraint))
        except (AllocationError, torch.OutOfMemoryError):   # the chunk is published: only this one is lost
            return None
        kept.budget.held = kept.image.held_bytes()
        return kept

    def feed_prefix(self, ids, accept) -> tuple[int, torch.Tensor]:
        """Run `ids` [T], decide from the chunk's own logits how many of its tokens to keep, and
        publish only those: `accept(logits)` gets the logits at every position [T, V] and returns
        k in 0..T; the session then holds exactly what feeding `ids[:k]` alone gives (exact mode:
        bit for bit). Returns (k, logits [T, V]). A failure publishes nothing, and so does k = 0.

        One pass: the chunk runs as a prefix transaction, which keeps every banked value after
        each of its tokens in scratch, and once its checks have passed publishes those after
        token k by the same flip as any chunk (`state.txn`). `feed_prefix_twice` is its readable
        twin."""
        chunk, accept = self._prefix_call(ids, accept)
        seen = []

        def keep(logits: torch.Tensor) -> int:
            seen.append(logits)
            return _kept(accept(logits), len(chunk))
        with self._exclusive():
            self._check_room(len(chunk))
            with torch.inference_mode():
                k = self._run_stages(chunk, None, keep)
            return k, seen[0]

    def feed_prefix_twice(self, ids, accept) -> tuple[int, torch.Tensor]:
        """`feed_prefix` in its readable form: the chunk runs once for its logits, as a
        transaction that ends before its flip (so it publishes nothing), then its first k tokens
        run as one."""
        chunk, accept = self._prefix_call(ids, accept)
        with self._exclusive():
            self._check_room(len(chunk))
            logits = self._logits_at_every_position(chunk)
            k = _kept(accept(logits), len(chunk))
            if self.constraint is not None:         # no further than it allows, as `feed_prefix`
                k = min(k, self.constraint.allows(chunk.tolist()))
            if k:
                self._transact(chunk[:k], None)
            return k, logits

    def _prefix_call(self, ids, accept):
        chunk = self._ids(ids)
        self._check_faults()
        if not callable(accept):
            raise InvalidInput("accept must be a function of the chunk's logits [T, V] returning 0..T")
        return chunk, accept

    def _logits_at_every_position(self, chunk: torch.Tensor) -> torch.Tensor:
        """The chunk's logits [T, V] from a transaction stopped before its flip, row by row
        (`Head.logits_row_by_row`)."""
        head = self.model.stages[-1]

        def stop(txn) -> None:
            raise _Seen(head.logits_row_by_row(txn.step.streams))
        saved, self.image.before_flip = self.image.before_flip, stop      # no journal record either
        try:
            with torch.inference_mode():
                eager.run_chunk(self.model, self.image, self.budget, chunk, None, self.reserve)
        except _Seen as seen:
            return seen.logits
        finally:
            self.image.before_flip = saved
        raise RuntimeError("the transaction reached its flip")          # unreachable: stop always raises

    def prefill(self, ids, chunk_size: int | None = None) -> torch.Tensor:
        """Feed `ids` in chunks of `chunk_size` (default: the model's `prefill_chunk`), one
        transaction each, with no other caller's chunk in between. If a chunk fails, the error's
        `.published` says how many tokens of this call were published before it."""
        chunk_size = self._chunk_size(chunk_size)
        tokens = self._ids(ids)
        self._check_faults()
        with self._exclusive():
            self._check_room(len(tokens))
            self._check_constraint(tokens)
            return self._prefill(tokens, chunk_size)

    def generate(self, ids=(), max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, chunk_size: int | None = None, *, top_k: int = 0,
                 min_p: float = 0.0, repetition_penalty: float = 1.0, stop_ids=(), seen=(),
                 speculate=None, draft_tokens: int = 8, constraint=None, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0) -> Iterator[int]:
        """Prefill `ids` (may be empty once the session holds tokens), then sample and commit one
        token per transaction, ending after `max_new_tokens` or after a token in `stop_ids` (which
        is yielded and committed). The repetition penalty counts `ids`, `seen` (ids fed earlier
        that should count too) and the tokens generated. Every argument is checked now; tokens
        come as you iterate.

        `speculate`: "lookup" drafts up to `draft_tokens` tokens after each chosen one by finding
        the latest n-gram (n = 8 down to 1) of the text so far (`seen`, `ids` and the output) earlier
        in it and taking what followed; a hebrus model (same vocabulary) drafts them itself, fed
        `seen` and `ids` first. The token and its drafts run as one chunk, and `feed_prefix`
        keeps the part that stands (`hebrus.speculate`): greedy decoding gives the plain greedy
        output (exact mode: the same tokens, bit for bit the same state), sampling follows the
        plain sampling distribution (speculative rejection sampling; not the same draws for a
        seed). Not with a repetition penalty, nor presence or frequency penalties.

        `constraint` (`hebrus.state.constraint.Constraint`; `hebrus.text.grammar` makes them from
        JSON schemas, regular expressions and grammars): once the prompt is fed the session is
        constrained by it (`constrain`), and every token is sampled from those it allows;
        generation ends when it allows nothing more. With `speculate`, drafts are kept only as
        far as it allows them (greedy: the same tokens as without speculation).

        This is the engine-level call (DESIGN §7): token ids in and out, greedy and seed 0
        unless told otherwise, in the model's mode; the prompt in chunks of `chunk_size` (default:
        the model's `prefill_chunk`). `generate_text` is the text-level one."""
        prompt = self._ids(ids, allow_empty=True)
        chunk_size = self._chunk_size(chunk_size)
        max_new_tokens = arguments.count("max_new_tokens", max_new_tokens)
        sampling = Sampling(arguments.temperature(temperature), arguments.top_p(top_p),
                            arguments.count("top_k", top_k), arguments.min_p(min_p),
                            arguments.repetition_penalty(repetition_penalty),
                            arguments.output_penalty("presence_penalty", presence_penalty),
                            arguments.output_penalty("frequency_penalty", frequency_penalty))
        stops = frozenset(arguments.in_vocabulary(arguments.token_ids(stop_ids, self.spec.vocab_size, "stop ids"),
                                                  self.spec.vocab_size).tolist())
        earlier = arguments.in_vocabulary(arguments.token_ids(seen, self.spec.max_context, "seen ids"),
                                          self.spec.vocab_size).tolist()
        generator = arguments.generator(seed)
        try:
            constraint = checked(constraint)
        except TypeError as exc:
            raise InvalidInput(str(exc)) from None
        if speculate is not None:
            if (constraint is not None or self.constraint is not None) and speculate != "lookup" \
                    and sampling.temperature != 0:
                raise InvalidInput("a draft model's sampled drafts do not take a constraint yet (greedy, or "
                                   "speculate='lookup', do)")
            if sampling.repetition_penalty != 1.0 or sampling.counts_output:
                raise InvalidInput("speculate does not take a repetition, presence or frequency penalty")
            draft_tokens = arguments.count("draft_tokens", draft_tokens)
            drafter = speculation.drafter(speculate, self.model, earlier + prompt.tolist(),
                                          max_new_tokens + draft_tokens, chunk_size)
        self._check_faults()
        with self._exclusive():
            if not len(prompt) and self.frontier == 0:
                raise InvalidInput("empty chunk: a new session's prompt needs at least one token id")
            self._check_room(len(prompt) + max_new_tokens)
        if speculate is not None:
            return speculation.speculative(self, prompt, max_new_tokens, sampling, stops, earlier, generator,
                                           chunk_size, drafter, draft_tokens, constraint=constraint)
        return self._generate(prompt, max_new_tokens, sampling, stops, earlier, generator, chunk_size, constraint)

    def generate_text(self, prompt, **options):
        """Text level: `prompt` (text, continued as it is, or a conversation: a list of
        {"role", "content"} dicts, through the chat template) fed through the model's tokenizer
        and continued, as a `hebrus.text.TextStream` (iterate for the text as it comes; it
        counts tokens and time). Unlike `generate`, sampling comes from the checkpoint's
        generation config (else temperature 1.0) and the seed is random unless given; options
        as `hebrus.text.TextOptions`: max_new_tokens, temperature, top_p, top_k, min_p,
        repetition_penalty, seed, stop (strings)."""
        return stream_text(self, prompt, **options)

    def _generate(self, prompt, max_new_tokens, sampling, stops, earlier, generator, chunk_size, constraint):
        start = self.frontier
        seen = None                               # the ids the repetition penalty counts, as a mask
        if sampling.repetition_penalty != 1.0:
            seen = torch.zeros(self.spec.vocab_size, dtype=torch.bool, device=self.model.device)
            seen[torch.tensor(earlier + prompt.tolist(), dtype=torch.int64, device=seen.device)] = True
        counts = (torch.zeros(self.spec.vocab_size, dtype=torch.float64, device=self.model.device)
                  if sampling.counts_output else None)  # the ids generated, for presence and frequency penalties
        try:
            logits = self.prefill(prompt, chunk_size) if len(prompt) else self.logits
            if constraint is not None:
                self.constrain(constraint)
            for _ in range(max_new_tokens):
                scored = counted(penalise(logits, seen, sampling.repetition_penalty), counts, sampling)
                limit = self.constraint
                if limit is not None:
                    if limit.finished:
                        return
                    scored = constrained(scored, [limit.mask()])
                token = sample(scored, sampling, generator)
                logits = self.feed([token])
                if seen is not None:
                    seen[token] = True
                if counts is not None:
                    counts[token] += 1
                yield token
                if token in stops:
                    return
        except GeneratorExit:                     # the caller closed the generator
            raise
        except BaseException as exc:              # Ctrl-C: the token may be committed, not yet yielded
            note_published(exc, self.frontier - start)
            raise

    def _prefill(self, tokens: torch.Tensor, chunk_size: int) -> torch.Tensor:
        start = self.frontier
        for begin in range(0, len(tokens), chunk_size):
            try:
                logits = self._transact(tokens[begin:begin + chunk_size], None)
            except BaseException as exc:
                note_published(exc, self.frontier - start)
                raise
        return logits

    def _transact(self, ids: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """One transaction (the caller holds the lock). Returns `out`, or a new tensor holding
        the published logits."""
        with torch.inference_mode():            # state written here needs no autograd history
            self._run_stages(ids, out)
        return out if out is not None else self.image.read(eager.OUTPUT).clone()

    def _run_stages(self, ids: torch.Tensor, out: torch.Tensor | None, keep=None) -> int:
        """One transaction (or, with `keep`, a prefix transaction) with the journal's record
        written before its flip; returns the number of tokens published."""
        if self.journal is None:
            return self._run(ids, out, keep)
        self.image.before_flip = lambda txn: self.journal.append(self.frontier, ids, txn.length, txn.each)
        try:
            return self._run(ids, out, keep)
        finally:
            self.image.before_flip = None

    def _run(self, ids: torch.Tensor, out: torch.Tensor | None, keep=None) -> int:
        steps = self._steps
        if steps is not None and (len(ids) == 1 or keep is not None) and steps.accepts(len(ids)):
            def conclude(txn, work) -> int:
                return eager.finish(txn, lambda _: work(), out, eager.by_logits(keep))
            return steps.run([self.image], [self.budget], ids, len(ids), keep is not None, conclude)
        return eager.run_chunk(self.model, self.image, self.budget, ids, out, self.reserve, keep)

    @property
    def plans_prefixes(self) -> bool:
        """Whether prefix transactions run from a static plan (per chunk length), so that
        speculation pads its chunks to one length."""
        return self._steps is not None

    # ---- checks (stateless ones before the lock, the rest under it) ------------------------
    def _ids(self, ids, allow_empty: bool = False) -> torch.Tensor:
        tokens = arguments.token_ids(ids, self.spec.max_context)
        if tokens.numel() == 0 and not allow_empty:
            raise InvalidInput("empty chunk: give at least one token id")
        return arguments.in_vocabulary(tokens, self.spec.vocab_size)

    def _chunk_size(self, value) -> int:
        return self.model.prefill_chunk if value is None else arguments.chunk_size(value)

    def _check_room(self, count: int) -> None:
        limit = self.spec.max_context
        if self.frontier + count > limit:
            raise InvalidInput(f"{count} more tokens would take the session to {self.frontier + count}, past its "
                               f"context limit of {limit} ({limit - self.frontier} tokens left)")

    def _check_constraint(self, ids: torch.Tensor) -> None:
        """Refuse a chunk holding a token the session's constraint does not allow where it comes."""
        if self.constraint is not None:
            check_allowed(self.constraint, ids.tolist())

    def _check_out(self, out) -> None:
        arguments.output_buffer(out, (self.spec.vocab_size,), self.model.dtype, self.model.device,
                                  self.model.weight_storages)

    def _check_faults(self) -> None:
        armed = faults.armed()
        if self.model.ranks is None and any(f.rank != faults.RANK for f in armed):
            raise InvalidInput("a fault armed for another rank: this model is not split over ranks "
                               "(hebrus.load(..., tensor_parallel=N))")
        unknown = [f.stage for f in armed if f.stage not in self._stage_names]
        if unknown:
            raise InvalidInput(f"fault armed for unknown stage {unknown[0]!r}; stages are: "
                               + ", ".join(self._stage_names))


@contextmanager
def exclusive(sessions: list[Session]):
    """Hold each session's lock (`Session._exclusive`), taken in one order for every caller (no
    deadlock between two callers of overlapping sessions), given back in reverse."""
    held: list[Session] = []
    try:
        for s in sorted(sessions, key=id) if len(sessions) > 1 else sessions:
            s._lock.acquire()
            if s._inside is not None:           # only this thread can hold the lock here
                s._lock.release()
                raise InvalidInput("session busy: a call on this session is already running in this thread "
                                   "(a re-entrant call from a signal handler or a hook); call it afterwards")
            s._inside = threading.get_ident()
            held.append(s)
        yield
    finally:
        for s in reversed(held):
            s._inside = None
            s._lock.release()


def _kept(k, length: int) -> int:
    """`accept`'s answer as a count of tokens: a plain int, or an integer tensor of no
    dimensions (read once), in [0, length]; anything else is InvalidInput."""
    if type(k) is torch.Tensor and k.dim() == 0 and k.device.type != "meta" and k.dtype in arguments.ID_DTYPES:
        k = int(k)
    if type(k) is not int or not 0 <= k <= length:
        what = shown(k) if type(k) in (int, float, bool, str, type(None)) else f"an object of type {type(k).__name__}"
        if isinstance(k, torch.Tensor):
            what += f" of dtype {str(k.dtype).removeprefix('torch.')} and shape {tuple(k.shape)}"
        raise InvalidInput(f"accept returned {what}; it must return an integer from 0 to {length} (an int, or an "
                           f"integer tensor of no dimensions)")
    return k


class _Seen(ChunkAborted):
    """Ends a transaction before its flip, carrying what it computed (`feed_prefix`)."""
    kind = "seen"

    def __init__(self, logits: torch.Tensor):
        super().__init__("head", "stopped before the flip")
        self.logits = logits


def _allocate(make, what: str):
    """`make()`, which takes from the model's state pool: AllocationError when the pool is full
    (after collecting sessions no one holds, whose slots and blocks then go back)."""
    try:
        return make()
    except PoolFull:
        gc.collect()                    # sessions in reference cycles give their slots back
    try:
        return make()
    except PoolFull as exc:
        raise AllocationError("session", f"{what}: {exc} (a larger pool_bytes holds more)") from None


def check_allowed(constraint, tokens: list[int]) -> None:
    """InvalidInput naming the first of `tokens` (a chunk's ids) that `constraint` does not
    allow where it comes, if any."""
    n = constraint.allows(tokens)
    if n < len(tokens):
        raise InvalidInput(f"the session's constraint does not allow token {tokens[n]} at position {n} of the chunk")
