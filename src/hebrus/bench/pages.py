"""`hebrus bench --ple-pages`: decoding with per-layer-embedding tables served in pages from the
checkpoint file, against the same tables resident on the device.

The model is the `small` preset's shape with n-gram tables enlarged to the requested size, in a
checkpoint written as a sparse file: every tensor zero except the hash constants (real ones, so
n-grams spread over the tables as they would), so gigabytes of tables cost neither disk nor
time to write. Both variants prefill the same English text and then step through its next bytes
one token at a time (a chat-like stream: the n-grams repeat as language does), taking turns.
Reported: decode tokens/s of each, paged over resident, the page hit rate, and the bytes moved
from the file per token. Both run eagerly (a paged model has no planned or captured decode
step yet); beside them, the resident model's own best decode route, for scale.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from hebrus.bench.limits import sync
from hebrus.models.hebrus import HebrusConfig, preset
from hebrus.models.layout import parameter_shapes

TEXT = (b"Good morning. Could you tell me how the weather will be this afternoon? I would like to walk to "
        b"the market and back before it rains, and buy some bread, some cheese and a few apples. If it rains "
        b"I will take the bus instead, or stay at home and read the book you gave me last week. Thank you, "
        b"and have a good day. ")


def paged_config(table_bytes: float) -> HebrusConfig:
    """The small shape with two n-gram tables that hold `table_bytes` together in bf16."""
    base = preset("small")
    width = base.num_layers * base.ple_dim
    rows = max(1, int(table_bytes / 2 / (width * 2)))
    return base.replace(ple_buckets=(rows, rows))


def sparse_checkpoint(folder: Path, config: HebrusConfig, stored: str = "BF16") -> Path:
    """A checkpoint of `config` whose tensors are all zero (stored as `stored`, a safetensors
    dtype of 2 or 4 bytes) but the PLE hash constants, written as a sparse file (no data blocks
    for the zeros); kept and reused if already there."""
    folder = Path(folder)
    weights = folder / "model.safetensors"
    if (folder / "config.json").exists() and weights.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    real = {"ple.hash_constants": config.init_parameters()["ple.hash_constants"]}
    header, at, placed = {}, 0, {}
    for name, shape in sorted(parameter_shapes(config.spec()).items()):
        dtype, size = ("I64", 8) if name in real else (stored, 4 if stored == "F32" else 2)
        nbytes = math.prod(shape) * size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        placed[name] = at
        at += nbytes
    header["__metadata__"] = {"format": "hebrus"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(weights, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, tensor in real.items():
            f.seek(8 + len(text) + placed[name])
            f.write(tensor.contiguous().numpy().tobytes())
        f.truncate(8 + len(text) + at)
    (folder / "config.json").write_text(json.dumps(config.to_dict(), indent=1) + "\n")
    return folder


def run(folder: Path, device: torch.device, dtype: torch.dtype, cache_bytes: int, prompt: int, steps: int,
        rounds: int) -> dict:
    import hebrus
    stream = list((TEXT * (1 + (prompt + steps) // len(TEXT)))[:prompt + steps])
    resident = hebrus.load(folder, device=device, dtype=dtype, mode="fast")
    paged = hebrus.load(folder, device=device, dtype=dtype, mode="fast", ple_cache_bytes=cache_bytes)
    models = {"resident": resident, "paged": paged, "resident, planned": resident}
    decode = {"resident": "eager", "paged": "eager", "resident, planned": "auto"}
    tables = list(models["paged"].paged.values())
    seconds = {name: [] for name in models}
    counted = dict(hits=0, misses=0, direct=0, moved=0, tokens=0)
    for r in range(rounds + 1):                  # round 0 warms up, untimed
        sessions = {name: m.session(decode=decode[name]) for name, m in models.items()}
        for s in sessions.values():
            s.prefill(stream[:prompt], chunk_size=256)
        before = [(t.hits, t.misses, t.direct) for t in tables]
        for name in (list(models) if r % 2 else list(models)[::-1]):
            sync(device)
            started = time.perf_counter()
            for token in stream[prompt:]:
                sessions[name].feed([token])
            sync(device)
            if r:
                seconds[name].append((time.perf_counter() - started) / steps)
        if r:
            for t, (h, m, d) in zip(tables, before):
                counted["hits"] += t.hits - h
                counted["misses"] += t.misses - m
                counted["direct"] += t.direct - d
                counted["moved"] += (t.misses - m) * t.page_rows * t.width * t.dtype.itemsize
            counted["tokens"] += steps
    median = {name: sorted(v)[len(v) // 2] for name, v in seconds.items()}
    lookups = counted["hits"] + counted["misses"] + counted["direct"]
    return {
        "ple_table_bytes": sum(t.host_bytes for t in tables), "cache_bytes": sum(t.device_bytes for t in tables),
        "page_rows": tables[0].page_rows, "prompt": prompt, "steps": steps, "rounds": rounds,
        "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "resident_tokens_per_s": 1 / median["resident"], "paged_tokens_per_s": 1 / median["paged"],
        "resident_planned_tokens_per_s": 1 / median["resident, planned"],
        "resident_planned_decode": sessions["resident, planned"].decode,
        "paged_over_resident": median["resident"] / median["paged"],
        "page_hit_rate": counted["hits"] / lookups if lookups else None,
        "pages_read_directly": counted["direct"],
        "bytes_moved_per_token": counted["moved"] / counted["tokens"] if counted["tokens"] else 0.0,
    }


def table(r: dict) -> str:
    hit = "–" if r["page_hit_rate"] is None else f"{r['page_hit_rate']:.1%}"
    return ("| PLE tables | cache | resident tok/s | paged tok/s | paged ÷ resident | page hit rate "
            f"| bytes moved per token | resident, {r['resident_planned_decode']} decode, tok/s |\n"
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
            f"| {r['ple_table_bytes'] / 2**30:.2f} GiB | {r['cache_bytes'] / 2**20:.0f} MiB | "
            f"{r['resident_tokens_per_s']:,.1f} | {r['paged_tokens_per_s']:,.1f} | {r['paged_over_resident']:.3f} | "
            f"{hit} | {r['bytes_moved_per_token']:,.0f} | {r['resident_planned_tokens_per_s']:,.1f} |\n")
