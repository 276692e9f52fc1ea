"""The loop's measure of what a pass costs (`Pace`): a decode step and a prompt token told apart
from passes that do one, the other, or both."""
from __future__ import annotations

import pytest

from hebrus.scheduling.pace import Pace

STEP, TOKEN = 0.05, 0.001           # exact in the sums' float arithmetic to well within the tolerance


def test_passes_that_do_both_are_told_apart_when_they_feed_different_amounts():
    pace = Pace()
    for fed in (100, 30, 250, 64, 16, 180):
        pace.add(True, fed, STEP + TOKEN * fed)
    assert pace.step_s == pytest.approx(STEP, rel=1e-6) and pace.token_s == pytest.approx(TOKEN, rel=1e-6)


def test_two_passes_a_turn_measure_each_alone():
    pace = Pace()
    pace.add(True, 0, STEP)
    assert pace.step_s == pytest.approx(STEP) and pace.token_s is None
    pace.add(False, 200, TOKEN * 200)
    assert pace.step_s == pytest.approx(STEP, rel=1e-6) and pace.token_s == pytest.approx(TOKEN, rel=1e-6)


def test_before_they_can_be_told_apart_the_prompts_get_what_the_step_did_not_take():
    pace = Pace()
    pace.add(True, 100, STEP + TOKEN * 100)                 # both, nothing known: nothing said
    assert pace.step_s is None and pace.token_s is None
    pace = Pace()
    pace.add(True, 0, STEP)
    pace.add(True, 0, STEP)
    pace.add(True, 100, STEP + TOKEN * 100)                 # separable from here on
    assert pace.token_s == pytest.approx(TOKEN, rel=1e-6)


def test_a_step_alone_is_followed_apart_from_the_fit():
    """`alone_s` is what passes that only stepped took: a step beside prompt chunks (the fit's
    `step_s`) may cost more."""
    pace = Pace()
    assert pace.alone_s is None
    pace.add(True, 0, STEP)
    for fed in (100, 30, 250, 64, 16, 180) * 4:
        pace.add(True, fed, 1.5 * STEP + TOKEN * fed)
    assert pace.alone_s == pytest.approx(STEP) and pace.step_s == pytest.approx(1.5 * STEP, rel=1e-3)
    pace.add(False, 100, TOKEN * 100)                        # a pass that only fed: not a step alone
    assert pace.alone_s == pytest.approx(STEP)


def test_a_step_alone_stands_for_steps_of_about_its_width():
    pace = Pace()
    assert pace.alone(16) is None
    pace.add(16, 0, STEP)
    assert pace.alone(16) == pytest.approx(STEP) and pace.alone(13) == pytest.approx(STEP)
    assert pace.alone(12) is None and pace.alone(21) is None          # a quarter narrower or wider: not known
    pace.add(32, 0, 2 * STEP)                                # another width starts the mean again
    assert pace.alone(32) == pytest.approx(2 * STEP) and pace.alone(16) is None
    for width in (36, 39):                                   # near 32: the mean goes on from 32's width
        pace.add(width, 0, 2 * STEP)
    assert pace.alone_width == 32 and pace.alone(41) is None


def test_it_follows_a_pace_that_changes():
    pace = Pace()
    for fed in (100, 30, 250, 64) * 3:
        pace.add(True, fed, STEP + TOKEN * fed)
    for fed in (100, 30, 250, 64) * 15:                     # the contexts grew: tokens cost twice as much
        pace.add(True, fed, STEP + 2 * TOKEN * fed)
    assert pace.token_s == pytest.approx(2 * TOKEN, rel=1e-3) and pace.step_s == pytest.approx(STEP, rel=1e-2)


def test_a_paced_pass_runs_as_many_stages_as_fit_at_what_each_took_by_its_place():
    """Stage costs kept by place (a pass of three stages and its end: four places); a count from
    a place adds them up to what fits, at least one; a place never measured ends it; a pass that
    runs its stages again counts them from the first place again."""
    pace = Pace(keep=0.5)
    assert pace.stages_within(0, 1.0, 4) == 1                       # nothing measured yet
    pace.staged(0, [0.1, 0.5], 4)
    assert pace.stages_within(0, 0.55, 4) == 1 and pace.stages_within(0, 0.6, 4) == 2
    assert pace.stages_within(0, 10.0, 4) == 2                      # place 2 never measured
    pace.staged(2, [0.2, 0.05, 0.3], 4)                             # places 2, 3, then 0 again
    assert pace.stage_s[0] == pytest.approx(0.5 * 0.1 + 0.5 * 0.3)
    assert pace.stages_within(1, 0.72, 4) == 2 and pace.stages_within(1, 0.8, 4) == 3    # 0.5, 0.7, 0.75
    assert pace.stages_within(3, 0.01, 4) == 1                      # one even when it overruns
    assert pace.stages_within(3, 0.97, 4) == 4                      # 0.05, 0.25, 0.75, 0.95: round again
