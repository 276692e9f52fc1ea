import os
import signal
import sys

import pytest
import torch
from hypothesis import settings

# CI runs a fixed set of examples (HEBRUS_HYPOTHESIS=ci); a developer's run explores new ones.
settings.register_profile("ci", derandomize=True)
settings.register_profile("long", derandomize=False)       # test modules raise their example counts
settings.load_profile(os.environ.get("HEBRUS_HYPOTHESIS", "default"))

sys.path.insert(0, os.path.dirname(__file__))

# Under pytest-xdist (the README's `-n 2`) each worker computes on one thread: the workers
# already fill the cores, and two threads each would only contend.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# The tests of Ctrl-C (publication, journals, the server) need Python's own SIGINT handler, which
# Python does not install where SIGINT came in ignored (a command run in the background by a shell
# without job control): there a raised SIGINT would vanish, not raise KeyboardInterrupt. (Such a
# run then also hears a Ctrl-C typed at its terminal, as a foreground run does.)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import hebrus  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
    return hebrus.load("tiny")


@pytest.fixture(scope="session")
def tiny_fast(tiny):
    return tiny.with_mode("fast")


@pytest.fixture(scope="session")
def fast_models(tmp_path_factory):
    """Fast-mode models covering every mixer and feed-forward kind and both residuals: the tiny
    preset and tiny random Qwen3.5 and Qwen3.5-MoE checkpoints."""
    from foreign import build
    out = {"tiny": hebrus.load("tiny", mode="fast")}
    for family in ("qwen3_5", "qwen3_5_moe", "kimi_linear"):
        folder, _ = build(family, tmp_path_factory.mktemp(family))
        out[family] = hebrus.load(folder, mode="fast")
    return out


@pytest.fixture(scope="session")
def tiny64():
    return hebrus.load("tiny", dtype=torch.float64)


# How long a test waits for something that should happen soon (a server to start, a request to
# be let go): long enough for a machine loaded many times over, since a wait ends once it holds.
PATIENCE = 300.0


def wait_until(condition, seconds: float = PATIENCE, step: float = 0.01) -> bool:
    """Poll `condition()` until it holds or `seconds` pass; its last answer."""
    import time
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return condition()
        time.sleep(step)
    return True


def tokens(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


WARM = tokens(5, seed=1)          # what the `warmed` session holds


@pytest.fixture
def warmed(tiny):
    """A tiny exact session that has committed WARM."""
    s = tiny.session()
    s.feed(WARM)
    return s


def published(model, ids) -> tuple[str, torch.Tensor]:
    """The digest and logits of a new session of `model` fed `ids` in one chunk."""
    ref = model.session()
    logits = ref.feed(ids)
    return ref.digest(), logits


def poisoned(model, token: int):
    """A copy of a fast-mode `model` whose embedding row for `token` is NaN: feeding that token
    is a real non-finite failure, from the first stage on."""
    params = {k: v.clone() for k, v in model.named_parameters()}
    params["embed.weight"][token] = float("nan")
    return hebrus.runtime.Model._placed(model.config, model.spec, params, model.device, model.dtype, "fast")
