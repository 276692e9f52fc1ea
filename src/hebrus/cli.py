"""The `hebrus` command: generate, chat, verify, bench, quantize, serve, download, worker, info."""
from __future__ import annotations

import argparse
import os
import sys
import time

from hebrus import text
from hebrus.arguments import gather_seconds
from hebrus.bench import command as bench_command
from hebrus.models.hebrus import PRESETS, HebrusConfig
from hebrus.presets import TRAINED
from hebrus.errors import FAULT_KINDS, ChunkAborted, InvalidInput
from hebrus.runtime import DTYPES, MODES, load
from hebrus.scheduling.scheduler import CHUNK_SIZE, PREFILL_SHARE
from hebrus.state.pool import PoolSize
from hebrus.show import escaped
from hebrus.weights import checkpoint
from hebrus.weights.quant import QUANT_FORMATS

MODEL_HELP = (f"a preset (trained: {', '.join(TRAINED)}; random: {', '.join(PRESETS)}), a checkpoint "
              f"directory or a Hugging Face repo id (Org/Name: from the local cache, downloaded when missing)")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except InvalidInput as exc:
        _error(f"hebrus: error: {exc}")
        return 2
    except ChunkAborted as exc:
        _error(f"hebrus: {exc}")
        return 1
    except UnicodeDecodeError as exc:       # standard input that is not text in the locale's encoding
        _error(f"hebrus: error: the input is not text in {exc.encoding}: byte 0x{exc.object[exc.start]:02X} at "
               f"{exc.start}")
        return 2
    except BrokenPipeError:                 # the reader went away (`hebrus generate ... | head`)
        _detach_stdout()
        return 141
    except OSError as exc:                  # output that cannot be written (a full disk, ...)
        _detach_stdout()
        _error(f"hebrus: error: cannot write the output: {exc.strerror or exc}")
        return 1
    except KeyboardInterrupt:
        return 130


def _error(message: str) -> None:
    """Messages can quote names from untrusted files: escape what would drive the terminal."""
    print(escaped(message), file=sys.stderr)


