"""The edges of the public API: caller tensors, real out-of-memory, generate's arguments, and
the odd inputs a careless caller sends. Each test is a case that once got through: it published
a state no token sequence gives, committed before failing, or failed with a raw error."""
import numpy as np
import pytest
import torch

import hebrus
from conftest import WARM, published, tokens

V = 256


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

    def then_caller_writes(txn, step):
        real(txn, step)
        ids.fill_(0)                                    # another thread of the caller's

    monkeypatch.setattr(embed, "run", then_caller_writes)
    s = model.session()
    s.feed(ids)
    monkeypatch.undo()
    assert s.digest() == published(model, original)[0]


@pytest.mark.parametrize("make", [lambda: np.array([1, 2, 3]), lambda: [1, 2, 3]])
def test_arrays_and_lists_changed_mid_chunk_change_nothing(tiny, monkeypatch, make):
    ids = make()
    embed = next(st for st in tiny.stages if st.name == "embed")
    real = embed.run

    def then_caller_writes(txn, step):
        real(txn, step)
        ids[:] = [999] * 3 if isinstance(ids, list) else 999

    monkeypatch.setattr(embed, "run", then_caller_writes)
    s = tiny.session()
    s.feed(ids)
    monkeypatch.undo()
    assert s.digest() == published(tiny, [1, 2, 3])[0]


class _ChangingList(list):
    """A list whose items turn into text once they have been read once (a racing thread)."""

    def __iter__(self):
        items = list(super().__iter__())
        self[:] = ["x"] * len(self)
        return iter(items)


def test_a_list_is_read_once_so_what_is_checked_is_what_is_used(warmed, tiny):
    warmed.feed(_ChangingList([4, 5, 6]))
    assert warmed.digest() == published(tiny, WARM + [4, 5, 6])[0]


# ---- real out-of-memory -----------------------------------------------------------------------

def test_a_real_cpu_out_of_memory_is_an_allocation_failure(warmed, tiny, monkeypatch):
    """Finding: torch's CPU allocator raises a plain RuntimeError, which was reported as a
    structural failure."""
    ffn = next(st for st in tiny.stages if st.name == "layers.1.ffn")
    real = ffn.feed.moe.route

    def route_then_ask_too_much(*args, **kwargs):
        torch.empty(1 << 62, dtype=torch.uint8)          # the allocator refuses this for real
        return real(*args, **kwargs)

    monkeypatch.setattr(ffn.feed.moe, "route", route_then_ask_too_much)
    before = warmed.digest()
    with pytest.raises(hebrus.AllocationError, match="can't allocate memory") as info:
        warmed.feed([1, 2, 3])
    assert info.value.stage == "layers.1.ffn" and warmed.digest() == before


def test_a_pool_that_holds_no_session_is_an_allocation_failure(tiny):
    from hebrus.state.owners import OwnerSpec
    twin = tiny.with_mode("exact")
    twin.owners = twin.owners + [OwnerSpec("huge", (1 << 40, 1 << 20), torch.float32)]
    with pytest.raises(hebrus.AllocationError, match="state pool"):
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
def test_odd_id_tensors_are_invalid_input(warmed, ids, message):
    with pytest.raises(hebrus.InvalidInput, match=message):
        warmed.feed(ids)


class _NeverIterate(list):
    """A very long sequence that fails the test if anything walks it."""

    def __len__(self):
        return 3 * 10**7

    def __iter__(self):
        raise AssertionError("the ids were converted before the length was checked")


def test_a_chunk_longer_than_the_context_is_refused_before_conversion(warmed):
    """Finding: feed(range(3 * 10**7)) spent seconds and 900 MiB before refusing."""
    with pytest.raises(hebrus.InvalidInput, match="more than the model's context limit of 1024"):
        warmed.feed(_NeverIterate())
    with pytest.raises(hebrus.InvalidInput, match="context limit"):
        warmed.feed(range(3 * 10**7))


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


# ---- more odd input, found by a hunt for bad inputs -----------------------------------

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
def test_more_odd_ids_are_invalid_input(warmed, ids, message):
    before = warmed.digest()
    with pytest.raises(hebrus.InvalidInput, match=message):
        warmed.feed(ids)
    assert warmed.digest() == before


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


@pytest.mark.parametrize("kwargs", [{"seed": 10**5000}, {"max_new_tokens": -10**5000},
                                    {"temperature": -10**5000}, {"chunk_size": -10**5000}])
def test_numbers_too_long_to_print_are_still_invalid_input(tiny, kwargs):
    with pytest.raises(hebrus.InvalidInput):
        tiny.session().generate([1], **kwargs)
