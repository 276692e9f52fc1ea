"""Shared by the checkpoint tests: file names, and rewriting a saved checkpoint as shards."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"


def shard(folder: Path, layout: dict[str, list[str]], index: dict | None = None) -> None:
    """Rewrite the single-file checkpoint as the shards `layout` ({file: tensor names}) and an index
    (by default naming each tensor's file)."""
    tensors = load_file(str(folder / WEIGHTS))
    (folder / WEIGHTS).unlink()
    for file, names in layout.items():
        save_file({name: tensors[name] for name in names}, str(folder / file))
    if index is None:
        index = {name: file for file, names in layout.items() for name in names}
    (folder / INDEX).write_text(json.dumps({"weight_map": index}))
