"""Publication: `out=` is written only with the state it belongs to, and no signal, re-entrant
call or odd buffer can split the two. Each test is a case that once got through."""
import signal

import pytest
import torch

import hebrus
from conftest import WARM, published, tokens
from hebrus.state.image import Image

V = 256
SENTINEL = 777.0


# ---- out= -----------------------------------------------------------------------------------

def test_out_made_under_inference_mode_is_written_at_publication(warmed, tiny):
    """Finding: such an `out` received the logits and then a RuntimeError was raised, with
    nothing published."""
    with torch.inference_mode():
        out = torch.full((V,), SENTINEL)
    ids = tokens(4, seed=2)
    returned = warmed.feed(ids, out=out)
    digest, logits = published(tiny, WARM + ids)
    assert returned is out and torch.equal(out, logits) and warmed.digest() == digest


def test_state_made_under_inference_mode_keeps_working_outside_it(tiny):
    with torch.inference_mode():
        s = tiny.session()
        s.feed([1, 2, 3])
    s.feed([4, 5])
    ref = tiny.session()
    ref.feed([1, 2, 3, 4, 5])
    assert s.digest() == ref.digest()


@pytest.mark.parametrize("make,message", [
    (lambda: torch.zeros(1).expand(V), "stride-0"),
    (lambda: torch.zeros(V, requires_grad=True), "require grad"),
    (lambda: torch.nn.Parameter(torch.zeros(V)), "nn.Parameter"),
    (lambda: torch.zeros(V).to_sparse(), "dense"),
    (lambda: torch.zeros(V, device="meta"), "device"),
    (lambda: torch.zeros(V)._neg_view(), "negated"),
])
def test_out_that_a_copy_could_not_write_is_refused_up_front(warmed, make, message):
    """Finding: expanded, grad-requiring and Parameter buffers passed the check and then
    failed the copy with a raw RuntimeError."""
    out = make()
    before, frontier = warmed.digest(), warmed.frontier
    with pytest.raises(hebrus.InvalidInput, match=message):
        warmed.feed([1, 2], out=out)
    assert warmed.digest() == before and warmed.frontier == frontier


def test_non_contiguous_out_is_fine(warmed, tiny):
    backing = torch.full((2 * V,), SENTINEL)
    out = backing[::2]
    warmed.feed([9], out=out)
    _, logits = published(tiny, WARM + [9])
    assert torch.equal(out, logits) and bool((backing[1::2] == SENTINEL).all())


def test_ctrl_c_during_publication_cannot_split_out_from_the_state(warmed, tiny, monkeypatch):
    """Finding: a KeyboardInterrupt between the copy into `out` and the flip left `out` written
    and the state unpublished. Now Ctrl-C is held until both are done, then delivered."""
    real = Image.publish

    def interrupted(self, record):
        signal.raise_signal(signal.SIGINT)              # arrives right after out was written
        real(self, record)

    monkeypatch.setattr(Image, "publish", interrupted)
    out = torch.full((V,), SENTINEL)
    ids = [7, 8, 9]
    with pytest.raises(KeyboardInterrupt):
        warmed.feed(ids, out=out)
    monkeypatch.undo()
    digest, logits = published(tiny, WARM + ids)
    assert warmed.digest() == digest and torch.equal(out, logits)


def test_ctrl_c_inside_a_stage_publishes_nothing(warmed, tiny, monkeypatch):
    stage = next(st for st in tiny.stages if st.name == "layers.2.gdn")

    def interrupted(txn, step):
        raise KeyboardInterrupt

    monkeypatch.setattr(stage, "run", interrupted)
    out = torch.full((V,), SENTINEL)
    before = warmed.digest()
    with pytest.raises(KeyboardInterrupt):
        warmed.feed([1, 2], out=out)
    monkeypatch.undo()
    assert warmed.digest() == before and bool((out == SENTINEL).all())
    warmed.feed([1, 2])
    assert warmed.digest() == published(tiny, WARM + [1, 2])[0]


def test_a_sigint_handler_is_restored_after_publication(warmed):
    handler = signal.getsignal(signal.SIGINT)
    warmed.feed([3])
    assert signal.getsignal(signal.SIGINT) is handler


