#!/usr/bin/env bash
# The one GPU check: the engine's CUDA paths for correctness, then the engine benchmark on the GPU.
#   bash scripts/device_check.sh            # on the device machine, or here on CPU to test it
# Writes device-check-<cuda|cpu>.json into $OUT (the device tool's folder) or data/results/.
# About 4 minutes on an H200 machine with the default 2 GiB state; SIZE_MB=256 for a quick try.
# The bench on many ranks runs short (8 MiB a rank, one repeat) under torchrun: 1 rank per GPU,
# at most 2 (NCCL refuses two ranks on one GPU: one H100 runs 1 rank, NCCL training group, gloo
# coordination); each launch ends after SCALE_TIMEOUT_S (240 s) as an error, never a silent skip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEVICE=$("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')
SIZE_MB=${SIZE_MB:-2048}
[ "$DEVICE" = cpu ] && SIZE_MB=${CPU_SIZE_MB:-64}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" scripts/device_check.py --size-mb "$SIZE_MB" --json "${OUT:-data/results}/device-check-$DEVICE.json"
