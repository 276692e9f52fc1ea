"""Speculative greedy decoding: drafts from the text so far (prompt lookup), kept where the
model's own greedy choices agree, through `Session.feed_prefix`."""
from __future__ import annotations

import torch

from hebrus.errors import note_published


def lookup(history: list[int], most: int, longest: int = 3) -> list[int]:
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


def greedy_with_lookup(session, prompt, max_new_tokens, stops, earlier, chunk_size, draft_tokens):
    """`Session.generate(..., speculate="lookup")`'s tokens (its arguments already checked):
    after each greedy token, up to `draft_tokens` drafted ones run with it as one chunk, and the
    longest part whose previous positions' greedy choices predict it is kept."""
    start = session.frontier
    history = earlier + prompt.tolist()
    try:
        logits = session.prefill(prompt, chunk_size) if len(prompt) else session.logits
        made = 0
        while made < max_new_tokens:
            token = int(torch.argmax(logits))
            chunk = [token] + lookup(history + [token], min(draft_tokens, max_new_tokens - made - 1))

            def agreeing(chunk_logits, chunk=chunk):
                k = 1
                while k < len(chunk) and chunk[k - 1] not in stops \
                        and int(torch.argmax(chunk_logits[k - 1])) == chunk[k]:
                    k += 1
                return k
            if len(chunk) > 1:
                k, chunk_logits = session.feed_prefix(chunk, agreeing)
                logits = chunk_logits[k - 1]
            else:
                k, logits = 1, session.feed([token])
            for t in chunk[:k]:
                history.append(t)
                made += 1
                yield t
                if t in stops:
                    return
    except GeneratorExit:
        raise
    except BaseException as exc:
        note_published(exc, session.frontier - start)
        raise
