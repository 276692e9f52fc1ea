"""`hebrus bench`: prefill and decode speed, measured side by side in one run.

At each context length it prefills that many tokens and then decodes, twice over: with normal
(transactional) sessions, and with an in-place variant that runs the same stages against one
bank written in place (no second bank, no seal, no validation, no status word; it exists only
here, to price the guarantee). The two take turns, so drift in machine speed hits both alike.
Beside them, the same run measures what the device can do at all: its copy bandwidth (the floor
for a decode step is the bytes it must read: `decode_bytes`) and its matrix throughput in the
model's dtype (the roofline for prefill: `prefill_flops_per_token`).
"""
from __future__ import annotations

import inspect
import json
import math
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hebrus.errors import InvalidInput
from hebrus.state.image import Image, Published
from hebrus.state.owners import BANKED

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


@dataclass
class Point:
    context: int
    prefill_s_per_token: dict[str, float] | None     # None for a batch: prefill is not batched yet
    decode_s_per_step: dict[str, float]


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


class InPlaceSession:
    """A session that overwrites its state in place: measurement only, never a product path.
    With `graphs`, its one-token steps are captured as a CUDA graph the way a transactional
    session's are (same plan, same storage policy), so the two are compared like for like."""

    def __init__(self, model, graphs: bool = False):
        self.model, self.graphs = model, graphs
        self.image = Image(model.owners, model.device)
        self.bank = self.image.banks[0]
        self.storages = list(self.image.public.storages)
        self.frontier = 0
        self.token = torch.zeros(1, dtype=torch.int64, device=model.device)
        self.graph, self.captured_for, self.warm = None, None, False

    def feed(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.int64)
        with torch.inference_mode():
            if self.graphs and len(ids) == 1 and all(st.shape[0] > self.frontier for st in self.storages):
                self._step(ids)
            else:
                self._run(_InPlaceContext(self, ids.to(self.model.device), self.frontier))
                self.bank["frontier"].fill_(self.frontier + len(ids))
        self.frontier += len(ids)
        return self.bank["logits"].clone()

    def _run(self, ctx) -> None:
        for stage in self.model.stages:
            stage.run(ctx)

    def _planned(self) -> None:
        self._run(_InPlaceContext(self, self.token, self.bank["frontier"].view(1)))
        self.bank["frontier"].add_(1)

    def _step(self, ids) -> None:
        self.token.copy_(ids)
        if self.graph is not None and any(a is not b for a, b in zip(self.captured_for, self.storages)):
            self.graph = None
        if self.graph is None and self.warm:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._planned()
            self.captured_for = list(self.storages)
        if self.graph is None:
            self._planned()
            self.warm = True
        else:
            self.graph.replay()


class InPlaceBatch:
    """In-place sessions stepped together, one token each: the batched pass of `hebrus.Batch`
    with every write in place (measurement only). With `graphs`, steps are captured as a CUDA
    graph once every row log holds its row, as `hebrus.Batch` captures them."""

    def __init__(self, sessions: list[InPlaceSession], graphs: bool = False):
        self.sessions, self.model, self.graphs = sessions, sessions[0].model, graphs
        self.tokens = torch.zeros(len(sessions), dtype=torch.int64, device=self.model.device)
        self.graph, self.captured_for, self.warm = None, None, False

    def feed(self, tokens) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.int64)
        with torch.inference_mode():
            roomy = all(st.shape[0] > s.frontier for s in self.sessions for st in s.storages)
            if self.graphs and roomy:
                self._step(ids)
            else:
                self._run(_InPlaceBatchContext(self.sessions, ids.to(self.model.device)))
                for s in self.sessions:
                    s.bank["frontier"].fill_(s.frontier + 1)
        for s in self.sessions:
            s.frontier += 1
        return torch.stack([s.bank["logits"] for s in self.sessions])

    def _run(self, ctx) -> None:
        for stage in self.model.stages:
            stage.run(ctx)

    def _planned(self) -> None:
        starts = [s.bank["frontier"].view(1) for s in self.sessions]
        self._run(_InPlaceBatchContext(self.sessions, self.tokens, starts))
        for s in self.sessions:
            s.bank["frontier"].add_(1)

    def _step(self, ids) -> None:
        self.tokens.copy_(ids)
        storages = [list(s.storages) for s in self.sessions]
        if self.graph is not None and any(a is not b for old, new in zip(self.captured_for, storages)
                                          for a, b in zip(old, new)):
            self.graph = None
        if self.graph is None and self.warm:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._planned()
            self.captured_for = storages
        if self.graph is None:
            self._planned()
            self.warm = True
        else:
            self.graph.replay()


