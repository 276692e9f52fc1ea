"""Save Hebrus checkpoints, and load checkpoints of every family: `config.json` +
`model.safetensors` (or shards listed in `model.safetensors.index.json`).

Loading treats the folder as untrusted input: the config is type- and range-checked and its
allocation bounded before any weights file is opened; every tensor's name, shape and dtype are
checked from the safetensors headers before any data is read. Every problem with the files
raises one `CheckpointError` naming the file; a weight that does not fit the requested dtype is
an `InvalidInput` naming the weight. Saving writes a new folder and swaps it in (`atomic`): the folder then holds exactly the saved
model (with its own tokenizer and template, when it came from a folder that has them).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any, BinaryIO, Callable, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hebrus.errors import CheckpointError, InvalidInput
from hebrus.show import escaped, shown
from hebrus.weights.atomic import check_replaceable, fsync, replace_folder
from hebrus.weights.files import folder_path, is_shard_name, read_json, regular_file
from hebrus.ops.quant import all_finite
from hebrus.weights.pages import FileRows

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_READ_ERRORS = (SafetensorError, OSError, RuntimeError, ValueError, TypeError)


class Header(NamedTuple):
    """One tensor as a safetensors header describes it."""
    file: str
    dtype: str
    shape: tuple[int, ...]


# What loading a checkpoint may allocate, from its config alone (`models.layout.load_bytes`), at
# most: this constant, and the memory of the machine it loads onto. 1 TiB is above any checkpoint
# one machine holds; raise it on purpose for more.
MAX_LOAD_BYTES = 2**40


# ---- save ---------------------------------------------------------------------------------

def save(path: str | Path, config: Any, params: dict[str, torch.Tensor], quantization=None, *,
         overwrite: bool = False, companions: Path | None = None) -> Path:
    """Write a checkpoint into the folder `path`, in one step. A folder that holds anything is
    refused unless `overwrite`, and is then replaced whole: it holds exactly this checkpoint.
    `config`: the family's config, written as its `to_dict()` says.
    InvalidInput (nothing changed) if `path` cannot be such a folder. `quantization` (a
    `weights.quant.Quantization`): the params hold quantized weights' parts, and config.json says
    how (`quantization_config`). `companions`: the folder the model came from, whose tokenizer,
    chat template and generation config (`COMPANIONS`) go with it."""
    target = writable_target(path, overwrite)
    tensors = {name: t.detach().contiguous().cpu() for name, t in params.items()}
    data = config.to_dict() | _token_keys(companions)
    if quantization is not None:
        data["quantization_config"] = quantization.to_config()

    def write(folder: Path) -> None:
        _write_text(folder / CONFIG, json.dumps(data, indent=2) + "\n")
        save_file(tensors, str(folder / WEIGHTS), metadata={"format": "hebrus"})
        os.chmod(folder / WEIGHTS, 0o644)
        fsync(folder / WEIGHTS)
        for name in _companions(companions):
            shutil.copyfile(companions / name, folder / name)
            fsync(folder / name)

    try:
        replace_folder(target, write, overwrite)
    except OSError as exc:
        if exc.errno not in _PATH_ERRORS:
            raise
        raise InvalidInput(f"cannot save into {path}: {exc.strerror}") from None
    return Path(path)


# What a checkpoint folder holds beside the weights that belongs to the model: its text.
COMPANIONS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
              "generation_config.json")


def _token_keys(folder: Path | None) -> dict[str, Any]:
    """The special token ids the source folder's config.json names (its stop ids may come from
    there), carried into the saved config: ints or lists of ints, nothing else."""
    if folder is None or not (folder / CONFIG).is_file():
        return {}
    data = read_json(folder / CONFIG)
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")

    def ids(value) -> bool:
        items = value if isinstance(value, list) else [value]
        return all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31 for i in items)
    return {k: data[k] for k in keys if isinstance(data, dict) and k in data and ids(data[k])}


def _companions(folder: Path | None) -> list[str]:
    if folder is None:
        return []
    return [name for name in COMPANIONS if (folder / name).is_file()]


def writable_target(path, overwrite: bool = False) -> Path:
    """The real folder a save of `path` writes, once it may: new, empty, or (with `overwrite`) a
    folder of plain files to replace. InvalidInput otherwise, naming what is there."""
    if type(overwrite) is not bool:
        raise InvalidInput(f"overwrite must be True or False, got {shown(overwrite)}")
    target = _save_target(path)
    try:
        names = check_replaceable(target)
    except OSError as exc:
        if exc.errno not in _PATH_ERRORS:
            raise
        raise InvalidInput(f"cannot save into {path}: {exc.strerror}") from None
    if names and not overwrite:
        held = [n for n in names if n in (CONFIG, WEIGHTS, INDEX) or n.endswith(".safetensors")]
        what = f"already holds a model ({', '.join(held[:4])})" if held else f"is not empty ({', '.join(names[:4])})"
        raise InvalidInput(f"{path} {what}; a save replaces the whole folder with the model it writes: pass "
                           f"overwrite=True (hebrus quantize --force) to replace it, or name a new folder")
    return target


# Errors that say the path itself cannot be a folder; others (a full disk, no permission) stay OSError.
_PATH_ERRORS = {errno.ENAMETOOLONG, errno.ENOTDIR, errno.ELOOP, errno.EINVAL}


def _save_target(path) -> Path:
    """The real folder a save replaces. Not the working directory or a folder holding it: the
    swap would leave the process in a deleted folder."""
    target = Path(os.path.realpath(folder_path(path, "the checkpoint folder")))
    cwd = Path(os.path.realpath(os.getcwd()))
    if cwd == target or target in cwd.parents:
        raise InvalidInput(f"{path} is (or holds) the working directory; save replaces the whole folder, "
                           f"so save into a folder of its own")
    return target


def _write_text(file: Path, text: str) -> None:
    with open(file, "x", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# ---- load ---------------------------------------------------------------------------------

class Loaded(NamedTuple):
    family: Any                     # the module in hebrus.models that read it
    config: Any                     # the family's checked config
    spec: Any                       # the family's `layers.spec.ModelSpec`
    params: dict[str, torch.Tensor]


def _read_family_config(folder: Path, family_of):
    file = folder / CONFIG
    if not os.path.lexists(file):
        raise CheckpointError(f"{file} is missing: {folder} is not a checkpoint")
    data = read_json(file)
    try:
        family = family_of(data)
        return family, family.config(data), _quantization(data)
    except InvalidInput as exc:
        raise CheckpointError(f"{file}: {exc}") from None


def _quantization(data: Any):
    """The config's `quantization_config` (weights stored quantized), or None."""
    if not isinstance(data, dict) or data.get("quantization_config") is None:
        return None
    from hebrus.weights.quant import Quantization
    return Quantization.from_config(data["quantization_config"])


