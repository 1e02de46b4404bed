#!/usr/bin/env bash
# transformers' own Trainer checkpoint and resume tests, as they are and with NbckptCallback added
# to every Trainer (issue 31). Not part of `make test`.
#
#   TRANSFORMERS_TESTS=<transformers checkout> scripts/peer_tests/run_transformers.sh [default|nbckpt|both] [OUT]
#
# TRANSFORMERS_TESTS is a checkout of huggingface/transformers at the installed version's tag
# (git clone --depth 1 -b v5.25.0 https://github.com/huggingface/transformers), or its
# tests/trainer/test_trainer.py itself; the file is run where it is, never copied here. Two packages
# it needs are installed into OUT/site when missing (never into the environment). Each test has 120 s (pytest-timeout, when installed); the two runs
# write OUT/default-trainer.xml and OUT/nbckpt-trainer.xml, and summarize.py prints the counts and
# every test that passes as it is and not with nbckpt.
set -euo pipefail
mode=${1:-both}
out=$(realpath -m "${2:-/tmp/nbckpt-peer-hf}")
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
python=${PYTHON:-python}
: "${TRANSFORMERS_TESTS:?set TRANSFORMERS_TESTS to a checkout of huggingface/transformers}"
tests=$(realpath "$TRANSFORMERS_TESTS")
[ -d "$tests" ] && tests="$tests/tests/trainer/test_trainer.py"
[ -f "$tests" ] || { echo "no $tests" >&2; exit 2; }
mkdir -p "$out"
# What the file imports (parameterized) and what its test class requires (sentencepiece, though no
# test here uses it: without it every test is skipped), into OUT/site where missing.
for package in parameterized sentencepiece; do
  if ! "$python" -c "import $package" 2>/dev/null && [ ! -d "$out/site/$package" ]; then
    "$python" -m pip install -q --no-deps --target "$out/site" "$package"
  fi
done
# The Trainer's checkpoint, resume and best-model tests in test_trainer.py.
names=(
  test_save_checkpoints test_safe_checkpoints test_load_best_model_with_save test_can_resume_training
  test_resume_training_with_randomness test_auto_batch_size_with_resume_from_checkpoint
  test_training_with_resume_from_checkpoint_false test_resume_training_with_shard_checkpoint
  test_resume_training_with_safe_checkpoint test_resume_training_with_gradient_accumulation
  test_resume_training_with_frozen_params test_load_best_model_at_end test_load_best_model_from_safetensors
  test_early_stopping_callback test_checkpoint_rotation test_compare_trainer_and_checkpoint_args_logging
  test_save_best_checkpoint test_best_model_checkpoint_behavior test_resume_from_interrupted_training
)
ids=()
for name in "${names[@]}"; do
  grep -q "def $name(" "$tests" && ids+=("$(basename "$tests")::TrainerIntegrationTest::$name")
done
limit=()
"$python" -c "import pytest_timeout" 2>/dev/null && limit=(--timeout 120)
case $mode in both) ios=(default nbckpt) ;; *) ios=("$mode") ;; esac
for io in "${ios[@]}"; do
  plugin=()
  [ "$io" = nbckpt ] && plugin=(-p nbckpt_peer_hf)
  (cd "$(dirname "$tests")" && HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH="$here:$repo:$out/site" \
    timeout 1800 nice -n 10 "$python" -m pytest -q -p no:cacheprovider "${plugin[@]}" "${limit[@]}" \
    --junitxml="$out/$io-trainer.xml" -o junit_family=xunit1 "${ids[@]}" >"$out/$io-trainer.log" 2>&1) || true
  tail -1 "$out/$io-trainer.log"
done
"$python" "$here/summarize.py" "$out"
