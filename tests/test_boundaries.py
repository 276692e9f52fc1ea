"""The edges of the public API: `out=` buffers, caller tensors, real out-of-memory, generate's
arguments, and the odd inputs a careless caller sends. Each test is a case that once got
through: it wrote `out` without publishing, published a state no token sequence gives,
committed before failing, or failed with a raw error."""
import signal

import numpy as np
import pytest
import torch

import hebrus
from conftest import tokens
from hebrus.state.image import Image

V = 256
SENTINEL = 777.0


@pytest.fixture
def warm(tiny):
    s = tiny.session()
    s.feed(tokens(5, seed=1))
    return s


def _published(model, ids):
    ref = model.session()
    logits = ref.feed(ids)
    return ref.digest(), logits


# ---- out= -----------------------------------------------------------------------------------

def test_out_made_under_inference_mode_is_written_at_publication(warm, tiny):
    """Finding: such an `out` received the logits and then a RuntimeError was raised, with
    nothing published."""
    with torch.inference_mode():
        out = torch.full((V,), SENTINEL)
    ids = tokens(4, seed=2)
    returned = warm.feed(ids, out=out)
    digest, logits = _published(tiny, tokens(5, seed=1) + ids)
    assert returned is out and torch.equal(out, logits) and warm.digest() == digest


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
def test_out_that_a_copy_could_not_write_is_refused_up_front(warm, make, message):
    """Finding: expanded, grad-requiring and Parameter buffers passed the check and then
    failed the copy with a raw RuntimeError."""
    out = make()
    before, frontier = warm.digest(), warm.frontier
    with pytest.raises(hebrus.InvalidInput, match=message):
        warm.feed([1, 2], out=out)
    assert warm.digest() == before and warm.frontier == frontier


def test_non_contiguous_out_is_fine(warm, tiny):
    backing = torch.full((2 * V,), SENTINEL)
    out = backing[::2]
    warm.feed([9], out=out)
    _, logits = _published(tiny, tokens(5, seed=1) + [9])
    assert torch.equal(out, logits) and bool((backing[1::2] == SENTINEL).all())


def test_ctrl_c_during_publication_cannot_split_out_from_the_state(warm, tiny, monkeypatch):
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
        warm.feed(ids, out=out)
    monkeypatch.undo()
    digest, logits = _published(tiny, tokens(5, seed=1) + ids)
    assert warm.digest() == digest and torch.equal(out, logits)


def test_ctrl_c_inside_a_stage_publishes_nothing(warm, tiny, monkeypatch):
    stage = next(st for st in tiny.stages if st.name == "layers.2.gdn")

    def interrupted(txn):
        raise KeyboardInterrupt

    monkeypatch.setattr(stage, "run", interrupted)
    out = torch.full((V,), SENTINEL)
    before = warm.digest()
    with pytest.raises(KeyboardInterrupt):
        warm.feed([1, 2], out=out)
    monkeypatch.undo()
    assert warm.digest() == before and bool((out == SENTINEL).all())
    warm.feed([1, 2])
    assert warm.digest() == _published(tiny, tokens(5, seed=1) + [1, 2])[0]


def test_a_sigint_handler_is_restored_after_publication(warm):
    handler = signal.getsignal(signal.SIGINT)
    warm.feed([3])
    assert signal.getsignal(signal.SIGINT) is handler


# ---- caller tensors are copied at the boundary ----------------------------------------------

@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_caller_changing_its_ids_mid_chunk_changes_nothing(tiny, monkeypatch, mode):
    """Finding: the engine used the caller's id tensor by reference, so a change after the
    embed stage published a state that matches no token sequence."""
    model = tiny if mode == "exact" else tiny.with_mode("fast")
    ids = torch.tensor(tokens(6, seed=3))
    original = ids.tolist()
    embed = next(st for st in model.stages if st.name == "embed")
    real = embed.run

    def then_caller_writes(txn):
        real(txn)
        ids.fill_(0)                                    # another thread of the caller's

    monkeypatch.setattr(embed, "run", then_caller_writes)
    s = model.session()
    s.feed(ids)
    monkeypatch.undo()
    assert s.digest() == _published(model, original)[0]


def test_ids_are_checked_on_the_copy_the_engine_uses(tiny, monkeypatch):
    ids = np.array([1, 2, 3])
    s = tiny.session()
    s.feed(ids)
    ids[:] = 999                                        # after the call: no effect on the state
    assert s.digest() == _published(tiny, [1, 2, 3])[0]