def _detach_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):      # stdout is not a real file (tests, IDEs)
        pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hebrus", description="Transactional inference for hybrid language models.")
    parser.add_argument("--version", action="version", version=f"hebrus {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="continue a text prompt, streaming the output",
                         description="Generate with the given model, printing the continuation as it comes. "
                                     "A checkpoint's tokenizer.json is used when it has one; otherwise text is bytes.")
    gen.add_argument("prompt", help="the text to continue, or - to read it from standard input")
    _model_args(gen)
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as a user's message: through the checkpoint's chat template, or the "
                          "plain format (ROLE. then the text) for a model without one")
    gen.add_argument("--echo", action="store_true", help="print the prompt before the continuation")
    _text_args(gen)
    _parallel_args(gen)
    gen.set_defaults(handler=_generate)

    chat = sub.add_parser("chat", help="an interactive conversation",
                          description="Talk with the model: each line you type is a user's message, the "
                                      "reply streams as it comes. The conversation stays in one session, so a "
                                      "turn feeds only its new tokens. Commands: /reset, /save FILE, /load FILE "
                                      "(session snapshots), /help, /quit (or Ctrl-D).")
    _model_args(chat)
    chat.add_argument("--system", default=None, help="a system message opening the conversation")
    _text_args(chat)
    _parallel_args(chat)
    chat.set_defaults(handler=_chat)

    ver = sub.add_parser("verify", help="run the conformance suite",
                         description="Every stage × every fault kind, plus chunking and interleaving equivalence. "
                                     "Exit code 0 only when everything passed.")
    _model_args(ver, default_mode="exact")
    _parallel_args(ver)
    ver.set_defaults(handler=_verify)

    bench_command.add_parser(sub, MODEL_HELP, lambda args: _load(args, threads=False))

    quant = sub.add_parser("quantize", help="write a quantized copy of a Hebrus checkpoint",
                           description="Quantize the model's large projections and write a checkpoint that "
                                       "loads as it is stored (config.json's quantization_config says how).")
    quant.add_argument("model", help=MODEL_HELP.removesuffix(" (default: tiny)"))
    quant.add_argument("out", help="the folder to write: new or empty (with --force, replaced as a whole)")
    quant.add_argument("--format", required=True, choices=QUANT_FORMATS,
                       help="int8 (per output channel), int4 (groups of 128, symmetric), int4-zp (with zero "
                            "points) or fp8 (e4m3, 128 × 128 blocks)")
    quant.add_argument("--force", action="store_true",
                       help="replace OUT even if it holds a model or other files: it then holds exactly the "
                            "quantized model (with the source folder's tokenizer and chat template, if any)")
    quant.set_defaults(handler=_quantize)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server",
                           description="Serve /v1/completions, /v1/chat/completions (streaming or not), /v1/models, "
                                       "/health and /metrics (with --api-key, every route but /health needs a key). "
                                       "Requests run together in one engine loop; a request "
                                       "whose transaction aborts gets an error and no other request is touched. "
                                       "Needs pip install 'hebrus[serve]'.")
    _model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help="require Authorization: Bearer KEY (repeat it for several keys, each with its own "
                            "cached prefixes; default: no key, and then no prefix cache unless --share-prefixes)")
    serve.add_argument("--max-sessions", type=int, default=16, help="requests running at once (default 16)")
    serve.add_argument("--prefill-tokens", type=int, default=None,
                       help="prompt tokens fed per turn of the engine loop at most, between the running "
                            "requests' steps: more starts new requests sooner, fewer keeps the running ones' "
                            "tokens coming (default: the model's prefill chunk, 8192 in fast mode on a GPU, "
                            "where a pass of a few hundred tokens costs about what one of thousands does, "
                            "else 512)")
    serve.add_argument("--prefill-chunk", type=int, default=CHUNK_SIZE, metavar="N",
                       help="one request's prompt tokens a turn feeds (default %(default)s): a long prompt "
                            "goes in chunks of N, several requests' chunks in one pass, up to --prefill-tokens "
                            "together; while no request decodes, what --prefill-tokens leaves after every "
                            "prompt's chunk goes to the oldest prompts")
    serve.add_argument("--prefill-share", type=float, default=PREFILL_SHARE, metavar="STEPS",
                       help="while requests decode, a turn (their step and its prompt chunks) takes at most "
                            "the time of 1 + this many decode steps (a step alone where one of about their "
                            "width was measured; default %(default)s), or "
                            "the prefilling requests' part of --prefill-tokens by head count if more: a long "
                            "prompt slows their tokens by about 1 + STEPS times")
    serve.add_argument("--gather-ms", type=float, default=0.0, metavar="MS",
                       help="an idle engine woken by a request waits for more while they keep arriving less "
                            "than MS apart (up to ten times MS; at most 100), so a burst's prompts go in one "
                            "pass (default 0: off; 5 ms was measured slower at 64 clients on an H100)")
    serve.add_argument("--passes", choices=("auto", "one", "two", "paced"), default="auto",
                       help="a turn of the engine loop feeds its prompt chunks and steps its decoding requests in "
                            "one pass, or in two (chunks, then steps replayed from CUDA graphs), or paced: a "
                            "pass of chunks runs a few of its stages a turn, as many as --prefill-share decode "
                            "steps' time affords, the steps after them; default auto: two where the steps "
                            "replay graphs (fast mode on CUDA), else one")
    serve.add_argument("--prefix-cache-bytes", type=int, default=1 << 30, metavar="BYTES",
                       help="the prefix cache's budget: states kept as prompts pass, so a prompt that begins "
                            "with cached tokens feeds only the rest (default 1 GiB; 0: off); used with --api-key (a key "
                            "keeps a quarter of it beside other keys' entries) or --share-prefixes")
    serve.add_argument("--prefix-every", type=int, default=None, metavar="K",
                       help="the prefix cache keeps a prompt's state every K tokens: a hit recomputes fewer "
                            "than K tokens, and each state kept splits the chunk's pass (default 64; 1024 in "
                            "fast mode on a GPU, where a pass of any length costs about the same)")
    serve.add_argument("--share-prefixes", action="store_true",
                       help="one prefix cache for every API key (default: each key's own); a hit is faster, "
                            "so one key can learn by timing what another key's prompts began with")
    serve.add_argument("--name", default=None, help="the model's name in the API (default: --model)")
    _parallel_args(serve)
    serve.set_defaults(handler=_serve)

    down = sub.add_parser("download", help="fetch a model from the Hugging Face hub into the local cache",
                          description="Download Org/Name's config, safetensors weights, tokenizer and chat "
                                      "template (never pickles or code) into the Hugging Face cache, and print the "
                                      "folder. HF_ENDPOINT, HF_HUB_OFFLINE, HF_HOME and HF_TOKEN apply.")
    down.add_argument("repo", help="the repo id, Org/Name")
    down.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    down.set_defaults(handler=_download)

    worker = sub.add_parser("worker", help="join a tensor-parallel model loaded on another host as one of its ranks",
                            description="Join the rendezvous of a model loaded elsewhere with --tensor-parallel N "
                                        "--rendezvous HOST:PORT, as rank R (1 .. N-1): learn the model and its "
                                        "options there, load this rank's part, and run every call until the model "
                                        "is closed.")
    worker.add_argument("--rendezvous", required=True, metavar="HOST:PORT",
                        help="the address the loading process serves the rendezvous on")
    worker.add_argument("--rank", required=True, type=int, metavar="R", help="this process's rank, 1 or more")
    worker.set_defaults(handler=_worker)

    info = sub.add_parser("info", help="show the config, the stages and every owner with its bytes",
                          description="What a model is made of and what one session of it holds.")
    _model_args(info, default_mode="exact")
    info.set_defaults(handler=_info)
    return parser