# ---- found by a hunt for bad inputs ------------------------------------------------------

class Timeout(Exception):
    pass


@pytest.mark.parametrize("signum", [signal.SIGALRM, signal.SIGINT, signal.SIGTERM])
def test_any_raising_signal_handler_during_publication_comes_after_the_flip(warmed, tiny, monkeypatch, signum):
    """A timeout handler (or an app's own Ctrl-C or SIGTERM handler) that raises while the chunk
    publishes: its exception arrives after the flip, `out` and the state agree, and it is not
    reported as an abort that published nothing."""
    def raise_timeout(*_):
        raise Timeout("deadline")

    previous = signal.signal(signum, raise_timeout)
    real = Image.publish

    def interrupted(self, record):
        signal.raise_signal(signum)
        real(self, record)

    monkeypatch.setattr(Image, "publish", interrupted)
    out = torch.full((V,), SENTINEL)
    try:
        with pytest.raises(Timeout):
            warmed.feed([4, 5], out=out)
    finally:
        signal.signal(signum, previous)
    monkeypatch.undo()
    digest, logits = published(tiny, WARM + [4, 5])
    assert warmed.digest() == digest and torch.equal(out, logits)


@pytest.mark.parametrize("call", ["feed", "digest", "logits"])
def test_a_signal_handler_calling_back_into_the_session_is_refused_not_deadlocked(warmed, tiny, monkeypatch, call):
    """A handler that runs while the main thread is inside a call on the same session used to
    wait for the lock its own thread held: a hang. Now the inner call raises InvalidInput."""
    import faulthandler
    faulthandler.dump_traceback_later(60, exit=True)          # a regression hangs: fail loudly
    seen = []

    def handler(*_):
        try:
            getattr(warmed, call)([9]) if call == "feed" else getattr(warmed, call)() if call == "digest" else warmed.logits
        except hebrus.InvalidInput as exc:
            seen.append(str(exc))

    previous = signal.signal(signal.SIGUSR1, handler)
    stage = next(st for st in tiny.stages if st.name == "layers.0.gdn")
    real = stage.run

    def signalled(txn, step):
        real(txn, step)
        signal.raise_signal(signal.SIGUSR1)

    monkeypatch.setattr(stage, "run", signalled)
    try:
        warmed.feed([1, 2])
    finally:
        signal.signal(signal.SIGUSR1, previous)
        faulthandler.cancel_dump_traceback_later()
    assert seen and "session busy" in seen[0]
    monkeypatch.undo()
    assert warmed.digest() == published(tiny, WARM + [1, 2])[0]


def _resized(t):
    t.untyped_storage().resize_(0)
    return t


def test_tensors_whose_storage_was_resized_away_are_refused(warmed):
    """Both used to crash the process (a segfault reading or writing freed memory)."""
    before = warmed.digest()
    with pytest.raises(hebrus.InvalidInput, match="storage is smaller"):
        warmed.feed([1], out=_resized(torch.zeros(V)))
    with pytest.raises(hebrus.InvalidInput, match="storage is smaller"):
        warmed.feed(_resized(torch.tensor([1, 2, 3])))
    assert warmed.digest() == before


def test_out_may_not_alias_the_models_weights(warmed, tiny):
    weight = dict(tiny.named_parameters())["lm_head.weight"]
    snapshot = weight.clone()
    with pytest.raises(hebrus.InvalidInput, match="model's weights"):
        warmed.feed([1], out=weight[:, 0])
    assert torch.equal(weight, snapshot)


# ---- what a caller learns when a signal ends a call of several transactions -----------------

def _interrupt_publication(monkeypatch, at: int):
    """Ctrl-C arrives while the `at`-th publication (0-based) from now is under way."""
    real, count = Image.publish, [0]

    def interrupted(self, record):
        if count[0] == at:
            signal.raise_signal(signal.SIGINT)
        count[0] += 1
        real(self, record)

    monkeypatch.setattr(Image, "publish", interrupted)


