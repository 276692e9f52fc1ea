#!/usr/bin/env bash
# The recipe on the device machine, from the repository root, with recipes/shakespeare/data carried:
#   bash recipes/shakespeare/device.sh hebrus [MINUTES]     # the model; its checkpoint comes back split
#   bash recipes/shakespeare/device.sh dense                # the baseline, on the tokens hebrus spent
# Runs live in /tmp/runs; what comes back goes to $OUT: the log, curve.json and summary.json of
# the run, and the bf16 checkpoint in parts under 16 MB (join with cat model.safetensors.part-*).
set -eu
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/shakespeare-out}
mkdir -p "$out" /tmp/runs
nvidia-smi --query-gpu=name --format=csv,noheader
case $1 in
hebrus)
    python3 recipes/shakespeare/train.py --model hebrus --out /tmp/runs/hebrus --minutes "${2:-9}" \
        2>&1 | tee "$out/train-hebrus.log"
    cp /tmp/runs/hebrus/curve.json "$out/curve-hebrus.json"
    cp /tmp/runs/hebrus/summary.json "$out/summary-hebrus.json"
    cp /tmp/runs/hebrus/model/config.json "$out/config.json"
    split -b 15M -d /tmp/runs/hebrus/model/model.safetensors "$out/model.safetensors.part-" ;;
dense)
    python3 recipes/shakespeare/train.py --model dense --out /tmp/runs/dense --minutes "${2:-9}" \
        --tokens-from recipes/shakespeare/results/summary-hebrus.json 2>&1 | tee "$out/train-dense.log"
    cp /tmp/runs/dense/curve.json "$out/curve-dense.json"
    cp /tmp/runs/dense/summary.json "$out/summary-dense.json" ;;
*)
    echo "usage: device.sh hebrus|dense [MINUTES]" >&2; exit 2 ;;
esac
