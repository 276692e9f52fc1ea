"""A session's published image on disk: written atomically, read back whole or not at all.

A snapshot is one safetensors file: each owner's public value (a banked owner's tensor, an
appended owner's rows below the frontier) under the owner's name, and in its metadata the
format, the frontier, the session's digest and the fingerprint of the model it belongs to. It
is written to a temporary file beside the target, flushed to the disk, and renamed over it, so a
reader finds the old file or the new one, never a part. Reading checks the format, the owners
against the model's table (names, dtypes, shapes), the fingerprint, and finally the digest of
what was read against the one recorded: a file changed by a single bit is refused. Last, the
values themselves: a file that is consistent but holds what no session publishes (a frontier
past the model's context limit, NaN, a route to no expert) is refused too.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
from pathlib import Path

import torch
from safetensors.torch import save_file

from hebrus.errors import InvalidInput
from hebrus.layers.owners import FRONTIER
from hebrus.ops.quant import all_finite
from hebrus.state.image import Image, digest, tensor_bytes
from hebrus.state.owners import APPENDED
from hebrus.show import shown
from hebrus.weights.atomic import fsync
from hebrus.weights.checkpoint import SAFETENSORS_DTYPES

FORMAT = "hebrus-session/1"


def write(image: Image, path: Path, fingerprint: str, note: str | None = None) -> None:
    """The image's public record into `path`, atomically (temporary file, fsync, rename, fsync of
    the folder), with `note` (any text the caller keeps with it: `read_note`). InvalidInput if
    `path` names a folder or a folder that does not exist."""
    path = _file_path(path)
    if path.is_dir():
        raise InvalidInput(f"{path} is a directory; a session is saved to a file")
    if not path.parent.is_dir():
        raise InvalidInput(f"cannot save into {path}: {path.parent} is not a directory")
    record = image.public
    tensors = {spec.name: image.value(spec.name, record).detach().contiguous().cpu().clone() for spec in image.specs}
    metadata = {"format": FORMAT, "frontier": str(record.frontier), "digest": image.digest(),
                "fingerprint": fingerprint}
    if note is not None:
        if not isinstance(note, str) or len(json.dumps(note)) > NOTE_BYTES:     # as the header will hold it
            raise InvalidInput(f"a session's note is a str of at most {NOTE_BYTES} bytes as JSON")
        try:
            digest = hashlib.sha256(note.encode()).hexdigest()
        except UnicodeEncodeError:
            raise InvalidInput("a session's note must be text UTF-8 can hold (it has a lone surrogate)") from None
        metadata |= {"note": note, "note_sha256": digest}
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        save_file(_stored(tensors), str(temporary), metadata=metadata)
        fsync(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync(path.parent)


def read(path: Path, image: Image, fingerprint: str,
         max_context: int) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the frontier, the banked values, the appended owners' rows) from `path`, every check
    passed; InvalidInput naming the problem otherwise. Nothing is installed here. Every value is read into memory of
    its own (never a mapping of the file), so nothing done to the file afterwards can reach a
    session restored from it."""
    path = _file_path(path)
    if not path.is_file():
        raise InvalidInput(f"{path} is not a saved session (no such file)")
    try:
        with open(path, "rb") as f:
            header, base, size = _header(f, path)
            frontier = _check_header(path, header, image, fingerprint, max_context)
            values = {spec.name: _value(f, path, spec, header[spec.name], frontier, base, size)
                      for spec in image.specs}
    except OSError as exc:
        raise InvalidInput(f"{path} is not a readable saved session: {exc}") from None
    if digest(values) != header["__metadata__"].get("digest"):
        raise InvalidInput(f"{path}: its contents do not match the digest recorded with them (damaged)")
    _check_values(path, image, values, frontier)
    banked = {spec.name: values[spec.name].to(image.device) for spec in image.banked}
    return frontier, banked, {spec.name: values[spec.name] for spec in image.appended}


NOTE_BYTES = 16 << 20           # the most text a snapshot keeps beside the session
HEADER_BYTES = NOTE_BYTES + (1 << 20)       # the owners' entries take far less than the rest


def read_note(path: Path) -> str | None:
    """The note `write` kept with the session in `path` (None without one), checked against
    its hash; InvalidInput if the file is not a saved session or its note is damaged."""
    path = _file_path(path)
    if not path.is_file():
        raise InvalidInput(f"{path} is not a saved session (no such file)")
    try:
        with open(path, "rb") as f:
            metadata = _header(f, path)[0]["__metadata__"]
    except OSError as exc:
        raise InvalidInput(f"{path} is not a readable saved session: {exc}") from None
    if metadata.get("format") != FORMAT:
        raise InvalidInput(f"{path} is not a saved session of this format ({FORMAT})")
    note = metadata.get("note")
    if note is None:
        return None
    if not isinstance(note, str) or hashlib.sha256(note.encode()).hexdigest() != metadata.get("note_sha256"):
        raise InvalidInput(f"{path}: its note does not match the hash recorded with it (damaged)")
    return note


def _header(f, path: Path) -> tuple[dict, int, int]:
    """(the safetensors header, where its data begins, the file's size)."""
    size = os.fstat(f.fileno()).st_size
    length = int.from_bytes(_exactly(f, 8, path), "little")
    if length > min(HEADER_BYTES, size - 8):
        raise InvalidInput(f"{path} is not a saved session (its header claims {length} bytes)")
    try:
        header = json.loads(_exactly(f, length, path))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InvalidInput(f"{path} is not a saved session (its header is not JSON)") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise InvalidInput(f"{path} is not a saved session of this format ({FORMAT})")
    return header, 8 + length, size