# ---- real out-of-memory -----------------------------------------------------------------------

def test_a_real_cpu_out_of_memory_is_an_allocation_failure(warm, tiny, monkeypatch):
    """Finding: torch's CPU allocator raises a plain RuntimeError, which was reported as a
    structural failure."""
    ffn = next(st for st in tiny.stages if st.name == "layers.1.ffn")
    real = ffn.moe.route

    def route_then_ask_too_much(*args, **kwargs):
        torch.empty(1 << 62, dtype=torch.uint8)          # the allocator refuses this for real
        return real(*args, **kwargs)

    monkeypatch.setattr(ffn.moe, "route", route_then_ask_too_much)
    before = warm.digest()
    with pytest.raises(hebrus.AllocationError, match="can't allocate memory") as info:
        warm.feed([1, 2, 3])
    assert info.value.stage == "layers.1.ffn" and warm.digest() == before


def test_out_of_memory_for_a_new_sessions_banks_is_an_allocation_failure(tiny):
    from hebrus.state.owners import OwnerSpec
    twin = tiny.with_mode("exact")
    twin.owners = twin.owners + [OwnerSpec("huge", (1 << 40, 1 << 20), torch.float32)]
    with pytest.raises(hebrus.AllocationError, match="session's banks"):
        twin.session()


