#!/usr/bin/env bash
# Train the EAGLE-3 and MTP heads shipped for the default model (SmolLM2-135M-Instruct) and
# install them under specdeploy/data/drafters/. Both runs share one feature cache (the frozen
# target's forward is most of the cost on a CPU; a lock file per batch stops them computing it
# twice), run side by side and resume when re-run. Measured times and acceptance: README,
# "Trained drafters for the default model".
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs}
mkdir -p "$RUNS"
COMMON=(--draft-vocab-size 6144 --num-samples 480 --cache-dir "$RUNS/features" --seq-len 256
        --batch-size 4)
OMP_NUM_THREADS=1 nice -n 5 .venv/bin/specdeploy train-drafter --method mtp --out "$RUNS/mtp" \
  --max-minutes 38 --lr 3e-4 --fit-batches 16 "${COMMON[@]}" > "$RUNS/mtp.log" 2>&1 &
# The EAGLE-3 warm start fits on 40 batches; its SGD is short and gentle (a larger lr undoes the
# closed-form fit faster than 100 steps can improve on it).
OMP_NUM_THREADS=1 nice -n 5 .venv/bin/specdeploy train-drafter --method eagle3 --out "$RUNS/eagle3" \
  --max-minutes 12 --lr 3e-5 --fit-batches 40 "${COMMON[@]}" > "$RUNS/eagle3.log" 2>&1 &
wait
for m in eagle3 mtp; do
  dst=specdeploy/data/drafters/smollm2-135m-instruct/$m
  mkdir -p "$dst"
  cp "$RUNS/$m"/{config.json,model.safetensors,training.json} "$dst/"
  chmod 644 "$dst"/*
done