class _InPlaceBatchContext:
    batched = True

    def __init__(self, sessions: list[InPlaceSession], ids: torch.Tensor, starts=None):
        starts = [s.frontier for s in sessions] if starts is None else starts
        self.parts = [_InPlaceContext(s, ids[i:i + 1], start) for i, (s, start) in enumerate(zip(sessions, starts))]
        self.start = starts
        self.local = {"ids": ids}

    def read(self, name):
        return torch.stack([p.read(name) for p in self.parts])

    def write(self, name, value):
        for p, v in zip(self.parts, value):
            p.write(name, v)

    def rows(self, name):
        return [p.rows(name) for p in self.parts]

    def emit(self, key, value):
        self.local[key] = value

    def last_rows(self, X):
        return X

    def flag(self, bad, bit):
        pass

    def check_range(self, values, upper, bit, lower=0):
        pass


class _InPlaceContext:
    batched = False

    def __init__(self, owner: InPlaceSession, ids: torch.Tensor, start):
        self.owner, self.start, self.length = owner, start, len(ids)
        self.local = {"ids": ids}

    def read(self, name):
        return self.owner.bank[name]

    def write(self, name, value):
        self.owner.bank[name].copy_(value)

    def rows(self, name):
        i = self.owner.image.slot[name]
        storage, need = self.owner.storages[i], self.owner.frontier + self.length
        if storage.shape[0] < need:                 # as a transaction grows it (never in a graph)
            capacity = min(self.owner.model.spec.max_context, max(need, 2 * storage.shape[0], 16))
            grown = torch.zeros((capacity,) + tuple(storage.shape[1:]), dtype=storage.dtype, device=storage.device)
            grown[: self.start].copy_(storage[: self.start])
            self.owner.storages[i] = storage = grown
        return storage

    def emit(self, key, value):
        self.local[key] = value

    def last_rows(self, X):
        return X[-1:]

    def flag(self, bad, bit):
        pass

    def check_range(self, values, upper, bit, lower=0):
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second read plus written by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / min(times)


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """Matrix-multiply flops per second in `dtype` on an n × n × n product."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    _sync(device)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / min(times)


def _active_weights(model, batch: int = 1) -> tuple[int, int, int]:
    """(bytes a step of `batch` tokens reads of the weights, elements a token multiplies in the
    body, elements of the output head): routed experts count top_k of E per token (at most all
    E for a batch), the input embedding one row a token, the head once."""
    s = model.spec
    read = body = 0
    head = s.vocab_size * s.hidden_size
    for name, p in model.named_parameters():
        share = s.moe_top_k / s.moe_experts if ".moe.experts." in name else 1.0
        if name == "embed.weight":
            read += batch * s.hidden_size * p.element_size() if not s.tie_embeddings else 0   # the head reads it
            continue
        if name.startswith(("ple.unigram.", "ple.ngram.")):                                  # one row looked up
            read += batch * p.shape[-1] * p.element_size()
            continue
        if name == "lm_head.weight":                                                          # counted as the head
            continue
        read += int(p.numel() * p.element_size() * min(1.0, share * batch))
        body += int(p.numel() * share)
    itemsize = model.dtype.itemsize
    return read + head * itemsize, body, head


def decode_bytes(model, context: int, batch: int = 1) -> int:
    """Bytes a decode step must read at `context`: the weights a token uses (top_k of the routed
    experts, one row of an untied input embedding, the output head), the banked state, and of the
    appended rows those attention reads: every K/V row of dense attention, every index key and
    top_k K/V rows of sparse attention; routes are written, not read. A batch of sessions reads
    the weights once (the experts any of its tokens chose) and each session's state."""
    s = model.spec
    weights = _active_weights(model, batch)[0]
    state = 0
    for o in model.owners:
        if o.kind == BANKED:
            state += o.nbytes
        elif o.name.endswith((".qsa.k", ".qsa.v")):
            state += o.nbytes * min(s.top_k, context)
        elif o.name != "routes":
            state += o.nbytes * context
    return weights + batch * state


