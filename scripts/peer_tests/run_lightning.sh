#!/usr/bin/env bash
# Lightning's own checkpointing tests, with its default checkpoint IO and with nbckpt's plug-in as
# every strategy's IO (issue 31). Not part of `make test`: about 11 minutes on 2 loaded cores.
#
#   scripts/peer_tests/run_lightning.sh [default|nbckpt|both] [OUT]
#
# Needs the Lightning repository's tests at the installed version's tag: set LIGHTNING_SRC to a
# checkout (git clone https://github.com/Lightning-AI/pytorch-lightning; git checkout 2.6.5), or
# to a bare clone, from which tests/ is exported. Lightning's tests also import cloudpickle and jsonargparse, which are
# installed into OUT/site (never into the environment). Each part writes OUT/<io>-<part>.xml;
# summarize.py prints the counts and every test that passes with one IO and not the other.
set -euo pipefail
mode=${1:-both}
out=$(realpath -m "${2:-/tmp/nbckpt-peer-tests}")
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
python=${PYTHON:-python}
tag=${LIGHTNING_TAG:-2.6.5}
: "${LIGHTNING_SRC:?set LIGHTNING_SRC to a clone of Lightning-AI/pytorch-lightning}"
mkdir -p "$out"
if [ ! -d "$out/src/tests/tests_pytorch" ]; then
  mkdir -p "$out/src"
  git --git-dir="$(git -C "$LIGHTNING_SRC" rev-parse --absolute-git-dir)" archive "$tag" tests | tar -x -C "$out/src"
fi
[ -d "$out/site/jsonargparse" ] || "$python" -m pip install -q --no-deps --target "$out/site" cloudpickle jsonargparse
parts=(
  "plugins tests_pytorch/plugins"
  "checkpointing tests_pytorch/checkpointing"
  "callbacks tests_pytorch/callbacks/test_model_checkpoint_additional_cases.py tests_pytorch/callbacks/test_model_checkpoint_edge_cases.py tests_pytorch/callbacks/test_model_checkpoint_manual_opt.py tests_pytorch/callbacks/test_model_checkpoint_step_interval_val_metric.py"
  "connector tests_pytorch/trainer/connectors/test_checkpoint_connector.py"
)
case $mode in both) ios=(default nbckpt) ;; *) ios=("$mode") ;; esac
for io in "${ios[@]}"; do
  for part in "${parts[@]}"; do
    read -r name paths <<<"$part"
    plugin=()
    [ "$io" = nbckpt ] && plugin=(-p nbckpt_peer_io)
    # shellcheck disable=SC2086
    (cd "$out/src/tests" && OMP_NUM_THREADS=1 PYTHONPATH="$here:$repo:$out/site:$out/src/tests" \
      timeout 1800 nice -n 10 "$python" -m pytest -q -p no:cacheprovider --continue-on-collection-errors "${plugin[@]}" \
      --junitxml="$out/$io-$name.xml" -o junit_family=xunit1 $paths >"$out/$io-$name.log" 2>&1) || true
    tail -1 "$out/$io-$name.log"
  done
done
"$python" "$here/summarize.py" "$out"