def _serve(args) -> int:
    if not 1 <= args.port <= 65535:
        raise InvalidInput(f"--port must lie in [1, 65535], got {args.port}")
    if args.max_sessions < 1:
        raise InvalidInput("--max-sessions must be at least 1")
    if args.prefill_tokens is not None and args.prefill_tokens < 1:
        raise InvalidInput("--prefill-tokens must be at least 1")
    if args.prefill_chunk < 1:
        raise InvalidInput("--prefill-chunk must be at least 1")
    if not args.prefill_share > 0:
        raise InvalidInput("--prefill-share must be a positive number of decode steps")
    if args.passes == "paced" and (getattr(args, "tensor_parallel", None) or 1) > 1:
        raise InvalidInput("--passes paced stops a prompt pass between its stages, which a model over "
                           "tensor-parallel ranks cannot (its ranks step together): use one or two")
    gather = gather_seconds(args.gather_ms, "--gather-ms")
    if args.prefix_cache_bytes < 0:
        raise InvalidInput("--prefix-cache-bytes must be at least 0 (0 turns the prefix cache off)")
    if args.prefix_every is not None and args.prefix_every < 1:
        raise InvalidInput("--prefix-every must be at least 1")
    import importlib
    try:
        for package in ("fastapi", "uvicorn", "prometheus_client"):
            importlib.import_module(package)
        from hebrus import serve
    except ImportError as exc:
        raise InvalidInput(f"hebrus serve needs its extra: pip install 'hebrus[serve]' ({exc})") from None
    listening = _listening(args.host, args.port)            # before the model loads: a port in use fails now
    model = _load(args)
    return serve.run(model, args.name or args.model, listening, args.api_key, args.max_sessions, args.prefill_tokens,
              cache_bytes=args.prefix_cache_bytes, prefix_every=args.prefix_every, prefill_share=args.prefill_share,
              share_prefixes=args.share_prefixes, passes=args.passes, prefill_chunk=args.prefill_chunk,
              gather=gather)


