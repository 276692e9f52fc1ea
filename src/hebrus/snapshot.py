"""A session's published image on disk: written atomically, read back whole or not at all.

A snapshot is one safetensors file: each owner's public value (a banked owner's tensor, an
appended owner's rows below the frontier) under the owner's name, and in its metadata the
format, the frontier, the session's digest and the fingerprint of the model it belongs to. It
is written to a temporary file beside the target, flushed to the disk, and renamed over it, so a
reader finds the old file or the new one, never a part. Reading checks the format, the owners
against the model's table (names, dtypes, shapes), the fingerprint, and finally the digest of
what was read against the one recorded: a file changed by a single bit is refused.
"""
from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hebrus.errors import InvalidInput
from hebrus.state.image import Image, Published, tensor_bytes
from hebrus.state.owners import APPENDED
from hebrus.weights.atomic import fsync

FORMAT = "hebrus-session/1"


def write(image: Image, path: Path, fingerprint: str) -> None:
    """The image's public record into `path`, atomically (temporary file, fsync, rename, fsync of
    the folder). InvalidInput if `path` names a folder or a folder that does not exist."""
    path = Path(path)
    if path.is_dir():
        raise InvalidInput(f"{path} is a directory; a session is saved to a file")
    if not path.parent.is_dir():
        raise InvalidInput(f"cannot save into {path}: {path.parent} is not a directory")
    record = image.public
    tensors = {spec.name: image.value(spec.name, record).detach().contiguous().cpu().clone() for spec in image.specs}
    metadata = {"format": FORMAT, "frontier": str(record.frontier), "digest": image.digest(),
                "fingerprint": fingerprint}
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        save_file(_stored(tensors), str(temporary), metadata=metadata)
        fsync(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync(path.parent)


def read(path: Path, image: Image, fingerprint: str) -> tuple[Published, dict[str, torch.Tensor], str]:
    """(the record to publish, the banked values, the recorded digest) from `path`, every check
    passed; InvalidInput naming the problem otherwise. Nothing is installed here."""
    path = Path(path)
    if not path.is_file():
        raise InvalidInput(f"{path} is not a saved session (no such file)")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            names = set(f.keys())
            tensors = {name: f.get_tensor(name) for name in names}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise InvalidInput(f"{path} is not a readable saved session: {exc}") from None
    if metadata.get("format") != FORMAT:
        raise InvalidInput(f"{path} is not a saved session of this format ({FORMAT})")
    if metadata.get("fingerprint") != fingerprint:
        raise InvalidInput(f"{path} was saved from another model (its fingerprint differs from this model's)")
    try:
        frontier = int(metadata["frontier"])
    except (KeyError, ValueError):
        raise InvalidInput(f"{path}: its frontier is missing or not a number") from None
    expected = {spec.name for spec in image.specs}
    if names != expected:
        raise InvalidInput(f"{path}: its owners differ from this model's (missing: {sorted(expected - names)[:4]}, "
                           f"unexpected: {sorted(names - expected)[:4]})")
    banked, storages = {}, []
    for spec in image.specs:
        t = _loaded(tensors[spec.name], spec.dtype)
        shape = ((frontier,) if spec.kind == APPENDED else ()) + tuple(spec.shape)
        if t.dtype != spec.dtype or tuple(t.shape) != shape:
            raise InvalidInput(f"{path}: owner {spec.name} is {str(t.dtype).removeprefix('torch.')} "
                               f"{tuple(t.shape)}, this model's is {str(spec.dtype).removeprefix('torch.')} {shape}")
        if spec.kind == APPENDED:
            storages.append(t.to(image.device))
        else:
            banked[spec.name] = t.to(image.device)
    return Published(bank=0, frontier=frontier, storages=tuple(storages)), banked, metadata.get("digest", "")


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


def _loaded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(dtype) if dtype == torch.float8_e4m3fn and t.dtype == torch.uint8 else t
