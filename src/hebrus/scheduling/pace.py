"""What a turn of the engine loop costs, as the loop measures it: seconds per decode step and
per prompt token, so that a turn's prompt share can be bounded in time (`Scheduler`).

A pass that only steps measures the step; one that only feeds prompts measures their tokens; a
pass that does both (one pass a turn) measures their sum. `Pace` fits both to every pass at
once: a pass's seconds are `step_s` (if it stepped) plus `token_s` for each prompt token it fed,
by least squares weighted toward the latest passes (the contexts grow, the batch changes).
Until the passes seen can tell the two apart (none that did one thing alone, and those that did
both all fed as much), each is a running mean of the passes that did it alone, and a pass that
did both gives its prompt tokens what the step did not take (at least half of it). Apart from
the fit, `alone_s` follows the passes that only stepped: the decoders' pace with no prompt beside
them, which a turn's prompt share is measured against (`alone(width)`: only for a step of about
the width it was measured at). A prompt pass paced over turns (`passes="paced"`) measures its
stages instead, each its own (an embedding costs little beside a layer, the last "stage" is
the pass's validation and publication): `stage_s`, a running mean by the stage's place in the
pass, and `stages_within`, how many from one place fit some seconds.
"""
from __future__ import annotations


class Pace:
    def __init__(self, keep: float = 0.8):
        self.keep = keep                # the weight of what was seen before each new pass
        self.step_s: float | None = None
        self.token_s: float | None = None
        # a pass that only stepped (the decoders' pace with no prompt beside them): a running mean,
        # and how many requests the pass it started from stepped (a width that creeps does not
        # carry it along). With one pass a turn a step beside a prompt chunk costs more than
        # alone (`step_s` is its part of such a pass)
        self.alone_s: float | None = None
        self.alone_width = 0
        self.stage_s: dict[int, float] = {}   # a paced prompt pass's stages, by place (`staged`)
        # weighted sums over passes of s², s·f, f², s·t, f·t (s: 1 if it stepped, f: tokens fed, t: seconds)
        self._sums = (0.0,) * 5

    def add(self, stepped: int, fed: int, seconds: float) -> None:
        """Take in one pass: how many decoding requests it stepped (or whether it did), the
        prompt tokens it fed."""
        s, f = float(bool(stepped)), float(fed)
        if stepped and not fed:
            if _near(self.alone_width, stepped):
                self.alone_s = self._mean(self.alone_s, seconds)
            else:                                           # another width: the mean starts again
                self.alone_s, self.alone_width = seconds, int(stepped)
        self._sums = tuple(self.keep * a + b
                           for a, b in zip(self._sums, (s * s, s * f, f * f, s * seconds, f * seconds)))
        ss, sf, ff, st, ft = self._sums
        det = ss * ff - sf * sf
        if det > 1e-6 * ss * ff:                            # the two can be told apart (never with ss or ff 0)
            step, token = (st * ff - ft * sf) / det, (ft * ss - st * sf) / det
            if step > 0 and token > 0:
                self.step_s, self.token_s = step, token
                return
        if stepped and not fed:
            self.step_s = self._mean(self.step_s, seconds)
        elif fed and not stepped:
            self.token_s = self._mean(self.token_s, seconds / fed)
        elif fed and self.step_s is not None:               # the step's known part, the rest the prompts'
            self.token_s = self._mean(self.token_s, max(seconds - self.step_s, seconds / 2) / fed)

    def staged(self, first: int, seconds: list[float], places: int) -> None:
        """Take in a paced prompt pass's turn: its stages from place `first` on took `seconds`.
        A pass has `places` (its stages and its end); a pass that runs them again (sessions
        alone after a pass that failed as a whole) counts again from the first."""
        for place, spent in enumerate(seconds, first):
            self.stage_s[place % places] = self._mean(self.stage_s.get(place % places), spent)

    def stages_within(self, first: int, seconds: float, places: int) -> int:
        """How many stages of a paced pass of `places`, from place `first` on, fit `seconds` at
        what each took before: at least one; a place never measured ends the count there."""
        count, spent = 0, 0.0
        while (cost := self.stage_s.get((first + count) % places)) is not None and spent + cost <= seconds:
            spent += cost
            count += 1
        return max(1, count)

    def alone(self, width: int) -> float | None:
        """A step of `width` requests alone, as passes that only stepped measured it: None where
        none did, or its mean started from a batch a fifth narrower or a quarter wider (a step's
        cost follows its width; with prompts always arriving, one pass a turn may not step alone
        for a while)."""
        return self.alone_s if _near(self.alone_width, width) else None

    def _mean(self, mean: float | None, value: float) -> float:
        return value if mean is None else self.keep * mean + (1 - self.keep) * value


def _near(measured: int, width: int) -> bool:
    """Whether a step of `width` requests costs about what one of `measured` did."""
    return measured > 0 and 0.8 * measured <= width <= 1.25 * measured