def prefill_flops_per_token(model, context: int, chunk: int) -> float:
    """Matrix flops a prefill token costs: 2 per body weight it uses, the output head once per
    chunk (only the chunk's last position is published), and attention over the positions before
    it (on average half the context): q·k and the weighted sum of v, the indexer's scores."""
    s = model.spec
    _, body, head = _active_weights(model)
    flops = 2 * body + 2 * head / min(chunk, context)
    mean_position = context / 2
    for kind in s.mixers:
        if kind == "attention":
            flops += 4 * s.attn_heads * s.attn_head_dim * mean_position
        elif kind == "qsa":
            flops += 2 * s.index_heads * s.index_dim * mean_position
            flops += 4 * s.attn_heads * s.attn_head_dim * min(s.top_k, mean_position)
    return flops


# untimed decode steps before the timed ones: row storage may grow on the first (the prompt filled
# it), and each bank parity runs once from the plan and is then captured
WARM_STEPS = 6


def _copies(first, count: int, make):
    """`first` and count-1 sessions made by `make()` holding a copy of its published state (so
    a batch's sessions need one prefill): a measurement shortcut, never a product path."""
    out = [first]
    for _ in range(count - 1):
        other = make()
        if isinstance(first, InPlaceSession):
            for name, value in first.bank.items():
                other.bank[name].copy_(value)
            other.storages = [st.clone() for st in first.storages]
            other.frontier = first.frontier
        else:
            record = first.image.public
            for spec in first.image.banked:
                other.image.banks[record.bank][spec.name].copy_(first.image.banks[record.bank][spec.name])
            other.image.publish(Published(record.bank, record.frontier, tuple(st.clone() for st in record.storages)))
        out.append(other)
    return out


def _point(model, prompt: list[int], steps: int, rounds: int, chunk: int, how: str, batch: int = 1) -> Point:
    """Median seconds per prefill token and per decode step for both variants. Round 0 is not
    timed: it warms both variants at this very context (allocations, kernel choices, graph
    captures), so no variant pays first-use costs inside a timed round; the variants alternate
    who goes first. With `batch` > 1, each variant decodes that many sessions together (copies
    of one prefilled session; `hebrus.feed_many` against `InPlaceBatch`), and prefill is not
    reported: it is not batched yet."""
    if batch > 1:
        return _batch_point(model, prompt, steps, rounds, chunk, batch, how)
    graphs = model.session(decode=how).decode == "graph"
    variants = {"transactional": lambda: model.session(decode=how),
                "in-place": lambda: InPlaceSession(model, graphs=graphs)}
    prefill = {name: [] for name in variants}
    decode = {name: [] for name in variants}
    for r in range(rounds + 1):
        names = list(variants)[::-1] if r % 2 else list(variants)
        sessions, logits = {name: variants[name]() for name in names}, {}
        spent = {name: 0.0 for name in names}
        for name in names:
            _sync(model.device)
            t = time.perf_counter()
            for begin in range(0, len(prompt), chunk):
                logits[name] = sessions[name].feed(prompt[begin:begin + chunk])
            _sync(model.device)
            spent[name] = time.perf_counter() - t
        if r:                                      # round 0 only warms up
            for name in names:
                prefill[name].append(spent[name] / len(prompt))
        def advance(name, token):
            logits[name] = sessions[name].feed([token])

        spent = _timed_steps(model, names, steps, lambda name: int(torch.argmax(logits[name])), advance)
        if r:
            for name in names:
                decode[name].append(spent[name] / max(steps, 1))
    return Point(len(prompt), {n: statistics.median(v) for n, v in prefill.items()},
                 {n: statistics.median(v) for n, v in decode.items()})


def _timed_steps(model, names, steps: int, choose, advance) -> dict[str, float]:
    """Seconds each variant spends in `steps` decode steps, after WARM_STEPS untimed ones (the
    first steps grow storage and capture graphs); the variants take turns, their order swapping
    every step. `choose(name)` picks the next input (untimed), `advance(name, input)` steps."""
    spent = {name: 0.0 for name in names}
    for step in range(-WARM_STEPS, steps):
        for name in (names if step % 2 == 0 else names[::-1]):
            chosen = choose(name)
            t = time.perf_counter()
            advance(name, chosen)
            _sync(model.device)
            if step >= 0:
                spent[name] += time.perf_counter() - t
    return spent