def _listening(host: str, port: int):
    """A socket bound to (host, port), not listening yet (the server listens once the model is
    loaded, so nothing connects before it can be answered); InvalidInput when that address
    cannot be had."""
    import socket
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise InvalidInput(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = "the port is in use (another server?); choose another with --port" if exc.errno == 98 else \
            exc.strerror or str(exc)
        raise InvalidInput(f"cannot listen on {host}:{port}: {why}") from None
    return sock


def _download(args) -> int:
    from hebrus import hub
    folder = hub.fetch(args.repo, revision=args.revision)
    print(folder)
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("hebrus")
    except PackageNotFoundError:
        return "unknown"


def _model_args(p: argparse.ArgumentParser, default_mode: str = text.MODE) -> None:
    p.add_argument("--model", default=text.MODEL, help=f"{MODEL_HELP} (default: {text.MODEL})")
    p.add_argument("--mode", choices=MODES, default=default_mode, help=f"execution mode (default {default_mode})")
    p.add_argument("--device", default=text.DEVICE,
                   help="torch device: auto (CUDA when there is one, else the CPU), cpu, cuda, cuda:N "
                        "(default auto)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default=text.DTYPE,
                   help="compute dtype: auto is bfloat16 on a GPU and float32 on the CPU (default auto)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for the model's arithmetic (default: $HEBRUS_THREADS, else one per core this "
                        "process may use that the load average leaves free, at least one)")
    p.add_argument("--ple-cache-bytes", type=int, default=None, metavar="N",
                   help="serve the per-layer-embedding tables in pages through N bytes of device memory, "
                        "reading them from the checkpoint file (or host memory for a random preset) as "
                        "chunks need them (default: resident)")
    p.add_argument("--quantize", choices=QUANT_FORMATS, default=None,
                   help="quantize the large projections as the model loads (default: as stored)")
    p.add_argument("--kv-cache", choices=("int8", "fp8"), default=None,
                   help="keep attention's K/V rows and index keys as codes with a scale per row "
                        "(default: in the model's dtype)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--pool-bytes", type=int, default=None, metavar="N",
                      help="bytes of the state pool every session lives in: slots for their banks, blocks for "
                           "their rows (default: a quarter of the host's memory on the CPU, touched only as used; "
                           "30%% of the free memory on a GPU)")
    size.add_argument("--memory-fraction", type=float, default=None, metavar="F",
                      help="the state pool as this fraction (0..1] of the device's free memory when it is carved")


def _parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="split the model over N ranks, a process each (this one rank 0; the others started here, "
                        "or with --rendezvous joined from other hosts by `hebrus worker`)")
    p.add_argument("--rendezvous", default=None, metavar="HOST:PORT",
                   help="with --tensor-parallel: wait on this address for workers started by `hebrus worker` "
                        "on other hosts instead of starting them here")


def _worker(args) -> int:
    from hebrus import parallel
    from hebrus.runtime import rank_model
    parallel.serve_worker(args.rendezvous, args.rank, rank_model)
    return 0


def _text_args(p: argparse.ArgumentParser) -> None:
    """Generation options; those left out take the text-level defaults (README: Defaults)."""
    p.add_argument("--max-new-tokens", type=int, default=text.MAX_NEW_TOKENS,
                   help=f"tokens to generate at most (default {text.MAX_NEW_TOKENS})")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the checkpoint's generation_config.json, else 1)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the k likeliest tokens; 0 = all (default: the checkpoint's, else 0)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus mass in (0, 1] (default: the checkpoint's, else 1)")
    p.add_argument("--min-p", type=float, default=None,
                   help="drop tokens below min-p times the likeliest one's probability (default: the checkpoint's, "
                        "else 0)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide the logits of tokens already seen by this (default: the checkpoint's, else 1: off)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the output contains TEXT (repeatable); the checkpoint's EOS ids always stop")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a new one each run)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", default=None, metavar="FILE",
                       help="the output is JSON valid under the JSON schema in FILE (\"{}\" as FILE: any JSON object)")
    shape.add_argument("--regex", default=None, metavar="PATTERN", help="the output matches the regular expression")


