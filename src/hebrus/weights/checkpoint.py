"""Save and load Hebrus checkpoints: `config.json` + `model.safetensors` (or shards listed in
`model.safetensors.index.json`)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hebrus.config import HebrusConfig
from hebrus.weights.layout import parameter_shapes

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def save(path: str | Path, config: HebrusConfig, params: dict[str, torch.Tensor]) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    tensors = {name: t.detach().contiguous().cpu() for name, t in params.items()}
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "hebrus"})
    return path


def read_config(path: str | Path) -> HebrusConfig:
    file = Path(path) / CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a Hebrus checkpoint: {CONFIG} is missing")
    return HebrusConfig.from_dict(json.loads(file.read_text()))


def load(path: str | Path) -> tuple[HebrusConfig, dict[str, torch.Tensor]]:
    """Read and check a checkpoint; tensors come back as stored, on the CPU."""
    path = Path(path)
    config = read_config(path)
    params: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                params[name] = f.get_tensor(name)
    _check(config, params, path)
    return config, params


def _weight_files(path: Path) -> list[Path]:
    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / WEIGHTS).is_file():
        return [path / WEIGHTS]
    raise FileNotFoundError(f"{path} has neither {WEIGHTS} nor {INDEX}")


def _check(config: HebrusConfig, params: dict[str, torch.Tensor], path: Path) -> None:
    expected = parameter_shapes(config)
    missing = sorted(expected.keys() - params.keys())
    unexpected = sorted(params.keys() - expected.keys())
    wrong = [f"{n}: {tuple(params[n].shape)} (expected {expected[n]})"
             for n in sorted(expected.keys() & params.keys()) if tuple(params[n].shape) != expected[n]]
    problems = []
    if missing:
        problems.append("missing tensors: " + ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""))
    if unexpected:
        problems.append("unexpected tensors: " + ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else ""))
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong[:8]))
    if problems:
        raise ValueError(f"checkpoint {path} does not match its config: " + " | ".join(problems))
