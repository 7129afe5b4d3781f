#!/usr/bin/env bash
# Fine-tune the shipped heads of the default model on fresh data, CPU only (2 cores): the
# target's greedy replies to training-split prompts the shipped heads never trained on, then one
# pass of each head over them from the shipped weights (`--init-from` an exported head). It tests
# the README's "more replies, not more steps" on this machine. Results: README, "Trained drafters
# for the default model"; the heads are installed only by hand, after bench/acceptance.py.
#
#   bash bench/finetune_default_heads_cpu.sh   # defaults: RUNS=runs/ft GEN_MIN=33 LR=5e-5 TRAIN_MIN=45
#
# 1. Prompts: ShareGPT's training split minus the ids in bench/results/default_heads_trained_ids.txt.
# 2. Replies: our engine, batch 64, <= 256 tokens, GEN_MIN minutes (~270 tokens/s here).
# 3. EAGLE-3 over every batch once (2 threads), writing the target's features to a cache; then
#    MTP over the same batches, reading the cache (the target forward is most of the CPU cost).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs/ft}
GEN_MIN=${GEN_MIN:-33}
LR=${LR:-5e-5}
TRAIN_MIN=${TRAIN_MIN:-45}  # a cap per head; one pass usually ends first
SD=.venv/bin/specdeploy
HEADS=specdeploy/data/drafters/smollm2-135m-instruct
mkdir -p "$RUNS"
.venv/bin/python bench/export_training_prompts.py --out "$RUNS/train_prompts.jsonl" --num 40000
.venv/bin/python - "$RUNS" <<'PY'
import json, shutil, sys
runs = sys.argv[1]
seen = set(open("bench/results/default_heads_trained_ids.txt").read().split())
with open(f"{runs}/fresh_prompts.jsonl", "w") as out:
    for line in open(f"{runs}/train_prompts.jsonl"):
        if json.loads(line)["id"] not in seen:
            out.write(line)
shutil.copy(f"{runs}/train_prompts.jsonl.meta.json", f"{runs}/fresh_prompts.jsonl.meta.json")
PY
OMP_NUM_THREADS=2 $SD gen-drafter-data --data "$RUNS/fresh_prompts.jsonl" --out "$RUNS/self.jsonl" \
  --num-prompts 1000000 --batch-size 64 --chunk 64 --max-tokens 256 --threads 2 \
  --max-minutes "$GEN_MIN" > "$RUNS/gen.log" 2>&1
# one pass: as many steps as batches of 8 replies
STEPS=$(( $(wc -l < "$RUNS/self.jsonl") / 8 ))
COMMON=(--data "$RUNS/self.jsonl" --seq-len 448 --batch-size 8 --fit-batches 0 --lr "$LR"
        --warmup-steps 20 --max-steps "$STEPS" --max-minutes "$TRAIN_MIN" --cache-dir "$RUNS/features"
        --save-every-minutes 5 --no-progress)
for m in eagle3 mtp; do
  OMP_NUM_THREADS=2 $SD train-drafter --method $m --out "$RUNS/$m" --init-from "$HEADS/$m" \
    "${COMMON[@]}" > "$RUNS/$m.log" 2>&1
done
tail -n 2 "$RUNS/eagle3.log" "$RUNS/mtp.log"