def _check_header(path: Path, header: dict, image: Image, fingerprint: str, max_context: int) -> int:
    """The frontier, once the format, the model and the owners' names are this model's."""
    metadata = header["__metadata__"]
    if metadata.get("format") != FORMAT:
        raise InvalidInput(f"{path} is not a saved session of this format ({FORMAT})")
    if metadata.get("fingerprint") != fingerprint:
        raise InvalidInput(f"{path} was saved from another model (its fingerprint differs from this model's)")
    text = metadata.get("frontier")
    if not isinstance(text, str) or not (text.isascii() and text.isdigit()) or len(text) > 12:
        raise InvalidInput(f"{path}: its frontier is missing or not a number")
    frontier = int(text)
    if frontier > max_context:
        raise InvalidInput(f"{path}: the session holds {frontier} tokens, past this model's context limit of "
                           f"{max_context}")
    names, expected = set(header) - {"__metadata__"}, {spec.name for spec in image.specs}
    if names != expected:
        raise InvalidInput(f"{path}: its owners differ from this model's (missing: {sorted(expected - names)[:4]}, "
                           f"unexpected: {shown(sorted(names - expected)[:4])})")
    return frontier


def _value(f, path: Path, spec, entry, frontier: int, base: int, size: int) -> torch.Tensor:
    """One owner's value, read from the file into a tensor of its own after its dtype, shape and
    place in the file are checked against the model's owner table."""
    stored = torch.uint8 if spec.dtype == torch.float8_e4m3fn else spec.dtype
    shape = ((frontier,) if spec.kind == APPENDED else ()) + tuple(spec.shape)
    nbytes = math.prod(shape) * stored.itemsize
    ok = (isinstance(entry, dict) and entry.get("dtype") == SAFETENSORS_DTYPES[stored]
          and entry.get("shape") == list(shape))
    if not ok:
        raise InvalidInput(f"{path}: owner {spec.name} is {shown(entry.get('dtype') if isinstance(entry, dict) else entry)} "
                           f"{shown(entry.get('shape') if isinstance(entry, dict) else '')}, this model's is "
                           f"{SAFETENSORS_DTYPES[stored]} {list(shape)}")
    offsets = entry.get("data_offsets")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or offsets[1] - offsets[0] != nbytes or offsets[0] < 0 or base + offsets[1] > size):
        raise InvalidInput(f"{path}: owner {spec.name}'s data lies outside the file or is not its size")
    value = torch.empty(shape, dtype=stored)
    f.seek(base + offsets[0])
    if nbytes and f.readinto(value.view(-1).view(torch.uint8).numpy()) != nbytes:
        raise InvalidInput(f"{path}: owner {spec.name} is cut short (the file changed while it was read)")
    return value.view(spec.dtype)


def _check_values(path: Path, image: Image, values: dict[str, torch.Tensor], frontier: int) -> None:
    """What a session can publish, nothing else: the frontier owner at the frontier, every float
    finite, every id or route within its owner's limit."""
    if int(values[FRONTIER]) != frontier:
        raise InvalidInput(f"{path}: its frontier owner says {int(values[FRONTIER])}, its rows {frontier}")
    for spec in image.specs:
        value = values[spec.name]
        if not all_finite(value):
            raise InvalidInput(f"{path}: owner {spec.name} holds NaN or infinite values; a session never publishes "
                               f"them")
        if spec.limit is not None and value.numel() and not (0 <= int(value.min()) and int(value.max()) < spec.limit):
            raise InvalidInput(f"{path}: owner {spec.name} holds values outside [0, {spec.limit}): "
                               f"{int(value.min())} to {int(value.max())}")


def _file_path(path) -> Path:
    """`path` as a Path a file can have; InvalidInput for anything else (a number, a NUL byte)."""
    try:
        path = Path(path)
        path.exists()
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"a saved session is a file path, got {shown(path)} ({exc})") from None
    return path


def _exactly(f, count: int, path: Path) -> bytes:
    data = f.read(count)
    if len(data) != count:
        raise InvalidInput(f"{path} is not a saved session (it ends after {f.tell()} bytes)")
    return data


def model_fingerprint(model) -> str:
    """SHA-256 over the model's owner table and every weight's name, dtype, shape and bytes:
    a saved session restores only into a model that computes with the same weights."""
    h = hashlib.sha256()
    for spec in model.owners:
        h.update(f"{spec.name}|{spec.kind}|{spec.dtype}|{spec.shape}|".encode())
    for name, p in sorted(model.named_parameters()):
        h.update(f"{name}|{p.dtype}|{tuple(p.shape)}|".encode())
        h.update(tensor_bytes(p))
    for name, table in sorted(model.paged.items()):
        h.update(f"{name}|paged|{table.dtype}|{table.shape}|".encode())
        h.update(tensor_bytes(table.source.read(0, table.rows)))
    return h.hexdigest()


def _stored(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors has no fp8-agnostic path for every dtype here: fp8 rows go as their bytes."""
    return {name: (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t) for name, t in tensors.items()}
