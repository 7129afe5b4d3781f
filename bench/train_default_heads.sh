#!/usr/bin/env bash
# The CPU-only recipe for the default model's (SmolLM2-135M-Instruct) EAGLE-3 and MTP heads; it
# installs them under specdeploy/data/drafters/. It made the heads shipped before 2026-12-01
# (held-out greedy K=3 accepted length 1.54 / 1.36); today's heads come from one GPU,
# bench/train_default_heads_gpu.sh. Measured times and acceptance: README, "Trained drafters
# for the default model".
#
# 1. Data: the target's own greedy replies (<= 128 tokens) to training-split ShareGPT prompts,
#    two shards side by side (one thread each). The shipped heads used the files as they stood
#    when this step was stopped for time: 1,088 replies, 118k reply tokens, 35 min.
#    GEN_PROMPTS (default 1600) sets how many prompts; re-running resumes.
# 2. Training over one feature cache (the frozen target's forward is a large part of the cost
#    on a CPU). Re-running resumes; --max-minutes counts the total over all runs.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs}
MINUTES=${MINUTES:-55}
GEN_PROMPTS=${GEN_PROMPTS:-1600}
mkdir -p "$RUNS"
for k in 0 1; do
  OMP_NUM_THREADS=1 .venv/bin/specdeploy gen-drafter-data --out "$RUNS/self_$k.jsonl" \
    --num-prompts "$GEN_PROMPTS" --batch-size 64 --chunk 64 --max-tokens 128 --threads 1 \
    --shard "$k/2" > "$RUNS/gen_$k.log" 2>&1 &
done
wait
cat "$RUNS/self_0.jsonl" "$RUNS/self_1.jsonl" > "$RUNS/self.jsonl"
cp "$RUNS/self_0.jsonl.meta.json" "$RUNS/self.jsonl.meta.json"

COMMON=(--data "$RUNS/self.jsonl" --draft-vocab-size 6144 --seq-len 320 --batch-size 4
        --cache-dir "$RUNS/feat_self" --no-progress --save-every-minutes 5)
# 2a. Closed-form warm starts on all 260 batches (EAGLE-3 first, two threads: it computes and
#     caches the target features, 11 min; the MTP fit then reads the cache, 19 s). A warm start
#     fitted on few batches overfits them (training agreement 0.55 in-sample vs ~0.2 on new
#     batches at 16-24 batches), so it sees all the data.
OMP_NUM_THREADS=2 .venv/bin/specdeploy train-drafter --method eagle3 --out "$RUNS/eagle3" \
  --max-steps 0 --fit-batches 260 "${COMMON[@]}" > "$RUNS/eagle3_fit.log" 2>&1
OMP_NUM_THREADS=1 .venv/bin/specdeploy train-drafter --method mtp --out "$RUNS/mtp" \
  --max-steps 0 --fit-batches 260 "${COMMON[@]}" > "$RUNS/mtp_fit.log" 2>&1
# 2b. SGD from the warm starts (resumes the runs above), side by side, one thread each.
#     (The shipped heads ran this with --max-minutes 35 first and were resumed at 15 min with
#     55; the cosine schedule restarted from there.)
OMP_NUM_THREADS=1 .venv/bin/specdeploy train-drafter --method eagle3 --out "$RUNS/eagle3" \
  --max-minutes "$MINUTES" --lr 3e-5 "${COMMON[@]}" > "$RUNS/eagle3.log" 2>&1 &
OMP_NUM_THREADS=1 .venv/bin/specdeploy train-drafter --method mtp --out "$RUNS/mtp" \
  --max-minutes "$MINUTES" --lr 1e-4 "${COMMON[@]}" > "$RUNS/mtp.log" 2>&1 &
wait
for m in eagle3 mtp; do
  dst=specdeploy/data/drafters/smollm2-135m-instruct/$m
  mkdir -p "$dst"
  cp "$RUNS/$m"/{config.json,model.safetensors,training.json} "$dst/"
  chmod 644 "$dst"/*
done
