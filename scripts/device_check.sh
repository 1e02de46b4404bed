#!/usr/bin/env bash
# The one GPU check: engine correctness on CUDA tensors and a two-size benchmark (< 8 minutes).
#   bash scripts/device_check.sh            # on the device machine, or here on CPU to test it
# Writes data/results/device-check-<cuda|cpu>.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEVICE=$("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')
SIZES=${SIZES:-256,2048}
[ "$DEVICE" = cpu ] && SIZES=${CPU_SIZES:-64,256}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" scripts/device_check.py --sizes-mb "$SIZES" --json "${OUT:-data/results}/device-check-$DEVICE.json"
