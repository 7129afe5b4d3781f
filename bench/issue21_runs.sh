#!/usr/bin/env bash
# The issue-21 measurements in one go, on an idle machine (nothing else running: with 2 cores
# any other job halves a 2-thread rate). Writes bench/results/*_${TAG}.json and prints each.
#
#   PYTHON=.venv/bin/python bash bench/setup_llamacpp.sh /work/llamacpp     # once, ~10 min
#   LLAMACPP=/work/llamacpp TAG=avx2 NOTE="idle; AVX2 only; tree $(git rev-parse --short HEAD)" \
#       bash bench/issue21_runs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TAG=${TAG:-run}
NOTE=${NOTE:-}
export PYTHONPATH="${LLAMACPP:?path of the llama-cpp-python build (bench/setup_llamacpp.sh)}"
R=bench/results
CONFIGS=${CONFIGS:-plain,lookup,lookup+ctl,eagle3,eagle3+ctl,eagle3+lookup+ctl,mtp,mtp+ctl,mtp+lookup+ctl,auto}
"$PY" bench/vs_llamacpp.py --prompts 6 --rounds 3 --max-tokens 128 --configs "$CONFIGS" \
  --kernels exact,fast --note "$NOTE" --json-out "$R/vs_llamacpp_$TAG.json"
"$PY" bench/vs_llamacpp_concurrent.py --note "$NOTE" --json-out "$R/vs_llamacpp_concurrent_$TAG.json"
"$PY" bench/memory.py > "$R/memory_$TAG.json"
"$PY" bench/step_profile.py --kernels fast --threads 2 --reps 30 --note "$NOTE" \
  --json-out "$R/step_profile_fast_2threads_$TAG.json"
"$PY" bench/lookup_copy.py --threads 2 --json-out "$R/lookup_copy_$TAG.json"
"$PY" bench/threads_under_load.py --note "$NOTE" --json-out "$R/threads_under_load_$TAG.json"