def _batch_point(model, prompt, steps, rounds, chunk, batch, how) -> Point:
    from hebrus.session import Batch
    decode: dict[str, list[float]] = {"transactional": [], "in-place": []}
    for r in range(rounds + 1):
        first, inplace = model.session(decode="eager"), InPlaceSession(model)
        for begin in range(0, len(prompt), chunk):
            logits = first.feed(prompt[begin:begin + chunk])
            inplace.feed(prompt[begin:begin + chunk])
        together = Batch(_copies(first, batch, lambda: model.session(decode="eager")), decode=how)
        group = InPlaceBatch(_copies(inplace, batch, lambda: InPlaceSession(model)), graphs=together.decode == "graph")
        steppers = {"transactional": lambda tokens: torch.stack(together.feed(tokens)),
                    "in-place": group.feed}
        names = list(steppers)[::-1] if r % 2 else list(steppers)
        last = {name: logits.expand(batch, -1) for name in names}

        def advance(name, tokens):
            last[name] = steppers[name](tokens)

        spent = _timed_steps(model, names, steps, lambda name: torch.argmax(last[name], dim=-1).tolist(), advance)
        if r:
            for name in names:
                decode[name].append(spent[name] / max(steps, 1))
    return Point(len(prompt), None, {n: statistics.median(v) for n, v in decode.items()})


def transformers_point(folder: Path, prompt: list[int], steps: int, rounds: int, device: torch.device,
                       dtype: torch.dtype) -> dict:
    """transformers on the same checkpoint and device: seconds per prefill token (the prompt in
    one call) and per greedy decode step with its own cache, medians of `rounds` after a warm-up
    round. Returns {"error": ...} when transformers cannot run it."""
    try:
        import transformers
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    except Exception as exc:                                    # not installed, or not its format
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    ids = torch.tensor([prompt], device=device)
    # the cache's keyword: `past_key_values` until transformers 5.2x renamed it `cache`
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    prefill, decode = [], []
    with torch.inference_mode():
        for r in range(rounds + 1):
            _sync(device)
            t = time.perf_counter()
            out = hf(ids, use_cache=True)
            _sync(device)
            spent = time.perf_counter() - t
            cache, token = out[key], out.logits[:, -1:].argmax(-1)
            t = time.perf_counter()
            for _ in range(steps):
                out = hf(token, use_cache=True, **{key: cache})
                cache, token = out[key], out.logits[:, -1:].argmax(-1)
                _sync(device)
            if r:
                prefill.append(spent / len(prompt))
                decode.append((time.perf_counter() - t) / steps)
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"version": transformers.__version__, "prefill_s_per_token": statistics.median(prefill),
            "decode_s_per_step": statistics.median(decode)}


def run(model, label: str, contexts: list[int], steps: int, rounds: int, chunk: int,
        progress=None, decode: str = "auto", compare: Path | None = None, on_point=None,
        batches: tuple[int, ...] = (1,)) -> dict:
    """The measurement, as a JSON-ready dict: a point per context and batch size. `compare`: a
    checkpoint folder of the same weights to time transformers on as well (batch 1).
    `on_point(report)` sees the report after each point."""
    device = model.device
    bandwidth = copy_bandwidth(device, 2**30 if device.type == "cuda" else 2**27)
    flops = matmul_flops(device, model.dtype, 8192 if device.type == "cuda" else 1024)
    params = sum(p.numel() for _, p in model.named_parameters())
    gen = torch.Generator().manual_seed(0)
    prompts = {c: torch.randint(0, model.spec.vocab_size, (c,), generator=gen).tolist() for c in contexts}
    points = []

    def report() -> dict:
        return _report(model, label, bandwidth, flops, params, steps, rounds, chunk, decode, points)

    todo = [(c, b) for c in contexts for b in batches]
    for i, (context, batch) in enumerate(todo):
        point = _point(model, prompts[context], steps, rounds, chunk, decode, batch)
        floor = decode_bytes(model, context, batch) / bandwidth
        tx_decode, ip_decode = point.decode_s_per_step["transactional"], point.decode_s_per_step["in-place"]
        entry = {
            "context": context, "batch": batch,
            "decode_ms_per_step": tx_decode * 1e3, "decode_in_place_ms_per_step": ip_decode * 1e3,
            "decode_tokens_per_s": batch / tx_decode,
            "decode_ratio_transactional_over_in_place": tx_decode / ip_decode,
            "decode_floor_ms_per_step": floor * 1e3, "decode_fraction_of_floor": floor / tx_decode,
        }
        if point.prefill_s_per_token is not None:
            roofline = flops / prefill_flops_per_token(model, context, chunk)             # tokens per second
            tx_prefill, ip_prefill = point.prefill_s_per_token["transactional"], point.prefill_s_per_token["in-place"]
            entry.update({
                "prefill_tokens_per_s": 1 / tx_prefill, "prefill_in_place_tokens_per_s": 1 / ip_prefill,
                "prefill_ratio_transactional_over_in_place": tx_prefill / ip_prefill,
                "prefill_roofline_tokens_per_s": roofline, "prefill_fraction_of_roofline": (1 / tx_prefill) / roofline,
            })
        points.append(entry)
        if on_point is not None:
            on_point(report())
        if progress is not None:
            progress(i + 1, len(todo), f"context {context}, batch {batch}")
    if compare is not None:          # after every hebrus point: its second copy of the weights affects nothing
        for point in points:
            if point["batch"] != 1:
                continue
            hf = transformers_point(compare, prompts[point["context"]], steps, rounds, device, model.dtype)
            point["transformers"] = hf
            if "error" not in hf:
                point["prefill_speedup_over_transformers"] = hf["prefill_s_per_token"] * point["prefill_tokens_per_s"]
                point["decode_speedup_over_transformers"] = hf["decode_s_per_step"] * 1e3 / point["decode_ms_per_step"]
            if on_point is not None:
                on_point(report())
    return report()