def _text_options(args) -> dict:
    return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
            "seed": args.seed, "stop": tuple(args.stop), "grammar": _grammar(args)}


def _grammar(args):
    """--json-schema FILE or --regex PATTERN as a Grammar (None: neither)."""
    from hebrus.text.grammar import Grammar
    if getattr(args, "regex", None) is not None:
        return Grammar.regex(args.regex)
    path = getattr(args, "json_schema", None)
    if path is None:
        return None
    if path == "{}":
        return Grammar.json()
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"--json-schema {path}: cannot be read ({exc})") from None
    return Grammar.json(source)


def _threads(args, auto: bool = True) -> None:
    """--threads, else HEBRUS_THREADS, else (`auto`) one per core this process may use that the
    last minute's load average leaves free, at least one: on a core another process keeps
    busy, a thread makes every small operation wait for it (one core busy: 20 times slower)."""
    import torch
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    value = getattr(args, "threads", None)
    where = "--threads"
    if value is None and os.environ.get("HEBRUS_THREADS"):
        text_value, where = os.environ["HEBRUS_THREADS"], "HEBRUS_THREADS"
        if not (text_value.isascii() and text_value.isdigit()) or len(text_value) > 6:
            raise InvalidInput(f"HEBRUS_THREADS must be a whole number of threads, got {text_value!r}")
        value = int(text_value)
    if value is not None and not 1 <= value <= 8 * cores:
        raise InvalidInput(f"{where} must lie in [1, {8 * cores}] (8 per core this process may use), got {value}")
    if value is None and auto and hasattr(os, "getloadavg"):
        value = max(1, min(torch.get_num_threads(), int(cores - os.getloadavg()[0] + 0.5)))
    if value is not None:
        torch.set_num_threads(value)


def _load(args, say: bool = True, threads: bool = True):
    """The model, said on stderr as it loads (what, where, how long), with a progress bar once
    loading has taken more than a second; the threads set first (`_threads`) unless not
    `threads` (the bench sets its own)."""
    from hebrus.progress import ProgressBar
    from hebrus.runtime import resolve_device
    if threads:
        _threads(args)
    started, bar = time.perf_counter(), []
    if say:
        device = resolve_device(args.device)                # a bad device is refused before anything is said
        PoolSize(getattr(args, "pool_bytes", None), getattr(args, "memory_fraction", None)).checked()
        _error(f"hebrus: loading {args.model} ({args.mode} mode, on {device})")

    def progress(done: int, total: int) -> None:
        if not bar and time.perf_counter() - started > 1.0 and done < total:
            bar.append(ProgressBar(f"load {args.model}", unit="tensor"))
        if bar:
            bar[0](done, total)

    model = load(args.model, device=args.device, dtype=args.dtype, mode=args.mode, progress=progress,
                 ple_cache_bytes=getattr(args, "ple_cache_bytes", None), quantize=getattr(args, "quantize", None),
                 kv_cache=getattr(args, "kv_cache", None), pool_bytes=getattr(args, "pool_bytes", None),
                 memory_fraction=getattr(args, "memory_fraction", None),
                 **{name: getattr(args, name) for name in ("tensor_parallel", "rendezvous")
                    if getattr(args, name, None) is not None})
    if say:
        import torch
        from hebrus.layers.layout import parameter_count
        threads = torch.get_num_threads()
        where = f"{model.device}" + (f", {threads} thread{'s' if threads != 1 else ''}"
                                     if model.device.type == "cpu" else "")
        world = getattr(model, "world", None)
        held = (f"over {world} ranks, rank 0 holding {parameter_count(model.spec) / 1e6:.2f}M parameters" if world
                else f"{parameter_count(model.spec) / 1e6:.2f}M parameters")
        _error(f"hebrus: {args.model}: {model.family}, {held}, "
               f"{str(model.dtype).removeprefix('torch.')}, {model.mode} mode, on {where}; loaded in "
               f"{time.perf_counter() - started:.1f} s")
    return model