def load(path: str | Path, family_of: Callable[[Any], Any],
         place: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
         progress: Callable[[int, int], None] | None = None,
         dtype_of: Callable[[str], torch.dtype] | None = None, *, dtype: torch.dtype = torch.float32,
         device: torch.device = torch.device("cpu"),
         stream: Callable[[str], torch.dtype | None] | None = None, layout: Any,
         split: Callable[[Any], tuple[Any, Callable[[str, torch.Tensor], torch.Tensor]]] | None = None) -> Loaded:
    """Read and check a checkpoint of the family `family_of(parsed config.json)` gives (a module
    of hebrus.models: config, spec, names table). Each of the model's tensors is built
    from its file tensors, handed to `place` (default: kept as built, on the CPU) and only then is
    the next one read, so a load holds the placed model plus one tensor's sources at a time.
    `progress(done, total)` is called after each tensor. With `dtype_of(name)`, a tensor stored
    as it is used is read in slices straight into a buffer of that dtype. The config is refused
    first if a model of it in `dtype` would not fit the memory of `device` (`memory_limit`).
    `stream(name)`: for a two-dimensional tensor stored as the model uses it, a dtype means "leave
    it in its file": it comes back as a `weights.pages.FileRows` reading rows in that dtype.
    `layout` says what a spec stores (`hebrus.models.layout`: parameter_shapes, float_shapes,
    quantized, load_bytes): this module knows no family and no layer.
    `split(spec)` -> (the spec of what is held, `cut(name, tensor)`): each tensor is cut to the
    part held (one rank's of a model over ranks, `layers.shard.weight_parts`) before it is
    placed, so a load holds the parts plus one whole tensor at a time; the memory check and the
    `Loaded` spec are the part's, and `dtype_of` is not taken with it (no buffer is made whole)."""
    folder = Path(path)
    identity = _identity(folder)
    family, config, quantization = _read_family_config(folder, family_of)
    try:
        spec = family.spec(config).replace(quantization=quantization)
    except InvalidInput as exc:
        raise CheckpointError(f"{folder / CONFIG}: {exc}") from None
    place = place or (lambda name, t: t)
    held = spec
    if split is not None:
        held, cut = split(spec)
        place, dtype_of = (lambda name, t, whole=place: whole(name, cut(name, t))), None
    _check_allocation(layout.load_bytes, held, dtype, device, folder / CONFIG, stream)
    params = _read_weights(family, layout, spec, folder, place, progress, dtype_of, stream)
    if _identity(folder) != identity:
        raise CheckpointError(f"{folder}: was replaced while it was being read (a save into it?); "
                              f"load it again")
    return Loaded(family, config, held, params)


