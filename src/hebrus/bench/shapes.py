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
    # Kimi-Linear's widths (Kimi-Linear-48B-A3B's heads, latent and expert sizes) in 16 layers, three
    # delta-rule layers to one latent-attention layer, 6 experts: 2.14B parameters (4.3 GB in bfloat16)
    "kimi-linear-2b": {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 16,
        "linear_attn_config": {"kda_layers": [i for i in range(1, 17) if i % 4], "full_attn_layers": [4, 8, 12, 16],
                               "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
        "num_attention_heads": 32, "num_key_value_heads": 32, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
        "intermediate_size": 9216, "first_k_dense_replace": 1, "moe_intermediate_size": 1024,
        "num_experts": 6, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_renormalize": True,
        "num_expert_group": 1, "topk_group": 1, "routed_scaling_factor": 2.446, "moe_router_activation_func": "sigmoid",
        "model_max_length": 65536, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    },
    # DeepSeek-V4's layer pattern (two HCA layers, then CSA and HCA in turn; the first three
    # hash-routed) and its head, window, compress rates and indexer at a narrower width: 16
    # layers of 2048, 16 experts of 1280 (4 a token) and a shared one, four residual streams
    "deepseek-v4-3b": {
        "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 2048, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
        "q_lora_rank": 512, "o_groups": 4, "o_lora_rank": 512, "sliding_window": 128,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 16,
        "num_experts_per_tok": 4, "n_shared_experts": 1, "moe_intermediate_size": 1280, "num_hash_layers": 3,
        "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    },
}


def random_checkpoint(shape: str, folder: Path, seed: int = 0) -> Path:
    """A checkpoint of the named shape with random weights, written in its family's own file
    layout (so loading it goes through the importer); kept and reused if already there."""
    from safetensors.torch import save_file

    from hebrus.models import family_of
    from hebrus.models.qwen import plus_one
    if shape not in SHAPES:
        raise InvalidInput(f"unknown shape {shape!r}; shapes are: {', '.join(SHAPES)}")
    folder = Path(folder)
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    data = SHAPES[shape]
    family = family_of(data)
    spec = family.spec(family.config(data))
    table = family.names(spec, set())
    stored_less_one = {name for source in table.sources.values() if source.build is plus_one for name in source.names}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, dims in table.shapes.items():
        if name.endswith("tid2eid"):            # each token's experts: distinct, at random
            experts = data["n_routed_experts"]
            tensors[name] = torch.rand(dims[0], experts, generator=gen).argsort(-1)[:, :dims[1]].contiguous()
            continue
        if name.endswith("A_log"):
            tensor = (1 + 15 * torch.rand(dims, generator=gen)).log()
        elif "norm" in name:               # each norm the identity, as its family stores it (w or w - 1)
            tensor = torch.zeros(dims) if name in stored_less_one else torch.ones(dims)
        else:
            tensor = torch.randn(dims, generator=gen) / math.sqrt(dims[-1])
        tensors[name] = tensor.to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    return folder