def _report(model, label, bandwidth, flops, params, steps, rounds, chunk, decode, points) -> dict:
    device = model.device
    return {
        "model": label, "family": model.spec.family, "parameters": params, "device": _device_name(device),
        "dtype": str(model.dtype).removeprefix("torch."), "mode": model.mode, "torch": torch.__version__,
        "decode": model.session(decode=decode).decode,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": _commit(),
        "copy_bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": flops, "decode_steps": steps,
        "rounds": rounds, "prefill_chunk": chunk, "warm_decode_steps": WARM_STEPS, "points": list(points),
    }


def table(report: dict) -> str:
    """The report as a Markdown table."""
    lines = [
        f"# hebrus bench: {report['model']} ({report['family']}, {_count(report['parameters'])} parameters), "
        f"{report['device']}, {report['dtype']}, {report['mode']} mode, {report.get('decode', 'eager')} decode",
        "",
        f"{report['date']}, commit {report['commit']}, torch {report['torch']}; copy bandwidth "
        f"{report['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (read + write), matrix "
        f"{report['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s; medians of {report['rounds']} rounds, "
        f"{report['decode_steps']} decode steps, prefill in chunks of {report['prefill_chunk']}.",
        "",
    ]
    compared = any("transformers" in p for p in report["points"])
    head = ("| context | batch | prefill tok/s | tx / in-place | of roofline | decode ms/step | decode tok/s "
            "| tx / in-place | floor ms | of floor |")
    if compared:
        head += " transformers prefill tok/s | decode ms/step | speed-up prefill | decode |"
    lines += [head, "|" + " ---: |" * (head.count("|") - 1)]
    for p in report["points"]:
        prefill = (f"{p['prefill_tokens_per_s']:,.0f} | {p['prefill_ratio_transactional_over_in_place']:.3f} | "
                   f"{p['prefill_fraction_of_roofline']:.1%}" if "prefill_tokens_per_s" in p else "– | – | –")
        line = (f"| {p['context']} | {p['batch']} | {prefill} | {p['decode_ms_per_step']:.2f} | "
                f"{p.get('decode_tokens_per_s', p['batch'] * 1e3 / p['decode_ms_per_step']):,.0f} | "
                f"{p['decode_ratio_transactional_over_in_place']:.3f} | "
                f"{p['decode_floor_ms_per_step']:.3f} | {p['decode_fraction_of_floor']:.1%} |")
        hf = p.get("transformers")
        if hf is not None and "error" not in hf:
            line += (f" {1 / hf['prefill_s_per_token']:,.0f} | {hf['decode_s_per_step'] * 1e3:.2f} | "
                     f"{p['prefill_speedup_over_transformers']:.2f}x | {p['decode_speedup_over_transformers']:.2f}x |")
        elif compared:
            line += " – | – | – | – |"
        lines.append(line)
    errors = {p["transformers"]["error"] for p in report["points"] if "error" in p.get("transformers", {})}
    lines += [f"\ntransformers could not run: {e}" for e in sorted(errors)]
    return "\n".join(lines) + "\n"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def _commit() -> str:
    """The commit measured: $HEBRUS_COMMIT if set (a copied working tree's .git may be stale),
    else git's HEAD."""
    import os
    if os.environ.get("HEBRUS_COMMIT"):
        return os.environ["HEBRUS_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=5)
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