def _read_weights(family, layout, spec, folder: Path, place, progress, dtype_of, stream=None) -> dict:
    """Every file checked to be regular before any is opened; every header checked before any
    tensor data is read."""
    source, weight_map = _listing(folder)
    files = sorted(set(weight_map.values())) if weight_map is not None else [WEIGHTS]
    for name in files:
        regular_file(folder / name)
    with ExitStack() as stack:
        handles = {name: stack.enter_context(_open(folder / name)) for name in files}
        headers = _headers(handles, folder, source, weight_map)
        table = family.names(spec, set(headers))
        if spec.quantization is not None:
            from hebrus.weights.quant import quantized_table, restrict_dtypes
            if not any(n.endswith(".qscale") for n in table.sources):       # a foreign family's files
                try:
                    table = quantized_table(table, spec.quantization, layout.float_shapes(spec),
                                            layout.quantized(spec), set(headers))
                except InvalidInput as exc:
                    raise CheckpointError(f"{source}: {exc}") from None
            restrict_dtypes(table, spec.quantization)
        _check_against(table, headers, source)
        offsets = {file: _data_offsets(folder / file) for file in files}
        raw = {file: stack.enter_context(open(folder / file, "rb")) for file in files}   # one open per file

        def read(n: str, into: torch.Tensor | None = None) -> torch.Tensor:
            return _tensor(raw[headers[n].file], folder / headers[n].file, n, headers[n], offsets[headers[n].file],
                           into)

        # Every final buffer first, then the reads: transient buffers then come after them and are
        # reused, instead of freed memory staying trapped between long-lived tensors.
        shapes = layout.parameter_shapes(spec)

        def in_file(name: str, recipe) -> torch.dtype | None:
            into = stream(name) if stream is not None else None
            if into is None or not recipe.is_copy or len(recipe.names) != 1 or len(headers[recipe.names[0]].shape) != 2:
                return None
            return into

        finals = {name: torch.empty(shapes[name], dtype=dtype_of(name)) for name, recipe in table.sources.items()
                  if dtype_of is not None and dtype_of(name) is not None and in_file(name, recipe) is None}
        params = {}
        for name, recipe in table.sources.items():
            into = in_file(name, recipe)
            if into is not None:            # left in its file, read a page at a time
                n = recipe.names[0]
                file = headers[n].file
                params[name] = FileRows(folder / file, offsets[file][n][0], headers[n].shape,
                                        _TORCH_DTYPES[headers[n].dtype], into)
                if progress is not None:
                    progress(len(params), len(table.sources))
                continue
            final = finals.pop(name, None)
            if final is not None and (recipe.is_copy or recipe.part is not None):
                for i, n in enumerate(recipe.names):
                    read(n, final if recipe.is_copy else recipe.part(final, i))
            else:
                parts = [read(n) for n in recipe.names]
                built = recipe.build(*parts)
                del parts
                if final is not None:
                    converted(final, built, name)
                    del built
            params[name] = place(name, final if final is not None else built)
            if progress is not None:
                progress(len(params), len(table.sources))
        return params


def _identity(folder: Path) -> tuple[int, int]:
    try:
        info = os.stat(folder)
    except OSError as exc:
        raise CheckpointError(f"{folder}: cannot be read ({exc})") from None
    return info.st_dev, info.st_ino


