"""Tiny random checkpoints of the foreign families, made with transformers (a test-only
dependency) and saved with `save_pretrained`, and the reference run they are compared with."""
from __future__ import annotations

import contextlib
import copy
import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

# Odd shapes on purpose: value heads a multiple (not equal) of key heads, key dim != value dim,
# head_dim with a partial rotary of 1/4, several layer patterns.
_COMMON = dict(vocab_size=101, hidden_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
               linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=256)
_MOE = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=20)
NORM_SPREAD = 0.3
LINEAR, FULL = "linear_attention", "full_attention"
# Kimi-Linear: latent attention with nope != value dims and a rope part, grouped sigmoid routing
_KIMI = dict(vocab_size=101, hidden_size=40, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12,
             q_lora_rank=None, qk_rope_head_dim=6, qk_nope_head_dim=10, v_head_dim=14, linear_head_dim=8,
             linear_num_heads=3, linear_conv_kernel_dim=4, num_local_experts=6, num_experts_per_tok=2,
             moe_intermediate_size=24, intermediate_size=56, n_shared_experts=1, n_group=2, topk_group=1,
             routed_scaling_factor=2.446, max_position_embeddings=256, pad_token_id=None, bos_token_id=None,
             eos_token_id=None)

# DeepSeek-V4: each attention type (windows of 5, entries every 4 and 3 positions: the prompt
# crosses them), hash-routed then √softplus-routed experts clipped, two residual streams
_V4 = dict(vocab_size=101, hidden_size=40, num_attention_heads=4, head_dim=16, partial_rotary_factor=0.25,
           q_lora_rank=12, o_groups=2, o_lora_rank=10, sliding_window=5, index_n_heads=16, index_head_dim=8,
           index_topk=2, compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 4},
           n_routed_experts=5, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
           routed_scaling_factor=1.5, swiglu_limit=2.0, hc_mult=2, hc_sinkhorn_iters=7,
           max_position_embeddings=256, num_nextn_predict_layers=0, pad_token_id=None, bos_token_id=None,
           eos_token_id=None)
