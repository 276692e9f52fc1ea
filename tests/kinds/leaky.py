"""A layer kind written for the tests, in one file as every kind is: a leaky running sum of the
normed input, s' = decay·s + h, read out through a projection, y = W s'. Its state is one banked
vector a layer; its op (`leaky.sums`) is its own, declared with the kind."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hebrus.layers.kind import Cost, Kind
from hebrus.layers.sublayer import Sublayer
from hebrus.ops.quant import linear
from hebrus.state.owners import OwnerSpec


@dataclass(frozen=True, slots=True)
class LeakySection:
    key: ClassVar[str] = "leaky"
    decay: float

    def problems(self, s):
        if not 0 <= self.decay < 1:
            yield f"the leaky decay ({self.decay}) must lie in [0, 1)"


def leaky_sums(h: torch.Tensor, state: torch.Tensor, decay: float) -> torch.Tensor:
    """h [T, D], state [D] -> the state after every token [T, D]."""
    states = []
    for t in range(len(h)):
        state = decay * state + h[t]
        states.append(state)
    return torch.stack(states)


class LeakyMixer(Sublayer):
    def __init__(self, s, params, layer, kernels):
        super().__init__(s, params, layer, "mixer", kernels)
        self.name = f"layers.{layer}.leaky"
        self.w, self.decay = params[self.name + ".out.weight"], s.section(LeakySection).decay
        self.sums = kernels.ops["leaky.sums"]

    def run(self, txn, batch) -> None:
        def body(at, h, state, each=False):
            if at.one_each:                  # row i: session i's token and state
                states = self.decay * state + h
                last = states
            else:
                states = self.sums(h, state, self.decay)
                last = states if each else states[-1]
            return linear(states, self.w), last

        state = self.framed(batch, body, txn.read(self.name + ".sum"))
        (txn.write_each if batch.keeps else txn.write)(self.name + ".sum", state)


class Leaky(Kind):
    name = "leaky"
    role = "mixer"
    section = LeakySection
    quantized = ("out.weight",)
    outputs = ("out.weight",)

    def weights(self, s, prefix):
        return {prefix + "out.weight": (s.hidden_size, s.hidden_size)}

    def owners(self, s, prefix, dtype, state_dtype):
        return [OwnerSpec(prefix + "sum", (s.hidden_size,), state_dtype)]

    def init(self, leaf, shape, gen):
        return None

    def stage(self, s, params, layer, kernels, shared):
        return LeakyMixer(s, params, layer, kernels)

    def cost(self, s, position):
        return Cost()

    def ops(self, mode, device, dtype):
        return {"leaky.sums": leaky_sums}