def memory_limit(device: torch.device) -> int:
    """What a load may take: MAX_LOAD_BYTES, and no more than the device's memory (the
    machine's physical memory for the CPU)."""
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(MAX_LOAD_BYTES, memory)


def _check_allocation(load_bytes, spec, dtype: torch.dtype, device: torch.device, file: Path, stream=None) -> None:
    need, limit = load_bytes(spec, dtype, skip=stream and (lambda n: stream(n) is not None)), memory_limit(device)
    if need > limit:
        raise CheckpointError(f"{file}: loading this config in {str(dtype).removeprefix('torch.')} would allocate "
                              f"up to {need / 2**30:.1f} GiB (the parameters, the largest tensor twice at 8 "
                              f"bytes, the rotary tables for max_context={spec.max_context}); the limit is "
                              f"{limit / 2**30:.1f} GiB: MAX_LOAD_BYTES = {MAX_LOAD_BYTES / 2**30:.0f} GiB "
                              f"(hebrus.weights.checkpoint) or the memory of {device}, whichever is less")


def _listing(folder: Path) -> tuple[Path, dict[str, str] | None]:
    """(the file that lists the tensors, the index's weight map, or None for a single file)."""
    has_index, has_single = os.path.lexists(folder / INDEX), os.path.lexists(folder / WEIGHTS)
    if has_index and has_single:
        raise CheckpointError(f"{folder / WEIGHTS}: the folder also holds {INDEX}; a checkpoint is one "
                              f"file or an index of shards, not both")
    if has_index:
        return folder / INDEX, _weight_map(folder / INDEX)
    if has_single:
        return folder / WEIGHTS, None
    raise CheckpointError(f"{folder}: has neither {WEIGHTS} nor {INDEX}")


def _weight_map(index: Path) -> dict[str, str]:
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f'{index}: needs "weight_map", an object {{tensor name: shard file name}}; '
                              f"got {shown(data)}")
    for name, shard in weight_map.items():
        if not is_shard_name(shard):
            raise CheckpointError(f"{index}: {shown(name)} maps to {shown(shard)}; a shard must be a file "
                                  f"name inside the checkpoint folder (no '/', '\\' or '..', not an "
                                  f"absolute path)")
    return weight_map


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt")
    except _READ_ERRORS as exc:
        raise CheckpointError(f"{file}: is not a readable safetensors file ({exc})") from None


def _headers(handles: dict[str, Any], folder: Path, source: Path,
             weight_map: dict[str, str] | None) -> dict[str, Header]:
    """Every tensor's header, checked against the index: each tensor in exactly one shard, the one
    its index entry names."""
    found: dict[str, list[Header]] = {}
    for file, handle in handles.items():
        for name, header in _file_headers(handle, file, folder / file):
            found.setdefault(name, []).append(header)
    if weight_map is not None:
        _check_placement(found, weight_map, source)
    return {name: headers[0] for name, headers in found.items()}


def _file_headers(handle: Any, file: str, path: Path) -> list[tuple[str, Header]]:
    try:
        slices = [(name, handle.get_slice(name)) for name in handle.keys()]
        return [(name, Header(file, part.get_dtype(), tuple(part.get_shape()))) for name, part in slices]
    except _READ_ERRORS as exc:
        raise CheckpointError(f"{path}: has an unreadable safetensors header ({exc})") from None


def _check_placement(found: dict[str, list[Header]], weight_map: dict[str, str], index: Path) -> None:
    problems = []
    for name, headers in sorted(found.items()):
        files = [h.file for h in headers]
        if len(files) > 1:
            problems.append(f"{name} is in both {' and '.join(files)}")
        elif name not in weight_map:
            problems.append(f"{name} is in {files[0]}, but the index does not list it")
        elif weight_map[name] != files[0]:
            problems.append(f"{name} is in {files[0]}, but the index names {weight_map[name]}")
    for name, file in sorted(weight_map.items()):
        if file not in [h.file for h in found.get(name, [])]:
            problems.append(f"the index names {name} in {file}, which does not hold it")
    if problems:
        raise CheckpointError(f"{index}: does not match its shards: " + "; ".join(_first(problems)))


