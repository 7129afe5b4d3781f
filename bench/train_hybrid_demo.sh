#!/usr/bin/env bash
# The recipe of the shipped `hybrid-demo` model (specdeploy/data/models/hybrid-demo), CPU only,
# as it was run on 2026-12-01 (2 cores, AVX2, shared with other work):
# 1. data: the default model's greedy replies (<= 128 tokens) to training-split ShareGPT
#    prompts; stopped by --max-minutes 40 at 832 prompts, 90k tokens (re-running resumes).
# 2. distillation + the MTP layer, jointly: 500 steps of 8 records (~75 min; resumable, the
#    cosine schedule is --planned-steps long), then the export (bf16, tied, tokenizer,
#    training.json with the held-out record ids and the ShareGPT held-out split).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs/hybrid}
mkdir -p "$RUNS"
OMP_NUM_THREADS=2 .venv/bin/specdeploy gen-drafter-data --out "$RUNS/self.jsonl" \
  --num-prompts 1600 --batch-size 64 --chunk 64 --max-tokens 128 --threads 2 --max-minutes 40
OMP_NUM_THREADS=2 .venv/bin/python bench/train_hybrid_demo.py --data "$RUNS/self.jsonl" \
  --out "$RUNS/run" --planned-steps 500 --max-minutes 78 --threads 2 \
  --export specdeploy/data/models/hybrid-demo
