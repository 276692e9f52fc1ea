"""`hebrus verify` can fail: a stage that writes public state leaks, a dead injector misses."""
import hebrus
from hebrus import verify


def _cell(model, stage, kind, group="fault"):
    check = next(c for c in verify.checks(model) if c.name == f"{stage} × {kind}" and c.group == group)
    return check.run()


def test_a_stage_writing_public_state_is_reported_as_leaked(monkeypatch):
    model = hebrus.load("tiny")
    gdn = next(st for st in model.stages if st.name == "layers.0.gdn")
    run = gdn.run

    def leaky(txn, step):
        txn.read("layers.0.gdn.recurrent").add_(1.0)     # the one thing a stage must never do
        run(txn, step)

    monkeypatch.setattr(gdn, "run", leaky)
    verdict = _cell(model, "layers.2.gdn", "nonfinite")
    assert not verdict.passed and verdict.verdict == "leaked" and "digest changed" in verdict.detail


def test_an_injection_that_does_nothing_is_reported_as_missed(monkeypatch):
    model = hebrus.load("tiny")
    monkeypatch.setitem(hebrus.faults._FIRE, "command", lambda txn, session: None)
    for group in ("fault", "batch"):
        verdict = _cell(model, "head", "command", group)
        assert not verdict.passed and verdict.verdict == "missed"


def test_a_batch_cell_sees_a_fault_that_reaches_the_other_sessions(monkeypatch):
    """A status injection that sets the bit for every session of the step, not the one aimed
    at: the others abort too, and the batch cell says so."""
    model = hebrus.load("tiny")
    everyone = lambda txn, session: hebrus.faults._status(txn, None)     # noqa: E731
    monkeypatch.setitem(hebrus.faults._FIRE, "status", everyone)
    verdict = _cell(model, "layers.1.qsa", "status", "batch")
    assert not verdict.passed and verdict.verdict == "leaked" and "did not publish" in verdict.detail


def test_run_reports_every_stage_and_kind():
    model = hebrus.load("tiny", mode="fast")
    results = verify.run(model)
    for group in ("fault", "batch"):
        cells = {r.name for r in results if r.group == group}
        assert len(cells) == len(model.stages) * len(hebrus.FAULT_KINDS)
    assert all(r.passed for r in results)