def _quantize(args) -> int:
    checkpoint.writable_target(args.out, args.force)          # refused before the work of loading
    _error(f"hebrus: loading {args.model} to quantize it ({args.format})")
    model = load(args.model)
    if not isinstance(model.config, HebrusConfig):          # refused before the work of quantizing
        raise InvalidInput(f"quantize writes Hebrus checkpoints; {args.model} is a {model.spec.family} model: "
                           f"quantize it as it loads instead (--quantize {args.format}, or "
                           f"hebrus.load(..., quantize={args.format!r}))")
    model = model.quantized(args.format)
    model.save(args.out, overwrite=args.force)
    q = model.spec.quantization
    print(f"wrote {args.out}: {q.name} weights, {_weight_bytes(model):,} bytes")
    return 0


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for _, p in model.named_parameters())


def _generate(args) -> int:
    from hebrus.text.tokenizers import printable
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    options = text.TextOptions.of(**_text_options(args))        # checked before the model loads
    model = _load(args)
    if args.model in PRESETS:
        _error(f"(preset {args.model!r} has random weights: expect noise, not language)")
    asked = [{"role": "user", "content": prompt}] if args.chat else prompt
    if args.echo:
        shown = model.tokenizer.apply_chat_template(asked, tokenize=False) if args.chat else prompt
        sys.stdout.write(printable(shown))
    stream = text.stream_text(model.session(), asked, progress=_prefill_bar(), **_fields(options))
    for piece in stream:
        sys.stdout.write(printable(piece))
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stream.context_ended:
        _error(f"(the model's context limit of {model.spec.max_context} tokens ended the generation)")
    _error(text.summary(stream))
    return 0


def _fields(options) -> dict:
    from dataclasses import fields
    return {f.name: getattr(options, f.name) for f in fields(options)}


def _chat(args) -> int:
    from hebrus import repl
    options = _fields(text.TextOptions.of(**_text_options(args)))
    model = _load(args)
    return repl.run(model, args.model, system=args.system, progress=_prefill_bar(), **options)


def _prefill_bar():
    """Progress on stderr while a long prompt is fed (silent for short ones)."""
    from hebrus.progress import ProgressBar
    bar = ProgressBar("prefill", unit="token")
    return lambda done, total: bar(done, total) if total > 1024 else None


def _verify(args) -> int:
    from hebrus import verify
    from hebrus.progress import ProgressBar

    model = _load(args)
    started = time.perf_counter()
    results = verify.run(model, ProgressBar(f"verify {args.model} {args.mode}", unit="check"))
    seconds = time.perf_counter() - started
    print(f"hebrus verify: model {args.model}, mode {args.mode}, device {model.device}, "
          f"dtype {str(model.dtype).removeprefix('torch.')}\n")
    world = getattr(model, "world", None)
    for rank in range(world) if world else [None]:
        if rank is not None:
            print(f"{'' if rank == 0 else chr(10)}faults injected on rank {rank} of {world} (every rank raises the same)")
        _fault_table(model, [r for r in results if r.group == "fault"], rank)
    if not world:
        print("\none session's fault in a ragged step of three")
        _fault_table(model, [r for r in results if r.group == "batch"])
    print("\nequivalence")
    for r in (r for r in results if r.group == "equivalence"):
        print(f"  {r.verdict:6}  {r.name}" + (f"  ({r.detail})" if r.detail else ""))
    failures = [r for r in results if not r.passed]
    if failures:
        print("\nfailures")
        for r in failures:
            print(f"  {r.name}: {r.verdict} — {r.detail}")
    passed = len(results) - len(failures)
    print(f"\n{seconds:.1f}s")
    print(f"{passed} passed, {len(failures)} failed")
    return 0 if not failures else 1