def test_out_of_memory_is_recognised_in_every_form():
    from hebrus.state.budget import out_of_memory
    assert out_of_memory(MemoryError())
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert out_of_memory(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried"))
    assert not out_of_memory(RuntimeError("shape mismatch"))


# ---- generate checks everything before committing anything --------------------------------

@pytest.mark.parametrize("kwargs,message", [
    ({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 10**400}, "temperature"), ({"temperature": True}, "temperature"),
    ({"top_p": float("nan")}, "top_p"), ({"top_p": True}, "top_p"),
    ({"max_new_tokens": 2.0}, "max_new_tokens"),
])
def test_generate_refuses_before_the_prompt_is_committed(tiny, kwargs, message):
    """Finding: a seed >= 2**64 or < -2**63 passed the up-front checks and failed after the
    prompt was committed (frontier 3 -> 6, then the error)."""
    s = tiny.session()
    s.feed([1, 2, 3])
    with pytest.raises(hebrus.InvalidInput, match=message):
        s.generate([4, 5, 6], max_new_tokens=kwargs.pop("max_new_tokens", 2), **kwargs)
    assert s.frontier == 3


def test_the_extreme_seeds_are_accepted(tiny):
    for seed in (-(2**63), 2**64 - 1):
        assert len(list(tiny.session().generate([1], max_new_tokens=2, temperature=1.0, seed=seed))) == 2


def test_a_tiny_temperature_samples_the_greedy_token(tiny):
    """Finding: temperature 1e-308 overflowed the scaled logits to inf and sampling failed
    after the prompt was committed."""
    greedy = list(tiny.session().generate([5, 6], max_new_tokens=6))
    cold = list(tiny.session().generate([5, 6], max_new_tokens=6, temperature=1e-308, seed=1))
    assert cold == greedy


# ---- smaller ---------------------------------------------------------------------------------

@pytest.mark.parametrize("ids,message", [
    (torch.empty(3, dtype=torch.int64, device="meta"), "meta"),
    (torch.tensor([1, 2, 3]).to_sparse(), "dense"),
    (torch.tensor(5), "one-dimensional"),
])
def test_odd_id_tensors_are_invalid_input(warm, ids, message):
    with pytest.raises(hebrus.InvalidInput, match=message):
        warm.feed(ids)


class _NeverIterate(list):
    """A very long sequence that fails the test if anything walks it."""

    def __len__(self):
        return 3 * 10**7

    def __iter__(self):
        raise AssertionError("the ids were converted before the length was checked")


def test_a_chunk_longer_than_the_context_is_refused_before_conversion(warm):
    """Finding: feed(range(3 * 10**7)) spent seconds and 900 MiB before refusing."""
    with pytest.raises(hebrus.InvalidInput, match="more than the model's context limit of 1024"):
        warm.feed(_NeverIterate())
    with pytest.raises(hebrus.InvalidInput, match="context limit"):
        warm.feed(range(3 * 10**7))


def test_api_arguments_raise_invalid_input(tiny):
    """Finding: memory_budget, inject and load raised ValueError rather than InvalidInput."""
    with pytest.raises(hebrus.InvalidInput, match="memory_budget"):
        tiny.session(memory_budget=-5)
    with pytest.raises(hebrus.InvalidInput, match="memory_budget"):
        tiny.session(memory_budget=100)
    with pytest.raises(hebrus.InvalidInput, match="kinds are"):
        with hebrus.inject(stage="head", kind="meteor"):
            pass
    with pytest.raises(hebrus.InvalidInput, match="stage"):
        with hebrus.inject(stage="", kind="status"):
            pass
    for kwargs in ({"mode": "turbo"}, {"dtype": "int8"}, {"device": "cuda:banana"}, {"device": 3.5}):
        with pytest.raises(hebrus.InvalidInput):
            hebrus.load("tiny", **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only build")
def test_asking_for_cuda_without_it_is_invalid_input():
    with pytest.raises(hebrus.InvalidInput, match="no CUDA device is available"):
        hebrus.load("tiny", device="cuda")


# ---- found by a hunt for bad inputs ------------------------------------------------------

class Timeout(Exception):
    pass


@pytest.mark.parametrize("signum", [signal.SIGALRM, signal.SIGINT, signal.SIGTERM])
def test_any_raising_signal_handler_during_publication_comes_after_the_flip(warm, tiny, monkeypatch, signum):
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
            warm.feed([4, 5], out=out)
    finally:
        signal.signal(signum, previous)
    monkeypatch.undo()
    digest, logits = _published(tiny, tokens(5, seed=1) + [4, 5])
    assert warm.digest() == digest and torch.equal(out, logits)


@pytest.mark.parametrize("call", ["feed", "digest", "logits"])
def test_a_signal_handler_calling_back_into_the_session_is_refused_not_deadlocked(warm, tiny, monkeypatch, call):
    """A handler that runs while the main thread is inside a call on the same session used to
    wait for the lock its own thread held: a hang. Now the inner call raises InvalidInput."""
    import faulthandler
    faulthandler.dump_traceback_later(60, exit=True)          # a regression hangs: fail loudly
    seen = []

    def handler(*_):
        try:
            getattr(warm, call)([9]) if call == "feed" else getattr(warm, call)() if call == "digest" else warm.logits
        except hebrus.InvalidInput as exc:
            seen.append(str(exc))

    previous = signal.signal(signal.SIGUSR1, handler)
    stage = next(st for st in tiny.stages if st.name == "layers.0.gdn")
    real = stage.run

    def signalled(txn):
        real(txn)
        signal.raise_signal(signal.SIGUSR1)

    monkeypatch.setattr(stage, "run", signalled)
    try:
        warm.feed([1, 2])
    finally:
        signal.signal(signal.SIGUSR1, previous)
        faulthandler.cancel_dump_traceback_later()
    assert seen and "session busy" in seen[0]
    monkeypatch.undo()
    assert warm.digest() == _published(tiny, tokens(5, seed=1) + [1, 2])[0]


def _resized(t):
    t.untyped_storage().resize_(0)
    return t


def test_tensors_whose_storage_was_resized_away_are_refused(warm):
    """Both used to crash the process (a segfault reading or writing freed memory)."""
    before = warm.digest()
    with pytest.raises(hebrus.InvalidInput, match="storage is smaller"):
        warm.feed([1], out=_resized(torch.zeros(V)))
    with pytest.raises(hebrus.InvalidInput, match="storage is smaller"):
        warm.feed(_resized(torch.tensor([1, 2, 3])))
    assert warm.digest() == before


def test_out_may_not_alias_the_models_weights(warm, tiny):
    weight = dict(tiny.named_parameters())["lm_head.weight"]
    snapshot = weight.clone()
    with pytest.raises(hebrus.InvalidInput, match="model's weights"):
        warm.feed([1], out=weight[:, 0])
    assert torch.equal(weight, snapshot)


class _LyingLength(list):
    def __init__(self, length):
        super().__init__([1, 2])
        self._length = length

    def __len__(self):
        if isinstance(self._length, Exception):
            raise self._length
        return self._length


class _Subclass(torch.Tensor):
    pass


class _LyingInt(int):
    def __lt__(self, other):
        return False

    def __index__(self):
        return 64


@pytest.mark.parametrize("ids,message", [
    (range(10**30), "context limit"),
    (_LyingLength(10**30), "context limit"),
    (_LyingLength(-1), "length"),
    (_LyingLength(RuntimeError("no")), "length"),
    (torch.zeros(3, dtype=torch.uint8).view(torch.bits8), "integers"),
    (torch.tensor([1, 2]).as_subclass(_Subclass), "plain torch.Tensor"),
    (torch.tensor([2**63], dtype=torch.uint64), "2\\*\\*63"),
    (np.array([2**63], dtype=np.uint64), "int64 range"),
])
def test_more_odd_ids_are_invalid_input(warm, ids, message):
    before = warm.digest()
    with pytest.raises(hebrus.InvalidInput, match=message):
        warm.feed(ids)
    assert warm.digest() == before


def test_counts_take_the_true_value_of_int_subclasses_and_numpy_ints(tiny):
    s = tiny.session()
    with pytest.raises(hebrus.InvalidInput, match="chunk_size"):
        s.prefill([1, 2, 3], chunk_size=_LyingInt(-5))
    assert s.frontier == 0
    tokens_ = list(s.generate([1, 2], max_new_tokens=np.int64(3), chunk_size=np.int32(2), seed=np.uint8(4)))
    assert len(tokens_) == 3 and s.frontier == 5
    assert tiny.session(memory_budget=np.int64(10**9)).budget.limit == 10**9


def test_long_numbers_are_cut_in_messages(tiny):
    with pytest.raises(hebrus.InvalidInput) as info:
        tiny.session().generate([1], temperature=10**400)
    assert len(str(info.value)) < 200


class _Path:
    def __init__(self, value):
        self.value = value

    def __fspath__(self):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


@pytest.mark.parametrize("path", ["", _Path(b"/tmp"), _Path(RuntimeError("no")), b"/tmp", None, 3, "a\0b"])
def test_odd_paths_are_invalid_input(tiny, path):
    with pytest.raises(hebrus.InvalidInput):
        hebrus.load(path)
    with pytest.raises(hebrus.InvalidInput):
        tiny.save(path)


def test_save_refuses_paths_that_cannot_be_folders(tiny, tmp_path):
    (tmp_path / "afile").write_text("x")
    for path in (tmp_path / "afile" / "sub" / "ck", tmp_path / ("x" * 300)):
        with pytest.raises(hebrus.InvalidInput, match="cannot save"):
            tiny.save(path)
    assert (tmp_path / "afile").read_text() == "x"


def test_save_refuses_the_working_directory(tiny, tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    for path in (".", str(tmp_path), str(tmp_path.parent)):
        with pytest.raises(hebrus.InvalidInput, match="working directory"):
            tiny.save(path)
    assert (tmp_path / "notes.txt").read_text() == "mine" and tmp_path.is_dir()


def test_saved_files_are_readable_by_others(tiny, tmp_path):
    tiny.save(tmp_path / "ck")
    assert (tmp_path / "ck" / "model.safetensors").stat().st_mode & 0o044 == 0o044


def test_preset_weights_do_not_depend_on_torch_defaults(tiny):
    reference = tiny.session()
    reference.feed([1, 2, 3])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = hebrus.load("tiny")
    finally:
        torch.set_default_dtype(previous)
    s = model.session()
    s.feed([1, 2, 3])
    assert s.digest() == reference.digest()


def test_names_from_an_untrusted_file_cannot_drive_the_terminal(tiny, tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    from hebrus.cli import main
    tiny.save(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["\x1b]0;owned\x07\x1b[2J\u202erab"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(hebrus.CheckpointError) as info:
        hebrus.load(tmp_path)
    assert "\x1b" not in str(info.value) and "\u202e" not in str(info.value)
    assert main(["info", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\u202e" not in err and "\\x1b" in err


def test_a_weight_that_does_not_fit_the_models_dtype_is_refused_at_load(tiny, tmp_path):
    """Finite in the file, infinite after the cast: every chunk would have been non-finite."""
    params = {k: v.clone() for k, v in tiny.named_parameters()}
    params["layers.0.gdn.out_proj.weight"][0, 0] = 1e5
    hebrus.Model(tiny.config, params).save(tmp_path)
    assert hebrus.load(tmp_path).session().feed([1]) is not None
    with pytest.raises(hebrus.InvalidInput, match="layers.0.gdn.out_proj.weight does not fit in torch.float16"):
        hebrus.load(tmp_path, dtype="float16")


def test_non_finite_weights_are_refused_when_a_model_is_built(tiny):
    params = {k: v.clone() for k, v in tiny.named_parameters()}
    params["norm.weight"][0] = float("nan")
    with pytest.raises(hebrus.InvalidInput, match="norm.weight holds NaN"):
        hebrus.Model(tiny.config, params)
