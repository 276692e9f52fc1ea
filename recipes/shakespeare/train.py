"""Train the `shakespeare` model (Hebrus layers) or its dense baseline on the prepared bytes.

    python recipes/shakespeare/prepare.py                                # once: data/train.bin, val.bin
    python recipes/shakespeare/train.py --model hebrus --out runs/hebrus --minutes 9
    python recipes/shakespeare/train.py --model dense --out runs/dense --tokens-from runs/hebrus/summary.json

The model is the runtime's own: `hebrus.training.forward` runs the stages a loaded model runs, on
parameters that require gradients (fast mode's ops; the delta rule chunked). The loss is the
next-byte cross-entropy, plus the sparse-attention indexer's KL to dense attention and the
routers' balance term. A run ends when its token budget is spent or its minutes are up,
whichever comes first; the learning rate warms up, then follows a cosine to a tenth of its peak
over the run's progress (the larger of the two fractions). It writes `curve.json` (every
evaluation), `summary.json`, `state.pt` (parameters and optimiser) and, for the Hebrus model, a
checkpoint `model/` in bf16 (the format `hebrus.load` reads).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from hebrus import training
from hebrus.layers.attention import AttentionSection
from hebrus.layers.mlp import MLPSection
from hebrus.layers.spec import ModelSpec
from hebrus.models.hebrus import HebrusConfig
from hebrus.weights import checkpoint

HERE = Path(__file__).parent
CONTEXT = 8192


def hebrus_config() -> HebrusConfig:
    """The shipped model: 9.39M parameters (18.8 MB in bf16), bytes in and out."""
    return HebrusConfig(
        vocab_size=256, hidden_size=256, num_layers=6, layer_types=("gdn", "gdn", "qsa", "gdn", "gdn", "qsa"),
        hc_streams=4, gdn_key_heads=2, gdn_value_heads=4, gdn_key_dim=64, gdn_value_dim=64,
        qsa_heads=4, qsa_kv_heads=2, qsa_head_dim=64, qsa_index_heads=2, qsa_index_dim=32, qsa_top_k=64,
        moe_experts=8, moe_top_k=2, moe_intermediate=160, moe_shared_intermediate=160,
        ple_dim=32, ple_buckets=(1021, 2039), max_context=8192, tie_embeddings=True, hc_sinkhorn_iters=10, init_seed=1)


def dense_spec() -> ModelSpec:
    """The baseline: single-stream residual, full (gated) attention, dense SwiGLU MLP, the same
    width, depth and parameter count (9.39M, within 0.02%)."""
    return ModelSpec(family="dense", vocab_size=256, hidden_size=256, mixers=("attention",) * 6,
                     ffns=("mlp",) * 6, max_context=8192, rms_norm_eps=1e-6, tie_embeddings=True,
                     residual="plain", hc_streams=1,
                     sections=(AttentionSection(heads=4, kv_heads=2, head_dim=64, rotary_dim=64), MLPSection(1682)))


def parameter_count(params) -> int:
    return sum(p.numel() for name, p in params.items() if p.is_floating_point())


class Batches:
    """Random windows of context+1 bytes of the training stream (seeded, resumable by step)."""

    def __init__(self, data: torch.Tensor, context: int, seed: int):
        self.data, self.context, self.seed = data, context, seed

    def window(self, step: int, micro: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + micro)
        start = int(torch.randint(0, len(self.data) - self.context - 1, (1,), generator=g))
        return self.data[start:start + self.context + 1].long()


def evaluate(spec, params, val: torch.Tensor, context: int, device) -> tuple[float, dict]:
    """Mean nats per predicted byte over the validation bytes in consecutive windows (each from
    the empty state), and each routed layer's expert load over them."""
    total, count, load = 0.0, 0, {}
    with torch.no_grad():
        for start in range(0, len(val) - 1, context):
            ids = val[start:start + context + 1].long().to(device)
            if len(ids) < 2:
                break
            out = training.losses(spec, params, ids)
            n = len(ids) - 1
            total += float(out.lm) * n
            count += n
            for site, share in out.load.items():
                load[site] = load.get(site, 0) + share * n
    return total / count, {site: (share / count).tolist() for site, share in load.items()}


