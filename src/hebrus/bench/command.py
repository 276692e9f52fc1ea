"""`hebrus bench`: its command line and what each kind of run does (the measurements themselves
are `hebrus.bench`'s modules)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from hebrus.arguments import gather_seconds
from hebrus.bench import SHAPES
from hebrus.engine.graphs import DECODE
from hebrus.errors import InvalidInput
from hebrus.runtime import DTYPES, MODES, load
from hebrus.scheduling.scheduler import CHUNK_SIZE, PREFILL_SHARE
from hebrus.text import MODEL


def add_parser(sub, model_help: str, load_model) -> None:
    """The `bench` subcommand; `load_model(args)` loads --model as the other commands do."""
    bench = sub.add_parser("bench", help="prefill and decode speed against in-place writes and the device's limits",
                           description="At each context: prefill, then decode, with transactional sessions and "
                                       "an in-place variant taking turns; beside them the device's copy bandwidth "
                                       "(the decode floor) and matrix throughput (the prefill roofline). Prints a "
                                       "table; --json and --table write it.")
    bench.add_argument("--model", default=MODEL,
                       help=f"{model_help}, or a random-weight shape ({', '.join(SHAPES)}) written under --cache "
                            f"(default: {MODEL})")
    bench.add_argument("--mode", choices=MODES, default="fast", help="execution mode (default fast)")
    bench.add_argument("--device", default=None, help="torch device (default: cuda if there is one, else cpu)")
    bench.add_argument("--dtype", choices=list(DTYPES), default=None,
                       help="compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    bench.add_argument("--threads", type=int, default=None, metavar="N",
                       help="CPU threads (default: torch's, one per core this process may use; unlike the other "
                            "commands, the load average does not lower it, so runs compare)")
    bench.add_argument("--contexts", default=None,
                       help="comma-separated prompt lengths; those that leave no room for the decode steps "
                            "within the model's max_context are skipped (default 1024,32768; with --long "
                            "1024,8192,32768,131072)")
    bench.add_argument("--long", action="store_true",
                       help="instead of --model: the small shape (or --long-shape) with a 132K context limit, "
                            "its sparse (QSA) attention against the same model with dense attention over every "
                            "row; prints both tables and their comparison (decode against the shortest context, "
                            "dense over sparse beside the ratio of their byte floors)")
    bench.add_argument("--long-shape", default=None, choices=["small", "wide"],
                       help="--long's shape: small (the preset's, the default) or wide (K/V rows four times "
                            "as wide: 8 K/V heads of 64, so dense attention reads far more than the indexer)")
    bench.add_argument("--ple-pages", action="store_true",
                       help="instead of --model: the small shape with --ple-gib of n-gram tables (a sparse "
                            "checkpoint under --cache), decoding an English stream with the tables paged "
                            "through --ple-cache-mib against the same tables resident (both eager)")
    bench.add_argument("--quant", action="store_true",
                       help="quantized weights: the trained shakespeare model's validation loss in each of "
                            "--formats against float (from --val), and --model's decode speed and next-token "
                            "KL divergence in each format against float")
    bench.add_argument("--spec", action="store_true",
                       help="speculative decoding: --model's greedy tokens/s on a repetitive prompt, plain "
                            "against prompt lookup (and --draft), with the drafts kept and whether the output "
                            "equals plain decoding's; then a fork's cost at each of --contexts")
    bench.add_argument("--constrained", action="store_true",
                       help="structured output: --model decoding --decode-steps greedy steps under a JSON schema "
                            "against the same steps free, at each of --batch sessions stepping together")
    bench.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                       help="--model split over N ranks (a process each) against the same model in this process: "
                            "prefill tokens/s at each of --contexts and decode ms/step, both eager, side by side")
    bench.add_argument("--serve", action="store_true",
                       help="the HTTP server (hebrus serve, in this process, over loopback) at each of "
                            "--clients concurrent streaming requests against the same engine decoding offline: "
                            "requests/s, output tokens/s, time to first token, inter-token latency")
    bench.add_argument("--workload", default="uniform", choices=["uniform", "shared", "long", "chat", "mixed"],
                       help="--serve's workload: uniform (every request --serve-prompt tokens, against offline; "
                            "the default), shared (clients sharing a --system-token system prompt, the prefix "
                            "cache on against off), long (a --system-token prompt arriving while --clients decode: their "
                            "ITL before and during), chat (4-turn conversations as text, each turn the text so far and "
                            "--own more characters; opening --serve-prompt), mixed (lognormal prompt and output lengths, cache on and off)")
    bench.add_argument("--system", type=int, default=2000,
                       help="shared system-prompt tokens for --workload shared, the long prompt's for long (default 2000)")
    bench.add_argument("--own", type=int, default=64,
                       help="each client's own prompt tokens for --workload shared (default 64)")
    bench.add_argument("--clients", default="1,16,64", help="concurrencies for --serve (default 1,16,64; "
                                                            "shared and mixed take the largest)")
    bench.add_argument("--requests", type=int, default=64, help="requests per concurrency for --serve (default 64)")
    bench.add_argument("--serve-prompt", type=int, default=128, help="prompt tokens per --serve request (default 128)")
    bench.add_argument("--serve-tokens", type=int, default=64, help="new tokens per --serve request (default 64)")
    bench.add_argument("--serve-temperature", type=float, default=0.0, metavar="T",
                       help="--serve's uniform workload samples at temperature T, each request from its own "
                            "seed (default 0: greedy)")
    bench.add_argument("--serve-passes", choices=("auto", "one", "two", "paced"), default="auto",
                       help="the server's --passes: a turn's prompt chunks and decode steps in one pass or two, "
                            "or a pass of chunks a few stages a turn (paced; default auto: two where the steps "
                            "replay CUDA graphs, else one)")
    bench.add_argument("--serve-gather-ms", type=float, default=None, metavar="MS",
                       help="the server's --gather-ms: an idle engine waits for more of a burst of requests "
                            "while they arrive less than MS apart (default: the server's)")
    bench.add_argument("--serve-prefix-every", type=int, default=None, metavar="K",
                       help="the server's --prefix-every: its prefix cache keeps a state every K tokens of a "
                            "prompt, in the workloads that run with the cache on (default: the server's)")
    bench.add_argument("--serve-prefill-share", type=float, default=PREFILL_SHARE, metavar="STEPS",
                       help="the server's --prefill-share: while requests decode, a turn takes at most the time "
                            "of 1 + this many decode steps alone (default %(default)s)")
    bench.add_argument("--serve-prefill-chunk", type=int, default=CHUNK_SIZE, metavar="N",
                       help="the server's --prefill-chunk: one request's prompt tokens a turn at most "
                            "(default %(default)s)")
    bench.add_argument("--serve-prefill-tokens", type=int, default=None, metavar="N",
                       help="the server's --prefill-tokens: prompt tokens a turn feeds at most (default: the "
                            "server's, the model's prefill chunk)")
    bench.add_argument("--spec-tokens", type=int, default=256, help="tokens generated per --spec round (default 256)")
    bench.add_argument("--draft-tokens", type=int, default=8, help="tokens drafted per chunk for --spec (default 8)")
    bench.add_argument("--draft", default=None,
                       help="a draft model for --spec, named as --model is (its vocabulary must be --model's)")
    bench.add_argument("--draft-quantize", default=None,
                       help="quantize --draft as it loads (int8, int4, int4-zp, fp8)")
    bench.add_argument("--formats", default="int8,int4,int4-zp,fp8", help="formats for --quant (default all)")
    bench.add_argument("--val", default="recipes/shakespeare/data/val.bin",
                       help="validation bytes for --quant (default: the recipe's, from its prepare.py)")
    bench.add_argument("--val-context", type=int, default=8192, help="validation window for --quant (default 8192)")
    bench.add_argument("--val-bytes", type=int, default=0, help="use only the first N validation bytes (default all)")
    bench.add_argument("--ple-gib", type=float, default=8.0, help="PLE table size for --ple-pages (default 8)")
    bench.add_argument("--ple-cache-mib", type=float, default=512.0,
                       help="page cache for --ple-pages, MiB (default 512)")
    bench.add_argument("--batch", default="1",
                       help="comma-separated numbers of sessions decoding together (hebrus.Batch, stepped "
                            "as --decode says; prefill is not batched and not reported above 1) (default 1)")
    bench.add_argument("--decode-steps", type=int, default=32, help="decode steps per round (default 32)")
    bench.add_argument("--rounds", type=int, default=3,
                       help="timed rounds after one untimed warm-up round at each context; medians are reported "
                            "(default 3)")
    bench.add_argument("--chunk", type=int, default=None,
                       help="prefill chunk length of the speed points (default: the model's prefill_chunk)")
    bench.add_argument("--decode", choices=DECODE, default="auto",
                       help="how one-token steps run: auto (CUDA graphs for fast mode on a GPU, else eager), "
                            "eager, planned (the graphs' static plan, uncaptured) or graph (default auto); the "
                            "in-place variant is captured too when graphs are")
    bench.add_argument("--compare-transformers", action="store_true",
                       help="also time transformers on the same checkpoint and device (a checkpoint directory "
                            "or shape transformers can read; it must be installed)")
    bench.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    bench.add_argument("--table", metavar="FILE", help="also write the table as Markdown")
    bench.add_argument("--cache", default=str(Path.home() / ".cache" / "hebrus" / "shapes"),
                       help="where random-weight shapes are written and reused (default ~/.cache/hebrus/shapes)")
    bench.set_defaults(handler=lambda args: run(args, load_model))


MAX_BATCH = 1024


def run(args, load_model) -> int:
    import torch

    from hebrus import bench
    from hebrus.progress import ProgressBar
    for name in ("decode_steps", "rounds", "chunk", "spec_tokens", "draft_tokens", "requests", "serve_prompt",
                 "serve_tokens", "system", "own"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise InvalidInput(f"--{name.replace('_', '-')} must be at least 1")
    try:
        batches = tuple(int(b) for b in args.batch.split(","))
    except ValueError:
        raise InvalidInput(f"--batch must be comma-separated integers, got {args.batch!r}") from None
    if not batches or min(batches) < 1 or max(batches) > MAX_BATCH:
        raise InvalidInput(f"--batch takes sizes from 1 to {MAX_BATCH}")
    if args.threads is not None:
        if args.threads < 1:
            raise InvalidInput(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.contexts is None:
        args.contexts = "1024,8192,32768,131072" if args.long else "1024,32768"
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        raise InvalidInput(f"--contexts must be comma-separated integers, got {args.contexts!r}") from None
    if not contexts or min(contexts) < 1:
        raise InvalidInput("--contexts needs positive lengths")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.long_shape and not args.long:
        raise InvalidInput("--long-shape goes with --long")
    if args.long:
        return _long(args, contexts, batches)
    if args.ple_pages:
        return _pages(args)
    if args.quant:
        from hebrus.bench import quant

        def load_as(name, quantize):
            if name in bench.SHAPES:
                name = str(bench.random_checkpoint(name, Path(args.cache) / name))
            return load(name, device=args.device, dtype=args.dtype, mode=args.mode, quantize=quantize)
        return quant.command(args, contexts, batches, load_as)
    if args.model in bench.SHAPES:
        args.model = str(bench.random_checkpoint(args.model, Path(args.cache) / args.model))
    if args.tensor_parallel is not None:
        return _parallel(args, contexts)
    if args.spec:
        return _spec(args, contexts, load_model)
    if args.serve:
        return _serve(args, load_model)
    if args.constrained:
        return _constrained(args, batches, load_model)
    model = load_model(args)
    model.session(decode=args.decode)                    # refuses a decode the model cannot run
    if args.compare_transformers and model.source is None:
        raise InvalidInput("--compare-transformers needs a checkpoint directory or a shape, not a preset")
    room = model.spec.max_context - args.decode_steps                  # the decode steps come after
    kept = [c for c in contexts if c <= room]
    for c in sorted(set(contexts) - set(kept)):
        print(f"(context {c} skipped: with {args.decode_steps} decode steps it passes the model's max_context "
              f"{model.spec.max_context})", file=sys.stderr)
    if not kept:
        raise InvalidInput(f"no context leaves room for {args.decode_steps} decode steps within the model's "
                           f"max_context {model.spec.max_context}")
    compare = model.source if args.compare_transformers else None

    def write(report: dict) -> None:                    # after every context: a cut-off run keeps its points
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        if args.table:
            Path(args.table).write_text(bench.table(report))

    report = bench.run(model, Path(args.model).name, kept, args.decode_steps, args.rounds, args.chunk,
                       ProgressBar("bench", unit="point"), decode=args.decode, compare=compare, on_point=write,
                       batches=batches)
    write(report)                                       # the final report, as printed (its date too)
    print(bench.table(report), end="")
    return 0


def _spec(args, contexts: list[int], load_model) -> int:
    from hebrus import bench
    from hebrus.bench import spec
    from hebrus.progress import ProgressBar

    model = load_model(args)
    drafters = {"lookup": "lookup"}
    if args.draft is not None:
        name = args.draft
        if name in bench.SHAPES:
            name = str(bench.random_checkpoint(name, Path(args.cache) / name))
        draft = load(name, device=args.device, dtype=args.dtype, mode=args.mode, quantize=args.draft_quantize)
        label = Path(args.draft).name + (f" ({args.draft_quantize})" if args.draft_quantize else "")
        drafters[f"draft model {label}"] = draft
    prompt = spec.workload(model)
    if len(prompt) + args.spec_tokens + args.draft_tokens > model.spec.max_context:
        raise InvalidInput(f"the {len(prompt)}-token prompt and --spec-tokens {args.spec_tokens} pass the model's "
                           f"max_context {model.spec.max_context}")
    kept = [c for c in contexts if c + 2 <= model.spec.max_context]
    for c in sorted(set(contexts) - set(kept)):
        print(f"(fork at context {c} skipped: past the model's max_context {model.spec.max_context})", file=sys.stderr)
    report = {"model": Path(args.model).name, "device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."),
              "mode": model.mode, "prompt_tokens": len(prompt), "new": args.spec_tokens,
              "draft_tokens": args.draft_tokens, "rounds": args.rounds,
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "commit": bench._commit()}
    bar = ProgressBar("bench --spec", unit="run")
    report["decode"] = spec.decode_point(model, prompt, args.spec_tokens, args.rounds, drafters, args.draft_tokens,
                                         progress=bar)
    report["fork"] = spec.fork_points(model, kept)
    if len(report["fork"]) > 1:
        report["fork_ratio"] = report["fork"][-1]["fork_ms"] / report["fork"][0]["fork_ms"]
    return _written(args, report, spec.table(report))


def _serve(args, load_model) -> int:
    from hebrus import bench
    from hebrus.bench import serve
    try:
        clients = [int(c) for c in args.clients.split(",")]
    except ValueError:
        raise InvalidInput(f"--clients must be comma-separated integers, got {args.clients!r}") from None
    if not clients or min(clients) < 1 or max(clients) > MAX_BATCH:
        raise InvalidInput(f"--clients takes concurrencies from 1 to {MAX_BATCH}")
    if not 0.0 <= args.serve_temperature <= 100.0:
        raise InvalidInput(f"--serve-temperature must be a number from 0 to 100, got {args.serve_temperature}")
    if not args.serve_prefill_share > 0:
        raise InvalidInput(f"--serve-prefill-share must be a positive number of decode steps, "
                           f"got {args.serve_prefill_share}")
    if args.serve_prefill_chunk < 1:
        raise InvalidInput(f"--serve-prefill-chunk must be at least 1, got {args.serve_prefill_chunk}")
    if args.serve_prefix_every is not None and args.serve_prefix_every < 1:
        raise InvalidInput(f"--serve-prefix-every must be at least 1, got {args.serve_prefix_every}")
    if args.serve_prefill_tokens is not None and args.serve_prefill_tokens < 1:
        raise InvalidInput(f"--serve-prefill-tokens must be at least 1, got {args.serve_prefill_tokens}")
    gather = None if args.serve_gather_ms is None else gather_seconds(args.serve_gather_ms, "--serve-gather-ms")
    if args.serve_temperature and args.workload != "uniform":
        raise InvalidInput("--serve-temperature applies to the uniform workload only")
    model = load_model(args)
    limit, name = model.spec.max_context, Path(args.model).name
    engine = {"passes": args.serve_passes, "prefill_share": args.serve_prefill_share,
              "prefill_tokens": args.serve_prefill_tokens, "prefill_chunk": args.serve_prefill_chunk,
              "gather": gather, "prefix_every": args.serve_prefix_every}
    if args.workload == "shared":
        if args.system + args.own + args.serve_tokens > limit:
            raise InvalidInput(f"--system, --own and --serve-tokens pass the model's max_context {limit}")
        from hebrus.bench import workloads
        report = workloads.shared(model, name, max(clients), args.system, args.own, args.serve_tokens, engine=engine)
    elif args.workload == "long":
        if args.system + 1 > limit or 16 + args.serve_tokens > limit:
            raise InvalidInput(f"--system (the long prompt) or --serve-tokens pass the model's max_context {limit}")
        from hebrus.bench import workloads
        report = workloads.long_prompt(model, name, max(clients), args.system, args.serve_tokens, engine=engine)
    elif args.workload == "chat":
        if 4 * (args.own + args.serve_tokens) + args.serve_prompt > limit:
            raise InvalidInput(f"4 turns of --own and --serve-tokens after --serve-prompt pass the model's "
                               f"max_context {limit}")
        from hebrus.bench import workloads
        report = workloads.chats(model, name, max(clients), args.serve_prompt, args.own, args.serve_tokens,
                                 engine=engine)
    elif args.workload == "mixed":
        from hebrus.bench import workloads
        report = workloads.mixed(model, name, max(clients), args.requests, args.serve_prompt, args.serve_tokens,
                                 engine=engine)
    else:
        if args.serve_prompt + args.serve_tokens > limit:
            raise InvalidInput(f"--serve-prompt and --serve-tokens pass the model's max_context {limit}")
        report = serve.run(model, name, clients, args.requests, args.serve_prompt, args.serve_tokens,
                           args.serve_temperature, engine)
    report.update(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), commit=bench._commit())
    if args.workload == "uniform":
        return _written(args, report, serve.table(report))
    from hebrus.bench import workloads
    return _written(args, report, workloads.table(report))


def _pages(args) -> int:
    from hebrus import bench
    from hebrus.bench import pages
    from hebrus.runtime import resolve_device, resolve_dtype

    if args.model != MODEL or args.compare_transformers or args.long:
        raise InvalidInput("--ple-pages builds its own model: leave out --model, --long and --compare-transformers")
    if not (0 < args.ple_gib <= 256 and 0 <= args.ple_cache_mib <= 2**20):
        raise InvalidInput("--ple-gib must lie in (0, 256] and --ple-cache-mib in [0, 1048576]")
    config = pages.paged_config(args.ple_gib * 2**30)
    folder = pages.sparse_checkpoint(Path(args.cache) / f"ple-pages-{args.ple_gib:g}gib", config)
    report = pages.run(folder, resolve_device(args.device), resolve_dtype(args.dtype),
                       int(args.ple_cache_mib * 2**20),
                       prompt=1024, steps=args.decode_steps, rounds=args.rounds)
    report.update(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), commit=bench._commit())
    return _written(args, report, pages.table(report))


def _constrained(args, batches: tuple[int, ...], load_model) -> int:
    from hebrus.bench import constrained
    from hebrus.progress import ProgressBar

    model = load_model(args)
    report = {"model": Path(args.model).name, "device": str(model.device), "mode": args.mode,
              "points": constrained.points(model, batches, args.decode_steps, args.rounds,
                                           ProgressBar("bench --constrained", unit="run"))}
    return _written(args, report, constrained.table(report))


def _parallel(args, contexts: list[int]) -> int:
    from hebrus import bench
    from hebrus.bench import parallel
    from hebrus.progress import ProgressBar
    options = dict(device=args.device, dtype=args.dtype, mode=args.mode)
    plain = load(args.model, **options)
    kept = [c for c in contexts if c + args.decode_steps <= plain.spec.max_context]
    if not kept:
        raise InvalidInput(f"no context leaves room for {args.decode_steps} decode steps within the model's "
                           f"max_context {plain.spec.max_context}")
    with load(args.model, tensor_parallel=args.tensor_parallel, **options) as split:
        report = {"model": Path(args.model).name, "world": args.tensor_parallel, "device": str(plain.device),
                  "dtype": str(plain.dtype).removeprefix("torch."), "mode": plain.mode, "rounds": args.rounds,
                  "decode_steps": args.decode_steps, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                  "commit": bench._commit()}
        report |= parallel.run(plain, split, kept, args.decode_steps, args.rounds, args.chunk,
                               ProgressBar("bench --tensor-parallel", unit="context"))
    return _written(args, report, parallel.table(report))


def _written(args, report: dict, text: str) -> int:
    """The report to --json, its table to --table and to the terminal."""
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.table:
        Path(args.table).write_text(text)
    print(text, end="")
    return 0


def _long(args, contexts: list[int], batches: tuple[int, ...]) -> int:
    from hebrus import bench
    from hebrus.bench import long
    from hebrus.progress import ProgressBar
    from hebrus.runtime import resolve_device, resolve_dtype

    if args.model != MODEL or args.compare_transformers:
        raise InvalidInput("--long builds its own two models: leave out --model and --compare-transformers")
    shape = args.long_shape or "small"
    models = long.long_models(resolve_device(args.device), resolve_dtype(args.dtype), args.mode, shape)
    room = long.LONG_CONTEXT - args.decode_steps
    kept = [c for c in contexts if c <= room]
    if not kept:
        raise InvalidInput(f"no context leaves room for {args.decode_steps} decode steps within {long.LONG_CONTEXT}")
    reports: dict[str, dict] = {}
    device = resolve_device(args.device)
    bandwidth = bench.copy_bandwidth(device, 2**30 if device.type == "cuda" else 2**27)
    layers = [long.layer_point(model, c, bandwidth) | {"model": name} for name, model in models.items() for c in kept]

    def write(name: str | None = None, report: dict | None = None) -> None:
        if name is not None:
            reports[name] = report
        combined = {**reports, "comparison": long.comparison(reports) if len(reports) == 2 else [], "layer": layers}
        if args.json:
            Path(args.json).write_text(json.dumps(combined, indent=2) + "\n")
        if args.table:
            Path(args.table).write_text("".join(bench.table(r) + "\n" for r in reports.values())
                                        + long.table(combined["comparison"]) + "\n" + long.layer_table(layers))

    write()
    print(long.layer_table(layers))

    for name, model in models.items():
        model.session(decode=args.decode)
        report = bench.run(model, f"{shape}, {name} attention", kept, args.decode_steps, args.rounds, args.chunk,
                           ProgressBar(f"bench {name}", unit="point"), decode=args.decode,
                           on_point=lambda r, name=name: write(name, r), batches=batches)
        write(name, report)
        print(bench.table(report))
        del model
        models[name] = None
    print(long.table(long.comparison(reports)), end="")
    return 0