def test_ctrl_c_in_generate_says_what_was_committed(tiny, monkeypatch):
    """The token being fed when Ctrl-C lands is committed but never yielded: `published` on the
    interrupt counts it, and the session holds exactly that."""
    s = tiny.session()
    prompt, got = [1, 2, 3], []
    _interrupt_publication(monkeypatch, at=3)           # the prompt, then tokens 1, 2, 3
    with pytest.raises(KeyboardInterrupt) as info:
        for token in s.generate(prompt, max_new_tokens=8, chunk_size=8):
            got.append(token)
    monkeypatch.undo()
    assert len(got) == 2 and info.value.published == len(prompt) + 3 == s.frontier
    whole = list(tiny.session().generate(prompt, max_new_tokens=3, chunk_size=8))
    assert whole[:2] == got


def test_ctrl_c_in_prefill_says_what_waspublished(tiny, monkeypatch):
    s = tiny.session()
    _interrupt_publication(monkeypatch, at=1)
    with pytest.raises(KeyboardInterrupt) as info:
        s.prefill(tokens(20, seed=4), chunk_size=6)
    assert info.value.published == 12 == s.frontier


def test_a_failed_generate_step_says_what_was_committed(tiny):
    s = tiny.session()
    got = []
    with pytest.raises(hebrus.NonFiniteError) as info:
        gen = s.generate([1, 2, 3], max_new_tokens=5)
        got.append(next(gen))
        with hebrus.inject(stage="head", kind="nonfinite"):
            got.append(next(gen))
    assert info.value.published == 4 == s.frontier and len(got) == 1


# ---- the signal hold itself ------------------------------------------------------------------

class Boom(Exception):
    pass


def test_handlers_are_restored_when_installing_them_is_interrupted(monkeypatch):
    from hebrus.state import interrupts
    before = {signum: signal.getsignal(signum) for signum in interrupts.DEFERRED}
    real, calls = interrupts._signal.signal, [0]        # the calls the swap makes

    def interrupted_second_install(signum, handler):
        calls[0] += 1
        if calls[0] == 2:
            raise Boom("a handler ran while installing")
        return real(signum, handler)

    monkeypatch.setattr(interrupts._signal, "signal", interrupted_second_install)
    previous = real(signal.SIGTERM, lambda *_: None)    # two Python handlers to swap
    try:
        with pytest.raises(Boom):
            with interrupts.deferred_signals():
                pass
        monkeypatch.undo()
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
    finally:
        real(signal.SIGTERM, previous)


def test_every_held_signal_is_delivered_even_if_one_handler_raises():
    from hebrus.state.interrupts import deferred_signals
    seen = []

    def raising(*_):
        raise Boom("first")

    old1, old2 = signal.signal(signal.SIGUSR1, raising), signal.signal(signal.SIGUSR2, lambda *_: seen.append(2))
    try:
        with pytest.raises(Boom):
            with deferred_signals():
                signal.raise_signal(signal.SIGUSR1)
                signal.raise_signal(signal.SIGUSR2)
                assert seen == []                         # both held
        for _ in range(1000):                             # the re-sent one runs at a bytecode boundary
            if seen:
                break
        assert seen == [2]
    finally:
        signal.signal(signal.SIGUSR1, old1)
        signal.signal(signal.SIGUSR2, old2)


def test_a_block_inside_another_holds_signals_until_the_outer_one_ends():
    """A step publishes each session in a block of its own inside one around them all: the inner
    blocks swap no handler, and a signal that lands in one is delivered once the outer ends."""
    from hebrus.state.interrupts import deferred_signals
    seen = []
    old = signal.signal(signal.SIGUSR1, lambda *_: seen.append("usr1"))
    try:
        with deferred_signals():
            held = signal.getsignal(signal.SIGUSR1)
            for _ in range(3):
                with deferred_signals():
                    assert signal.getsignal(signal.SIGUSR1) is held      # nothing swapped
                    signal.raise_signal(signal.SIGUSR1)
                assert seen == []                                      # still held after an inner block
        assert seen == ["usr1"] * 3
        assert signal.getsignal(signal.SIGUSR1) is not held           # the outer put the handler back
        with deferred_signals():                                       # and a later block holds again
            signal.raise_signal(signal.SIGUSR1)
            assert seen == ["usr1"] * 3
        assert seen == ["usr1"] * 4
    finally:
        signal.signal(signal.SIGUSR1, old)
