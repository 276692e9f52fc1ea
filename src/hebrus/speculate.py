"""Speculative decoding: tokens drafted cheaply, checked by one chunk of the model, and kept
through `Session.feed_prefix` as far as they stand.

Each round feeds the next token t (already chosen) and up to `draft_tokens` drafted ones
d_1..d_n as one prefix transaction. The chunk's logits at the position before d_i give the
model's distribution p_i for it (plain decoding's: temperature, top_k, top_p, min_p applied).

- Greedy: d_i is kept while it is p_i's choice; the first one that is not is replaced by it.
- Sampling (speculative rejection sampling): d_i, proposed with probability q_i(d_i), is kept
  with probability min(1, p_i(d_i) / q_i(d_i)); at the first refusal the next token is drawn from
  max(0, p_i - q_i), normalised, and when every draft is kept, from p_{n+1}. Every emitted token
  then has exactly the distribution plain sampling gives it.

Drafters: `Lookup` (prompt lookup: what followed the latest earlier occurrence of the text's
last n-gram, n from 8 down to 1; such a draft is certain, q_i(d_i) = 1) and `DraftModel` (a second hebrus model
with its own session, proposing on a fork of it).
"""
from __future__ import annotations

import torch

from hebrus.errors import InvalidInput, note_published
from hebrus.sampling import Sampling, constrained, distribution, draw, sample


def lookup(history: list[int], most: int, longest: int = 8) -> list[int]:
    """Up to `most` tokens that followed the latest earlier occurrence of the history's last
    n-gram (n from `longest` down to 1); none if no n-gram recurs."""
    if most <= 0:
        return []
    for n in range(min(longest, len(history) - 1), 0, -1):
        tail = history[-n:]
        for at in range(len(history) - n - 1, -1, -1):
            if history[at:at + n] == tail:
                return history[at + n:at + n + most]
    return []


class Lookup:
    """Drafts by prompt lookup over the text so far."""

    def __init__(self, history: list[int]):
        self.history = list(history)

    def propose(self, token: int, most: int, sampling: Sampling, generator) -> tuple[list[int], None]:
        return lookup(self.history + [token], most), None

    def commit(self, tokens: list[int]) -> None:
        self.history += tokens


class DraftModel:
    """Drafts by a second hebrus model: its own session, fed the same text; each round's
    proposals run on a fork of it (one token per step, eagerly: a fork would capture graphs of
    its own), which is then dropped, and the tokens kept are fed to the session as one chunk."""

    def __init__(self, model, history: list[int], chunk_size: int):
        self.session = model.session(decode="eager")
        if history:
            self.session.prefill(history, chunk_size)

    def propose(self, token: int, most: int, sampling: Sampling, generator):
        """(drafts, their proposal distributions [n, V] normalised, or None when greedy)."""
        if most <= 0:
            return [], None
        fork = self.session.fork()
        logits = fork.feed([token])
        drafts, proposals = [], []
        for i in range(most):
            if sampling.temperature == 0:
                drafts.append(int(torch.argmax(logits)))
            else:
                q = _normalised(distribution(logits, sampling))
                drafts.append(draw(q, generator))
                proposals.append(q)
            if i + 1 < most:
                logits = fork.feed([drafts[-1]])
        return drafts, (torch.stack(proposals) if proposals else None)

    def commit(self, tokens: list[int]) -> None:
        self.session.feed(tokens)


def drafter(speculate, model, history: list[int], room: int, chunk_size: int):
    """The drafter `Session.generate(speculate=...)` names ("lookup", or a hebrus model, one of
    the target `model`'s own kind, with its vocabulary and room for the text), checked."""
    if isinstance(speculate, str) and speculate == "lookup":
        return lambda: Lookup(history)
    if not isinstance(speculate, type(model)):
        raise InvalidInput(f"speculate must be None, 'lookup' or a hebrus model to draft with, got {speculate!r}")
    if speculate.spec.vocab_size != model.spec.vocab_size:
        raise InvalidInput(f"the draft model's vocabulary has {speculate.spec.vocab_size} ids, the model's "
                           f"{model.spec.vocab_size}: they must share one")
    if len(history) + room > speculate.spec.max_context:
        raise InvalidInput(f"the draft model's context limit of {speculate.spec.max_context} cannot hold the "
                           f"{len(history)} ids of the text and {room} more")
    return lambda: DraftModel(speculate, history, chunk_size)


