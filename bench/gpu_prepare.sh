#!/usr/bin/env bash
# Here, before the device calls of bench/gpu_check.sh: the wheels the device image lacks (.whl/),
# the default model's GGUF cut in two (.gpu/a, .gpu2/b: one device call carries at most 64 MiB),
# its sha256, 64 ShareGPT prompts as JSONL and 4 held-out prompts' token ids (.gpu2/). All three
# folders are git-ignored (and .gpu3/: a `train` round's prompts).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PY:-.venv/bin/python}
mkdir -p .whl .gpu .gpu2
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp -d .whl gguf==0.19.0
gguf=$($py -c "from specdeploy.default_model import default_model_path as p; print(p())")
cut=${CUT_MIB:-35}  # MiB in the first call (with the heads); 60 for a `train` round (no heads)
head -c $((cut * 1024 * 1024)) "$gguf" > .gpu/a
tail -c +$((cut * 1024 * 1024 + 1)) "$gguf" > .gpu2/b
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > .gpu2/sha256
$py - <<'PY'
import json

from specdeploy.bench import load_prompts

with open(".gpu2/prompts.jsonl", "w") as f:
    for p in load_prompts("sharegpt", 64):
        f.write(json.dumps({"prompt": p}) + "\n")
# the batch-1 rows' prompts: held-out first turns, chat template applied (as bench/acceptance.py)
import sys

sys.path.insert(0, "bench")
from acceptance import heldout_prompts  # noqa: E402

from specdeploy import LLM  # noqa: E402

tok = LLM(None, max_batch_size=1, max_seq_len=64).tokenizer
with open(".gpu2/heldout_ids.json", "w") as f:
    json.dump(heldout_prompts(tok, 4, 400), f)
PY
# a `train` round's prompts (.gpu3/, carried by that round's second call only: with them the
# bench call's .gpu2 would pass 64 MiB): ShareGPT's training split, its sidecar naming the
# held-out split
mkdir -p .gpu3
$py bench/export_training_prompts.py --out .gpu3/train_prompts.jsonl --num 40000 > /dev/null
gzip -f .gpu3/train_prompts.jsonl
ls -la .whl .gpu .gpu2 .gpu3