def _fault_table(model, results, rank: int | None = None) -> None:
    from hebrus.verify import cell
    cells = {r.name: r.verdict for r in results}
    _table(["faults", *FAULT_KINDS],
           [[stage] + [cells.get(cell(stage, k, rank), "-") for k in FAULT_KINDS] for stage in model.stage_names])


def _table(header: list[str], rows: list[list[str]], right: tuple[int, ...] = ()) -> None:
    """A table on stdout through rich: plain columns (it is read by people and by scripts), no
    markup or emoji codes read from the cells (names can come from a checkpoint's files), wide
    enough that a pipe gets whole lines."""
    from rich.console import Console
    from rich.table import Table
    table = Table(box=None, show_edge=False, pad_edge=False, header_style="bold")
    for i, name in enumerate(header):
        table.add_column(name, justify="right" if i in right else "left", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    tty = sys.stdout.isatty() if hasattr(sys.stdout, "isatty") else False
    console = Console(file=sys.stdout, markup=False, emoji=False, highlight=False,
                      width=None if tty else 10_000)
    console.print(table)


def _info(args) -> int:
    from hebrus.state.owners import BANKED
    from hebrus.layers.layout import parameter_count

    model = _load(args)
    c = model.spec
    print(f"model ({c.family})")
    for key, value in c.fields_in_use():
        print(f"  {key:26} {value}")
    print(f"  {'parameters':26} {parameter_count(c):,}")
    unread = getattr(model.config, "num_nextn_predict_layers", 0)
    if unread:
        print(f"  {'not read':26} the checkpoint's {unread} multi-token-prediction layer(s) (nothing here uses them)")
    resident = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name not in model.paged)
    print(f"  {'resident weight bytes':26} {resident:,}")
    if model.paged:
        streamed = sum(t.host_bytes for t in model.paged.values())
        cache = sum(t.device_bytes for t in model.paged.values())
        print(f"  {'streamed PLE bytes':26} {streamed:,} (pages of {next(iter(model.paged.values())).page_rows} "
              f"rows through a {cache:,}-byte cache)")
    print(f"\nstages ({len(model.stages)})\n  " + "\n  ".join(model.stage_names))
    print(f"\nowners (bytes per session; banked owners hold two banks, appended owners grow per token, "
          f"shown at max_context={c.max_context})")
    rows, total = [], 0
    for spec in model.owners:
        shape = spec.shape if spec.kind == BANKED else ("rows",) + spec.shape
        size = 2 * spec.nbytes if spec.kind == BANKED else spec.nbytes * c.max_context
        note = "" if spec.kind == BANKED else f"{spec.nbytes} per token"
        total += size
        rows.append([spec.name, spec.kind, str(spec.dtype).removeprefix("torch."), str(shape), f"{size:,}", note])
    per_token = sum(spec.nbytes for spec in model.owners if spec.kind != BANKED)
    rows.append(["total", "", "", "", f"{total:,}", f"{per_token:,} per token"])
    _table(["owner", "kind", "dtype", "shape", "bytes", ""], rows, right=(4,))
    pool = model.pool
    slot, block = pool.slot_nbytes, pool.block_nbytes
    print(f"\nstate pool ({pool.nbytes():,} bytes on {model.device})")
    print(f"  {'slots':26} {pool.slots:,} ({slot:,} bytes each: both banks of every banked owner)")
    print(f"  {'blocks':26} {pool.blocks:,} of {pool.block_rows} rows ({block:,} bytes each)")
    print(f"  {'rows held at most':26} {pool.blocks * pool.block_rows:,} "
          f"({pool.blocks * pool.block_rows // max(c.max_context, 1):,} sessions at max_context)")
    return 0


def console() -> int:
    """The `hebrus` command: the process's streams made safe, then `main`."""
    if sys.stdout is None:
        print("hebrus: error: standard output is closed", file=sys.stderr)
        return 2
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")       # an ASCII terminal still shows something
    return main()


if __name__ == "__main__":
    sys.exit(console())
