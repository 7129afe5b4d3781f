#!/usr/bin/env bash
# Train the EAGLE-3 and MTP heads shipped for the default model (SmolLM2-135M-Instruct) and
# install them under specdeploy/data/drafters/. Both runs share one feature cache (the frozen
# target's forward is most of the cost on a CPU), run side by side and resume when re-run.
# Measured times and acceptance: README, "Trained drafters for the default model".
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs}
MINUTES=${MINUTES:-38}
mkdir -p "$RUNS"
COMMON=(--max-minutes "$MINUTES" --draft-vocab-size 6144 --num-samples 480 --lr 3e-4
        --fit-batches 16 --cache-dir "$RUNS/features" --seq-len 256 --batch-size 4)
for m in eagle3 mtp; do
  OMP_NUM_THREADS=1 nice -n 5 .venv/bin/specdeploy train-drafter --method "$m" \
    --out "$RUNS/$m" "${COMMON[@]}" > "$RUNS/$m.log" 2>&1 &
done
wait
for m in eagle3 mtp; do
  dst=specdeploy/data/drafters/smollm2-135m-instruct/$m
  mkdir -p "$dst"
  cp "$RUNS/$m"/{config.json,model.safetensors,training.json} "$dst/"
done
