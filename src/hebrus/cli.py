"""The `hebrus` command: generate, verify, info."""
from __future__ import annotations

import argparse
import os
import sys
import time

from hebrus.config import PRESETS
from hebrus.errors import FAULT_KINDS, ChunkAborted, InvalidInput
from hebrus.runtime import DTYPES, MODES, load
from hebrus.text import escaped

MODEL_HELP = f"a preset ({', '.join(PRESETS)}) or a checkpoint directory (default: tiny)"


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
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="continue a text prompt, streaming the output",
                         description="Byte-level generation with the given model; prints the continuation as it comes.")
    gen.add_argument("prompt", help="the text to continue")
    _model_args(gen, default_mode="exact")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    gen.set_defaults(handler=_generate)

    ver = sub.add_parser("verify", help="run the conformance suite",
                         description="Every stage × every fault kind, plus chunking and interleaving equivalence. "
                                     "Exit code 0 only when everything passed.")
    _model_args(ver, default_mode="exact")
    ver.set_defaults(handler=_verify)

    info = sub.add_parser("info", help="show the config, the stages and every owner with its bytes",
                          description="What a model is made of and what one session of it holds.")
    _model_args(info, default_mode="exact")
    info.set_defaults(handler=_info)
    return parser


def _model_args(p: argparse.ArgumentParser, default_mode: str) -> None:
    p.add_argument("--model", default="tiny", help=MODEL_HELP)
    p.add_argument("--mode", choices=MODES, default=default_mode, help=f"execution mode (default {default_mode})")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="compute dtype (default float32)")


def _load(args):
    return load(args.model, device=args.device, dtype=args.dtype, mode=args.mode)


def _generate(args) -> int:
    from hebrus.tokenizer import StreamDecoder, encode

    model = _load(args)
    tokens = model.session().generate(encode(args.prompt), max_new_tokens=args.max_new_tokens,
                                      temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if args.model in PRESETS:
        print(f"(preset {args.model!r} has random weights: expect noise, not language)", file=sys.stderr)
    decoder = StreamDecoder()
    for token in tokens:
        sys.stdout.write(decoder.push(token))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush() + "\n")
    return 0


def _verify(args) -> int:
    from hebrus import verify
    from hebrus.progress import ProgressBar

    model = _load(args)
    started = time.perf_counter()
    results = verify.run(model, ProgressBar(f"verify {args.model} {args.mode}"))
    seconds = time.perf_counter() - started
    print(f"hebrus verify: model {args.model}, mode {args.mode}, device {model.device}, dtype {args.dtype}\n")
    _fault_table(model, [r for r in results if r.group == "fault"])
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


def _fault_table(model, results) -> None:
    cells = {r.name: r.verdict for r in results}
    width = max(len(name) for name in model.stage_names)
    print("faults".ljust(width) + "  " + "  ".join(k.ljust(10) for k in FAULT_KINDS))
    for stage in model.stage_names:
        row = "  ".join(cells.get(f"{stage} × {k}", "-").ljust(10) for k in FAULT_KINDS)
        print(f"{stage.ljust(width)}  {row}")


def _info(args) -> int:
    from hebrus.state.owners import BANKED
    from hebrus.weights.layout import parameter_count

    model = _load(args)
    c = model.config
    print("config")
    for key, value in c.to_dict().items():
        print(f"  {key:26} {value}")
    print(f"  {'parameters':26} {parameter_count(c):,}")
    print(f"\nstages ({len(model.stages)})\n  " + "\n  ".join(model.stage_names))
    print(f"\nowners (bytes per session; banked owners hold two banks, appended owners grow per token, "
          f"shown at max_context={c.max_context})")
    print(f"  {'owner':26} {'kind':9} {'dtype':8} {'shape':16} {'bytes':>12}")
    total = 0
    for spec in model.owners:
        shape = spec.shape if spec.kind == BANKED else ("rows",) + spec.shape
        size = 2 * spec.nbytes if spec.kind == BANKED else spec.nbytes * c.max_context
        note = "" if spec.kind == BANKED else f"  ({spec.nbytes} per token)"
        total += size
        dtype = str(spec.dtype).removeprefix("torch.")
        print(f"  {spec.name:26} {spec.kind:9} {dtype:8} {str(shape):16} {size:>12,}{note}")
    print(f"  {'total':26} {'':9} {'':8} {'':16} {total:>12,}")
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