def _check_against(table, headers: dict[str, Header], source: Path) -> None:
    """Names, shapes and dtypes against the family's names table, before any data is read."""
    expected = table.shapes
    present = {name for name in headers if not table.ignored(name)}
    missing = sorted(expected.keys() - present)
    unexpected = sorted(present - expected.keys())
    common = sorted(expected.keys() & present)
    shapes = [f"{n}: {headers[n].shape} (expected {expected[n]})"
              for n in common if headers[n].shape != expected[n]]
    dtypes = [f"{n}: {headers[n].dtype} (allowed: {', '.join(table.dtypes(n))})"
              for n in common if headers[n].dtype not in table.dtypes(n)]
    problems = [f"{title}: {', '.join(_first(items))}" for title, items in
                (("missing tensors", missing), ("unexpected tensors", unexpected),
                 ("wrong shapes", shapes), ("wrong dtypes", dtypes)) if items]
    if problems:
        raise CheckpointError(f"{source}: does not match its config ({CONFIG}): " + " | ".join(problems))


# safetensors dtype names as torch dtypes (the ones a header may pass `_check_against` with).
_TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
                 "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                 "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "F8_E4M3": torch.float8_e4m3fn}
SAFETENSORS_DTYPES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}     # torch dtype -> header name


def _data_offsets(file: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's byte range in `file` (safetensors: an 8-byte header length, the JSON header,
    then the data). safe_open has already checked the header; this only reads where data lies."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    base = 8 + length
    return {name: (base + entry["data_offsets"][0], base + entry["data_offsets"][1])
            for name, entry in header.items() if name != "__metadata__"}


_SLICE = 16 * 2**20          # bytes read at a time when converting on the way in


def converted(target: torch.Tensor, source: torch.Tensor, name: str) -> None:
    """`source` copied into `target` (whose dtype may be narrower); a finite weight that does not
    fit the target dtype (1e5 in float16) would turn every chunk non-finite: InvalidInput."""
    target.copy_(source)
    if not all_finite(target):
        raise InvalidInput(f"weight {name} does not fit in {target.dtype} (largest magnitude "
                           f"{float(source.double().abs().max()):.3g}); load the model in a wider dtype")


def _tensor(f: BinaryIO, file: Path, name: str, header: Header, offsets: dict[str, tuple[int, int]],
            out: torch.Tensor | None = None) -> torch.Tensor:
    """One tensor, read straight into a buffer (no file mapping: a load holds the model and the
    tensor in hand, not the file's pages too): `out` when given, whose dtype may differ (the
    file is then read in slices converted as they arrive), else a buffer of its own."""
    begin, end = offsets[name]
    stored = _TORCH_DTYPES[header.dtype]
    if out is None:
        out = torch.empty(header.shape, dtype=stored)
    elif tuple(out.shape) != header.shape:
        raise CheckpointError(f"{file}: tensor {name} has shape {header.shape}, not the model's {tuple(out.shape)}")
    into = out.dtype
    flat = out.view(-1)
    width = stored.itemsize
    step = max(_SLICE // width, 1) if into != stored else max(flat.numel(), 1)
    staging = torch.empty(min(step, flat.numel()) * width, dtype=torch.uint8) if into != stored else None
    try:
        f.seek(begin)
        for at in range(0, flat.numel(), step):
            count = min(step, flat.numel() - at)
            target = flat[at:at + count]
            buffer = target.view(torch.uint8) if staging is None else staging[:count * width]
            got = f.readinto(buffer.numpy())
            if got != count * width:
                raise CheckpointError(f"{file}: tensor {name} is cut short: the file is truncated")
            if staging is not None:
                source = buffer.view(stored)
                _check_finite(source, file, name)
                converted(target, source, name)
    except OSError as exc:
        raise CheckpointError(f"{file}: tensor {name} cannot be read ({exc})") from None
    if into == stored:
        _check_finite(out, file, name)
    return out


def _check_finite(tensor: torch.Tensor, file: Path, name: str) -> None:
    if not all_finite(tensor):
        raise CheckpointError(f"{file}: tensor {name} holds NaN or infinite values; weights must be finite")


def _first(items: list[str], count: int = 8) -> list[str]:
    """The first `count` items, each cut to 200 characters (names come from untrusted files)."""
    cut = [escaped(item if len(item) <= 200 else item[:200] + "...", lines=False) for item in items[:count]]
    return cut + ([f"... ({len(items) - count} more)"] if len(items) > count else [])
