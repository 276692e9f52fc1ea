"""Exact mode against a second, loop-by-loop implementation of DESIGN.md §3 (tests/spec_model.py)."""
import torch

import hebrus
from conftest import tokens
from spec_model import SpecModel


def _close(a, b, tol=1e-9):
    a, b = a.double(), b.double()
    assert (a - b).abs().max() <= tol * max(1.0, float(b.abs().max())), float((a - b).abs().max())


def test_exact_mode_matches_the_spec_token_by_token(tiny64):
    ids = tokens(14, seed=3)
    spec = SpecModel(tiny64.config, dict(tiny64.named_parameters()))
    session = tiny64.session()
    for chunk in (ids[:5], ids[5:6], ids[6:14]):
        logits = session.feed(chunk)
        for t in chunk:
            want = spec.step(t)
        _close(logits, want)
    img = session.image
    _close(img.read("residual"), spec.residual)
    for layer, kind in enumerate(tiny64.config.layer_types):
        if kind == "gdn":
            _close(img.read(f"layers.{layer}.gdn.recurrent"), spec.S[layer])
        else:
            _close(img.rows(f"layers.{layer}.qsa.k"), torch.stack(spec.K[layer]))
            _close(img.rows(f"layers.{layer}.qsa.v"), torch.stack(spec.V[layer]))
            _close(img.rows(f"layers.{layer}.qsa.index"), torch.stack(spec.KI[layer]))
    assert img.rows("routes").tolist() == spec.routes
    assert img.read("ple.history").tolist() == ids[-2:]
    _close(img.read("ple.conv"), torch.stack(spec.e_hist[-3:]))


def test_selection_really_drops_tokens(tiny64):
    """The tiny preset's top_k is smaller than the test sequences, so QSA must choose."""
    assert tiny64.config.qsa_top_k < 14
    assert "qsa" in tiny64.config.layer_types and "gdn" in tiny64.config.layer_types


def test_tied_embeddings_use_the_embedding_as_output(tiny64):
    config = tiny64.config.replace(tie_embeddings=True)
    model = hebrus.Model(config, config.init_parameters(), dtype=torch.float64)
    spec = SpecModel(config, dict(model.named_parameters()))
    ids = tokens(6, seed=5)
    logits = model.session().feed(ids)
    for t in ids:
        want = spec.step(t)
    _close(logits, want)