FAMILIES = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(_COMMON, intermediate_size=56, num_hidden_layers=5,
                     layer_types=[LINEAR, FULL, LINEAR, LINEAR, FULL])),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(_COMMON, **_MOE, num_hidden_layers=4, linear_num_key_heads=1, linear_num_value_heads=3,
                         linear_key_head_dim=6, linear_value_head_dim=10, layer_types=[FULL, LINEAR, LINEAR, FULL])),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(_COMMON, **_MOE, intermediate_size=56, num_hidden_layers=4, mlp_only_layers=[2],
                        norm_topk_prob=False, layer_types=[LINEAR, LINEAR, FULL, LINEAR])),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    dict(_KIMI, num_hidden_layers=5, layer_types=[LINEAR, FULL, LINEAR, LINEAR, FULL],
                         mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"])),
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM",
                    dict(_V4, num_hidden_layers=4, mlp_layer_types=["hash_moe", "moe", "moe", "hash_moe"],
                         layer_types=["sliding_attention", "heavily_compressed_attention",
                                      "compressed_sparse_attention", "compressed_sparse_attention"])),
}


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn so each part matters: norms away from their identity, decays in
    range, projections at 1/sqrt(fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    plain = model.config.model_type in ("kimi_linear", "deepseek_v4")     # their norms store w, not w - 1
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):       # shifts which experts are chosen
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
            elif name.endswith("tid2eid"):                      # each token's experts, distinct
                b.copy_(torch.rand(b.shape[0], model.config.n_routed_experts, generator=gen).argsort(-1)[:, :b.shape[1]])
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_((1 + 7 * torch.rand(p.shape, generator=gen)).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                centre = 1.0 if plain or name.endswith("linear_attn.norm.weight") else 0.0    # w, not 1 + w
                p.copy_(torch.randn(p.shape, generator=gen) * NORM_SPREAD + centre)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def build(family: str, folder: Path, seed: int = 0, **overrides):
    """(the folder with config.json + model.safetensors, the transformers model in float32)."""
    config_name, model_name, kwargs = FAMILIES[family]
    config = getattr(transformers, config_name)(**dict(kwargs, **overrides))
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    randomise(model, seed)
    model.save_pretrained(folder)
    return folder, model


def as_multimodal(folder: Path, model_type: str) -> None:
    """Rewrite a text-only save as the multimodal checkpoints are laid out: the text config nested
    in `text_config`, tensors under `model.language_model.`, and a vision tower beside them."""
    from safetensors.torch import load_file, save_file
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "text_config": config,
                                                    "vision_config": {"depth": 1},
                                                    "tie_word_embeddings": config["tie_word_embeddings"]}))
    tensors = load_file(folder / "model.safetensors")
    moved = {("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
             for k, v in tensors.items()}
    moved["model.visual.patch_embed.proj.weight"] = torch.zeros(3, 2)
    save_file(moved, folder / "model.safetensors")


@contextlib.contextmanager
def float64_everywhere():
    """transformers computes norms, rotary angles, the delta rule and softmaxes in float32 even
    in a float64 model (`.float()`, `.to(torch.float32)`, `softmax(dtype=torch.float32)`, as a function or a method,
    `arange(dtype=torch.float32)`);
    inside this context those casts go to float64, so a float64 model is float64 throughout."""
    import torch.nn.functional as F

    def wide(dtype):
        return torch.float64 if dtype == torch.float32 else dtype

    orig_to, orig_float, orig_softmax, orig_type = torch.Tensor.to, torch.Tensor.float, F.softmax, torch.Tensor.type
    orig_method, orig_arange = torch.Tensor.softmax, torch.arange

    def to(self, *args, **kwargs):
        args = tuple(wide(a) if isinstance(a, torch.dtype) else a for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = wide(kwargs["dtype"])
        return orig_to(self, *args, **kwargs)

    def softmax(x, *args, **kwargs):
        if "dtype" in kwargs:
            kwargs["dtype"] = wide(kwargs["dtype"])
        return orig_softmax(x, *args, **kwargs)

    def softmax_method(self, *args, **kwargs):
        if "dtype" in kwargs:
            kwargs["dtype"] = wide(kwargs["dtype"])
        return orig_method(self, *args, **kwargs)

    def arange(*args, **kwargs):
        if "dtype" in kwargs:
            kwargs["dtype"] = wide(kwargs["dtype"])
        return orig_arange(*args, **kwargs)

    def type_(self, dtype=None, *args, **kwargs):
        return orig_type(self, *args, **kwargs) if dtype is None else orig_type(self, wide(dtype), *args, **kwargs)

    torch.Tensor.to, torch.Tensor.float, F.softmax = to, lambda self, *a, **k: self.double(), softmax
    torch.Tensor.type, torch.Tensor.softmax, torch.arange = type_, softmax_method, arange
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, F.softmax = orig_to, orig_float, orig_softmax
        torch.Tensor.type, torch.Tensor.softmax, torch.arange = orig_type, orig_method, orig_arange


def in_float64(model):
    """A float64 copy of a transformers model whose rotary frequencies are float64 too (they are
    computed in float32 at construction) and whose experts run in the plain loop (the grouped
    matmul takes no float64)."""
    wide = copy.deepcopy(model).double()
    if hasattr(wide, "set_experts_implementation") and (getattr(wide.config, "num_experts", 0)
                                                        or getattr(wide.config, "n_routed_experts", 0)):
        wide.set_experts_implementation("eager")
    if wide.config.model_type == "deepseek_v4":        # two rotations, one table each, in every rotary module
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        for module in wide.modules():
            if hasattr(module, "main_inv_freq"):
                for label, params in wide.config.rope_parameters.items():
                    dim = 2 * getattr(module, f"{label}_inv_freq").numel()
                    if params.get("rope_type", "default") == "default":
                        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
                    else:                               # its own init, computed in float64
                        with float64_everywhere():
                            inv_freq = ROPE_INIT_FUNCTIONS[params["rope_type"]](wide.config, None, layer_type=label)[0]
                    setattr(module, f"{label}_inv_freq", inv_freq)
        return wide
    rotary = getattr(wide.model, "rotary_emb", None)
    if rotary is None:                                  # a family without rotary (Kimi-Linear)
        return wide
    dim = 2 * rotary.inv_freq.numel()
    rotary.inv_freq = 1.0 / (wide.config.rope_parameters["rope_theta"]
                             ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return wide


def reference_run(model, ids: list[int], steps: int):
    """transformers' logits at every prompt position, its cache after the prompt, and `steps`
    greedy tokens with the logits that chose each."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        prompt_logits, cache = out.logits[0], out.cache
        states = {}
        kimi = model.config.model_type == "kimi_linear"
        for layer, kind in enumerate(model.config.layer_types):
            if model.config.model_type == "deepseek_v4":     # its rows and entries: tests/test_v4_kinds.py
                break
            if kind == LINEAR:
                mixer = "kda" if kimi else "gdn"
                states[f"layers.{layer}.{mixer}.conv"] = cache.get_conv_state(layer)[0].clone()
                states[f"layers.{layer}.{mixer}.recurrent"] = cache.get_recurrent_state(layer)[0].clone()
            elif kimi:                          # the latent row: normed c, then the shared key part
                keys, values = cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]
                states[f"layers.{layer}.mla.latent"] = torch.cat([keys, values], -1).clone()
            else:
                states[f"layers.{layer}.attention.k"] = cache.layers[layer].keys[0].transpose(0, 1).clone()
                states[f"layers.{layer}.attention.v"] = cache.layers[layer].values[0].transpose(0, 1).clone()
        tokens, step_logits = [], []
        logits = prompt_logits[-1]
        for _ in range(steps):
            token = int(torch.argmax(logits))
            tokens.append(token)
            step_logits.append(logits)
            logits = model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
    return prompt_logits, states, tokens, step_logits


def v4_cache_pairs(folder, model, ids: list[int]):
    """A DeepSeek-V4 checkpoint (`build("deepseek_v4", ...)`, loaded from `folder` in float64)
    fed `ids` -> (quantity, hebrus's value, transformers' float64 cache's) for every owner the
    cache has a value for: each layer's last window - 1 rows (the cache keeps those), the
    compressed entries and the indexer's keys (every `rate`-th row of the logs), the tokens of
    the open window (their projections, and the gates less their slot's bias, which the cache's
    lack) and CSA's previous window's first series. The prompt must end inside every window."""
    import hebrus
    with torch.no_grad(), float64_everywhere():
        cache = in_float64(model)(torch.tensor([ids]), use_cache=True).cache
    loaded = hebrus.load(folder, dtype=torch.float64)
    params, ours = dict(loaded.named_parameters()), loaded.session()
    ours.feed(ids)
    config = model.config
    for layer, kind in enumerate(config.layer_types):
        mixer = {"sliding_attention": "swa", "heavily_compressed_attention": "hca",
                 "compressed_sparse_attention": "csa"}[kind]
        p, theirs = f"layers.{layer}.{mixer}.", cache.layers[layer]
        window = theirs.keys[0, 0]
        yield f"{mixer}.rows (window)", ours.image.value(p + "rows")[-window.shape[0]:], window
        if mixer == "swa":
            continue
        m = config.compress_rates[kind]
        series = (("compressor", "", "entries", "compressor."),) + ((("indexer", "index_", "keys", "indexer."),)
                                                                     if mixer == "csa" else ())
        for name, state, log, weights in series:
            yield f"{mixer}.{log}", ours.image.value(p + log)[m - 1::m], theirs.compressed_kv[name][0]
            open_kv, open_gate = theirs.buffer_kv[name][0], theirs.buffer_gate[name][0]
            k = open_kv.shape[0]
            assert k == len(ids) % m and k > 0, "the prompt must end inside every window"
            yield f"{mixer}.{state}window_kv", ours.image.value(p + state + "window_kv")[:k], open_kv
            yield (f"{mixer}.{state}window_gate", ours.image.value(p + state + "window_gate")[:k]
                   - params[p + weights + "bias"][:k], open_gate)
            if mixer == "csa":
                d = theirs.overlap_kv[name].shape[-1]
                yield f"{mixer}.{state}previous_kv", ours.image.value(p + state + "previous_kv")[:, :d], \
                    theirs.overlap_kv[name][0]
