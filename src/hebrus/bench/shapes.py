"""Random-weight checkpoints of named shapes, written in their family's own file layout so that
loading them goes through the importer."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from hebrus.errors import InvalidInput

# A Qwen3.5-shaped model of 1.68B parameters (3.37 GB in bfloat16), made with random weights and
# loaded through the importer: the shape the speed targets are stated for.
SHAPES = {
    "qwen3.5-1.7b": {
        "model_type": "qwen3_5_text", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 24,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6,
        "intermediate_size": 6144, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": True,
        "max_position_embeddings": 65536, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    },
}


def random_checkpoint(shape: str, folder: Path, seed: int = 0) -> Path:
    """A checkpoint of the named shape with random weights, written in its family's own file
    layout (so loading it goes through the importer); kept and reused if already there."""
    from safetensors.torch import save_file

    from hebrus.models import family_of
    if shape not in SHAPES:
        raise InvalidInput(f"unknown shape {shape!r}; shapes are: {', '.join(SHAPES)}")
    folder = Path(folder)
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    data = SHAPES[shape]
    family = family_of(data)
    spec = family.spec(family.config(data))
    table = family.names(spec, set())
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, dims in table.shapes.items():
        if name.endswith("A_log"):
            tensor = (1 + 15 * torch.rand(dims, generator=gen)).log()
        elif "norm" in name:
            tensor = torch.zeros(dims) if "linear_attn.norm" not in name else torch.ones(dims)
        else:
            tensor = torch.randn(dims, generator=gen) / math.sqrt(dims[-1])
        tensors[name] = tensor.to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    return folder
