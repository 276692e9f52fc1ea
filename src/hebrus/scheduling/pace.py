"""What a turn of the engine loop costs, as the loop measures it: seconds per decode step and
per prompt token, so that a turn's prompt share can be bounded in time (`Scheduler`).

A pass that only steps measures the step; one that only feeds prompts measures their tokens; a
pass that does both (one pass a turn) measures their sum. `Pace` fits all of them at once: a
pass's seconds are `step_s` (if it stepped) plus `pass_s` (if it fed prompts: what a prompt pass
costs whatever its tokens, tens of milliseconds of the host's launches on a GPU) plus `token_s`
for each prompt token it fed, by least squares weighted toward the latest passes (the contexts
grow, the batch changes). Where the passes seen cannot tell `pass_s` apart (prompt passes that all
fed about as much, or none that stepped alone beside those that did both), the one told before
stands for STANDS prompt passes and the other two are fitted to what is left of each pass; where
none is told, the
fit is of the other two, `step_s` taking in what a prompt pass costs beside a step. Until the
passes seen can tell even those two apart (none that did one thing alone, and those that did
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

import numpy as np

# how far apart the passes seen must be to tell a prompt pass's own cost from its tokens': the
# determinant of their weighted moments against the product of its diagonal (1: independent)
APART = 0.03
# prompt passes a told `pass_s` stands for without being told again: then it is let go (the
# budget that followed it feeds alike; without it the budget moves, and the passes' sizes spread
# again, which tells it anew within a few turns, at what it costs now)
STANDS = 32


class Pace:
    def __init__(self, keep: float = 0.8):
        self.keep = keep                # the weight of what was seen before each new pass
        self.step_s: float | None = None
        self.pass_s: float | None = None
        self.token_s: float | None = None
        self._untold = 0                # prompt passes since `pass_s` was last told apart
        # a pass that only stepped (the decoders' pace with no prompt beside them): a running mean,
        # and how many requests the pass it started from stepped (a width that creeps does not
        # carry it along). With one pass a turn a step beside a prompt chunk costs more than
        # alone (`step_s` is its part of such a pass, or with `pass_s` told apart, the two together)
        self.alone_s: float | None = None
        self.alone_width = 0
        self.stage_s: dict[int, float] = {}   # a paced prompt pass's stages, by place (`staged`)
        # weighted sums over passes of x·xᵀ and x·t, x = (s, p, f) (s: 1 if it stepped, p: 1 if
        # it fed prompts, f: the tokens it fed; t: its seconds)
        self._moments, self._targets = np.zeros((3, 3)), np.zeros(3)

    def add(self, stepped: int, fed: int, seconds: float) -> None:
        """Take in one pass: how many decoding requests it stepped (or whether it did), the
        prompt tokens it fed."""
        s, f = float(bool(stepped)), float(fed)
        if stepped and not fed:
            if _near(self.alone_width, stepped):
                self.alone_s = self._mean(self.alone_s, seconds)
            else:                                           # another width: the mean starts again
                self.alone_s, self.alone_width = seconds, int(stepped)
        x = np.array([s, float(fed > 0), f])
        self._moments = self.keep * self._moments + np.outer(x, x)
        self._targets = self.keep * self._targets + x * seconds
        M, v = self._moments, self._targets
        if np.prod(np.diag(M)) > 0 and np.linalg.det(M) > APART * np.prod(np.diag(M)):   # all three apart
            step, fixed, token = np.linalg.solve(M, v)
            if step > 0 and fixed > 0 and token > 0:
                self.step_s, self.pass_s, self.token_s = float(step), float(fixed), float(token)
                self._untold = 0
                return
        # the other two, over what a pass told before leaves of each (a budget that follows
        # `pass_s` may feed alike every turn, which alone would tell it no more), for STANDS
        # prompt passes at most
        self._untold += fed > 0
        if self.pass_s is not None and self._untold > STANDS:
            self.pass_s = None
        if self.pass_s is not None:
            v = v - self.pass_s * M[:, 1]
        ss, sf, ff, st, ft = M[0, 0], M[0, 2], M[2, 2], v[0], v[2]
        det = ss * ff - sf * sf
        if det > 1e-6 * ss * ff:                            # the two can be told apart (never with ss or ff 0)
            step, token = (st * ff - ft * sf) / det, (ft * ss - st * sf) / det
            if step > 0 and token > 0:
                self.step_s, self.token_s = float(step), float(token)
                return
        # what a pass told before leaves, at least a part of the pass (half where none was told:
        # the step's guess may take too much; a twentieth where one was: it may take most)
        left = seconds - (self.pass_s or 0.0) if fed else seconds
        floor = seconds / 2 if self.pass_s is None else seconds / 20
        if stepped and not fed:
            self.step_s = self._mean(self.step_s, seconds)
        elif fed and not stepped:
            self.token_s = self._mean(self.token_s, max(left, floor) / fed)
        elif fed and self.step_s is not None:               # the step's known part, the rest the prompts'
            self.token_s = self._mean(self.token_s, max(left - self.step_s, floor) / fed)

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