def learning_rate(tokens: int, progress: float, peak: float, warmup: int) -> float:
    if tokens < warmup:
        return peak * (tokens + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("hebrus", "dense"), default="hebrus")
    p.add_argument("--data", type=Path, default=HERE / "data", help="prepared bytes (prepare.py)")
    p.add_argument("--out", type=Path, required=True, help="run folder: state, curve, summary, checkpoint")
    p.add_argument("--tokens", type=int, default=10**9, help="token budget (default: as many as the minutes allow)")
    p.add_argument("--tokens-from", type=Path, help="a finished run's summary.json: spend the tokens it spent")
    p.add_argument("--minutes", type=float, default=9.0, help="training time budget, evaluations included")
    p.add_argument("--context", type=int, default=CONTEXT, help="bytes per training sequence (at most 8192)")
    p.add_argument("--accum", type=int, default=2, help="sequences per optimiser step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=1_000_000, help="warm-up tokens")
    p.add_argument("--kl", type=float, default=0.1, help="weight of the indexer's KL term")
    p.add_argument("--balance", type=float, default=0.01, help="weight of the routers' balance term")
    p.add_argument("--eval-every", type=float, default=45.0, help="seconds between evaluations")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0, help="seeds the batch windows and the KL's sampled rows")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)                # the indexer's KL samples its query rows
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    config = hebrus_config() if args.model == "hebrus" else None
    spec = config.spec() if config else dense_spec()
    train = torch.frombuffer(bytearray((args.data / "train.bin").read_bytes()), dtype=torch.uint8)
    val = torch.frombuffer(bytearray((args.data / "val.bin").read_bytes()), dtype=torch.uint8)
    budget = args.tokens
    if args.tokens_from:
        budget = json.loads(args.tokens_from.read_text())["tokens"]

    args.out.mkdir(parents=True, exist_ok=True)
    params = training.trainable({k: v.to(device) for k, v in
                                 training.initial_parameters(config if config else spec, seed=1).items()})
    state = {"step": 0, "tokens": 0, "curve": []}
    learned = [t for t in params.values() if t.requires_grad]
    decayed = [t for t in learned if t.dim() >= 2]
    rest = [t for t in learned if t.dim() < 2]
    opt = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.99))
    batches = Batches(train, args.context, args.seed)
    n_params = parameter_count(params)
    print(f"{args.model}: {n_params:,} parameters; budget {budget:,} tokens; "
          f"{args.accum} x {args.context} bytes a step")

    limit = args.minutes * 60
    started = next_eval = time.monotonic()

    def progress() -> float:
        return max(state["tokens"] / budget, (time.monotonic() - started) / limit)

    while progress() < 1:
        lr = learning_rate(state["tokens"], progress(), args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        for micro in range(args.accum):
            ids = batches.window(state["step"], micro).to(device, non_blocking=True)
            out = training.losses(spec, params, ids, args.kl, args.balance)
            (out.loss / args.accum).backward()
        torch.nn.utils.clip_grad_norm_(learned, 1.0, error_if_nonfinite=True)
        opt.step()
        state["step"] += 1
        state["tokens"] += args.accum * args.context
        if time.monotonic() >= next_eval or progress() >= 1:
            seconds = time.monotonic() - started
            val_loss, _ = evaluate(spec, params, val, args.context, device)
            row = {"step": state["step"], "tokens": state["tokens"], "seconds": round(seconds, 1),
                   "tokens_per_s": round(state["tokens"] / seconds), "lr": lr, "train": float(out.lm),
                   "kl": float(out.kl), "balance": float(out.balance), "val": val_loss}
            state["curve"].append(row)
            print(json.dumps(row), flush=True)
            next_eval = time.monotonic() + args.eval_every
    seconds = time.monotonic() - started
    torch.save({"params": params, "optimiser": opt.state_dict(), **state}, args.out / "state.pt")
    (args.out / "curve.json").write_text(json.dumps(state["curve"], indent=0) + "\n")
    val_loss, load = evaluate(spec, params, val, args.context, device)
    summary = {"model": args.model, "parameters": n_params, "tokens": state["tokens"], "steps": state["step"],
               "train_seconds": round(seconds, 1), "device": torch.cuda.get_device_name(device)
               if device.type == "cuda" else "cpu", "context": args.context, "accum": args.accum,
               "lr": args.lr, "val_nats_per_byte": val_loss, "expert_load": load}
    if config is not None:
        folder = checkpoint.save(args.out / "model", config,
                                 {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v).cpu()
                                  for k, v in params.items()}, overwrite=True)     # the run's own output
        summary["checkpoint_bytes"] = sum(f.stat().st_size for f in folder.iterdir())
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "expert_load"}))


if __name__ == "__main__":
    main()
