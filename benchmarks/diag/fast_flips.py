"""Which part of the CUDA fast table moved the three GPU tests that failed at 3858b57 (graph decode
of the tiny bfloat16 model against eager, the shakespeare prefix transaction in bfloat16 against
its twin, the tiny fp8 model's batch fault checks): each runs again with one part put back to its
twin, in a process of its own (the fuser is process-wide), so a near-tie flipped by rounding is
told from a wrong kernel.

Variants: `sinkhorn-twin` (the Sinkhorn rounds as `ops.hyper.sinkhorn`, every op still fused),
`unfused` (HEBRUS_FUSE=0 and the Sinkhorn twin: no compiled op, no Triton Sinkhorn).

    python benchmarks/diag/fast_flips.py [--variants sinkhorn-twin,unfused] [--out DIR]

Writes DIR/fast-flips-VARIANT.txt (pytest's short report) and prints each variant's last line."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

TESTS = ("graph_decode_matches_eager or (prefix_transaction_on_cuda and bfloat16) "
         "or (quantized_model_verifies and fp8)")
SINKHORN_TWIN = ("import hebrus.ops.cuda.sinkhorn as k, hebrus.ops.hyper as h; k.sinkhorn = h.sinkhorn; "
                 "import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))")
PYTEST = "import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))"
VARIANTS = {"sinkhorn-twin": (SINKHORN_TWIN, {}), "unfused": (SINKHORN_TWIN, {"HEBRUS_FUSE": "0"}),
            "as-is": (PYTEST, {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="sinkhorn-twin,unfused",
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default sinkhorn-twin,unfused)")
    parser.add_argument("--out", default="/tmp", help="folder for the reports (default /tmp)")
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for name in names:
        code, env = VARIANTS[name]
        run = subprocess.run([sys.executable, "-c", code, "-q", "-rfE", "--tb=line", "-p", "no:logging", "-W", "ignore",
                              "tests/test_cuda.py", "-k", TESTS], env={**os.environ, **env},
                             capture_output=True, text=True)
        text = run.stdout + run.stderr
        (Path(args.out) / f"fast-flips-{name}.txt").write_text(text)
        last = [line for line in text.splitlines() if line.strip()][-1:] or ["(no output)"]
        print(f"{name}: {last[0]}", flush=True)


if __name__ == "__main__":
    main()