def speculative(session, prompt, max_new_tokens: int, sampling: Sampling, stops: frozenset, earlier: list[int],
                generator, chunk_size: int, make_drafter, draft_tokens: int, record: list | None = None,
                constraint=None):
    """`Session.generate(..., speculate=...)`'s tokens, its arguments already checked.
    `record` (the benchmark's) gets (chunk length, tokens kept) for each verifying chunk. With a
    constraint (attached once the prompt is fed, or the session's own), drafts stop where it
    stops allowing them, each position of a chunk is verified against the model's distribution
    masked by the constraint as it stands after the chunk's tokens before it, and generation
    ends where the constraint allows nothing more; the prefix transaction publishes the
    constraint after the kept tokens."""
    start = session.frontier
    try:
        logits = session.prefill(prompt, chunk_size) if len(prompt) else session.logits
        if constraint is not None:
            session.constrain(constraint)
        drafts = make_drafter()
        if _finished(session.constraint):
            return
        token, made = sample(_masked(logits, session.constraint), sampling, generator), 0
        while True:
            limit = session.constraint
            after = limit.after([token]) if limit is not None else None
            room = min(draft_tokens, max_new_tokens - made - 1) if token not in stops and not _finished(after) else 0
            proposed, proposals = drafts.propose(token, room, sampling, generator)
            if after is not None:                   # no draft past what the constraint allows
                n = after.allows(proposed)
                proposed, proposals = proposed[:n], (proposals[:n] if proposals is not None and n else None)
            chunk = [token] + proposed
            if proposed:
                verdict = {}

                def accept(chunk_logits, chunk=chunk, proposals=proposals, limit=limit):
                    chunk_logits, ended = _under(limit, chunk, chunk_logits)
                    k, verdict["next"] = _verify(chunk, chunk_logits, proposals, sampling, generator, stops, ended)
                    return k
                k, _ = session.feed_prefix(_padded(session, chunk, 1 + draft_tokens), accept)
                following = verdict["next"]
                if record is not None:
                    record.append((len(chunk), k))
            else:
                k, logits, following = 1, session.feed([token]), None
            drafts.commit(chunk[:k])
            for t in chunk[:k]:
                made += 1
                yield t
                if t in stops or made == max_new_tokens:
                    return
            if _finished(session.constraint):
                return
            token = following if following is not None else \
                sample(_masked(logits, session.constraint), sampling, generator)
    except GeneratorExit:
        raise
    except BaseException as exc:
        note_published(exc, session.frontier - start)
        raise


def _padded(session, chunk: list[int], length: int) -> list[int]:
    """The chunk, padded to `length` with its last token when the session runs prefix
    transactions from a plan (one plan, one CUDA graph, for every round) and has room: the
    padding is never kept (`_verify` keeps at most the real chunk)."""
    if not session.plans_prefixes or session.frontier + length > session.spec.max_context:
        return chunk
    return chunk + chunk[-1:] * (length - len(chunk))


def _finished(limit) -> bool:
    return limit is not None and limit.finished


def _masked(logits: torch.Tensor, limit) -> torch.Tensor:
    return logits if limit is None else constrained(logits, [limit.mask()])


def _under(limit, chunk: list[int], logits: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
    """A verifying chunk's logits [T, V] with position i masked by `limit` after chunk[:i + 1]
    (every mask in one call), and whether the constraint has ended there; as they are without one."""
    if limit is None:
        return logits, [False] * len(chunk)
    states, state = [], limit
    for token in chunk:                             # each from the one before: one token's work each
        state = state.after([token])
        states.append(state)
    masked = constrained(logits[:len(chunk)], [s.mask() for s in states])
    return masked, [s.finished for s in states]


def _verify(chunk: list[int], logits: torch.Tensor, proposals, sampling: Sampling, generator,
            stops: frozenset, ended: list[bool] | None = None) -> tuple[int, int | None]:
    """(how many of `chunk` to keep, the token after them, or None after a stop or where
    `ended[i]`, the text complete after chunk[:i + 1]). Position i of `logits` [T, V] is the
    model's distribution for chunk[i + 1]."""
    ended = ended or [False] * len(chunk)
    k = 1
    choices = logits.argmax(-1).tolist() if sampling.temperature == 0 else None    # one transfer
    while k < len(chunk):
        if chunk[k - 1] in stops or ended[k - 1]:
            return k, None
        d = chunk[k]
        if choices is not None:
            if choices[k - 1] != d:
                return k, choices[k - 1]
        else:
            p = _normalised(distribution(logits[k - 1], sampling))
            q = None if proposals is None else proposals[k - 1]
            proposed = 1.0 if q is None else float(q[d])
            if float(torch.rand((), dtype=torch.float64, generator=generator)) * proposed >= float(p[d]):
                residual = p.clone()                # refused: draw from max(0, p - q)
                if q is None:
                    residual[d] = 0.0
                else:
                    residual = (p - q).clamp_min(0.0)
                if not float(residual.sum()) > 0.0:
                    residual = p
                return k, draw(residual, generator)
        k += 1
    if chunk[k - 1] in stops or ended[k - 1]:
        return k, None
    return k, choices[k - 1] if choices is not None else sample(logits[k - 1], sampling, generator)


def _normalised(weights: torch.Tensor) -> torch.Tensor:
    weights = weights.cpu()
    return weights / weights.sum()
