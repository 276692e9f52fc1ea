"""How long reading a journal takes when its tail is hostile: `journal.read` (what
`model.recover` reads first) over a journal of a few records followed by `--tail-mib` MiB of
0x01 bytes, of random bytes, or of forged format 3 record heads (each with a valid head CRC,
claiming the longest record the context allows), and over a whole journal of that size (records
of 1,000 ids). Each time is the best of `--rounds`; the bytes checksummed are counted.
    python benchmarks/journal_scan.py [--tail-mib 64] [--rounds 3] [--out FILE]"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import hebrus
from hebrus import journal
from hebrus.errors import InvalidInput

parser = argparse.ArgumentParser()
parser.add_argument("--tail-mib", type=int, default=64)
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--out", default=None)
args = parser.parse_args()
model = hebrus.load("tiny")
fingerprint, limit = model.fingerprint, model.spec.max_context
size = args.tail_mib << 20
form = journal.FORMAT_3
head = [(0, list(range(5)), 5, False), (5, list(range(9)), 9, False)]
forged = form.head(start=14, count=limit, kept=limit, prefix=False)
records = [(1000 * i, [i % 256] * 1000, 1000, False) for i in range(size // 4033)]
cases = {"tail of 0x01": form.encode(fingerprint, head) + b"\x01" * size,
         "tail of random bytes": form.encode(fingerprint, head) + os.urandom(size),
         "tail of forged heads": form.encode(fingerprint, head) + forged * (size // len(forged)),
         "whole records": form.encode(fingerprint, records)}
checksummed = [0]
crc = journal._crc


def counting(view, value=0):
    checksummed[0] += len(view)
    return crc(view, value)


journal._crc = counting
rows = []
with tempfile.TemporaryDirectory() as folder:
    path = Path(folder) / "journal"
    for name, data in cases.items():
        path.write_bytes(data)
        times = []
        for _ in range(args.rounds):
            checksummed[0] = 0
            started = time.perf_counter()
            try:
                found, _, _ = journal.read(path, fingerprint, limit)
                outcome = f"{len(found)} records"
            except InvalidInput as exc:
                outcome = "refused: " + str(exc).split(": ", 1)[1][:60]
            times.append(time.perf_counter() - started)
        rows.append({"case": name, "file_mib": round(len(data) / 2**20, 1), "seconds": round(min(times), 3),
                     "checksummed_mib": round(checksummed[0] / 2**20, 2), "outcome": outcome})
        print(json.dumps(rows[-1]))
if args.out:
    Path(args.out).write_text(json.dumps({"max_context": limit, "rows": rows}, indent=1) + "\n")
