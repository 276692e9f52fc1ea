"""verify's fast-mode check on a model whose own rounding is amplified: the bound widens to what
exact mode itself achieves against float64, and no further."""
from __future__ import annotations

import dataclasses

import pytest
import hebrus
from foreign import build
from hebrus import verify
from hebrus.layers import kernels as kernel_table


@pytest.fixture(scope="module")
def amplifying(tmp_path_factory):
    """The tiny Qwen3.5 of the parity tests: a delta-rule head with a tiny output, normalised
    back to unit scale, amplifies rounding past the float32 fast bound (2^-15)."""
    return build("qwen3_5", tmp_path_factory.mktemp("q"))[0]


def _fast_checks(model):
    return [c for c in verify.checks(model) if c.group == "equivalence"]


def test_the_dtype_bound_alone_fails_and_exacts_own_error_explains_it(amplifying):
    verdicts = [check.run() for check in _fast_checks(hebrus.load(amplifying, mode="fast"))]
    assert all(v.passed for v in verdicts), [v.detail for v in verdicts]
    # the floor is measured only where the float32 bound (2^-15) alone failed
    assert any("exact's own error" in v.detail for v in verdicts)


def test_the_floor_does_not_excuse_a_fast_path_that_is_worse_than_exact(amplifying, monkeypatch):
    fast = hebrus.load(amplifying, mode="fast")
    original = kernel_table.kernels

    def noisy(mode, chooser=None, *rest):         # fast mode's delta rule 1e-3 off
        table = original(mode, chooser, *rest)
        if mode != "fast":
            return table
        rule = table.ops["gdn.delta_rule"]

        def delta_rule(*args):
            out, state = rule(*args)
            return out * (1 + 1e-3), state
        return dataclasses.replace(table, ops=table.ops | {"gdn.delta_rule": delta_rule})

    monkeypatch.setattr("hebrus.runtime.kernels", noisy)
    verdicts = [check.run() for check in _fast_checks(fast.with_mode("fast"))]
    assert not any(v.passed for v in verdicts)
    assert all("exact's own error" in v.detail for v in verdicts)


def test_the_floor_is_not_measured_when_a_float64_copy_would_not_fit(amplifying, monkeypatch):
    monkeypatch.setattr("hebrus.bound._free_memory", lambda device: 1024)
    verdicts = [check.run() for check in _fast_checks(hebrus.load(amplifying, mode="fast"))]
    failed = [v for v in verdicts if not v.passed]
    assert failed and all("not measured" in v.detail for v in failed)
