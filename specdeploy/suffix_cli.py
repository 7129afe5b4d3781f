"""`specdeploy suffix-store`: write a suffix store (engine/suffix_store.py) from the target's
own replies, the JSONL `specdeploy gen-drafter-data` writes (each record's last assistant
message; prompts are not stored: lookup already drafts from the request's own prompt).

    specdeploy suffix-store --replies self.jsonl [more.jsonl ...] --out runs/store [--model M]
        [--max-tokens N]

Deploy with it: `SpecConfig("suffix", suffix_store="runs/store")` / `--spec suffix
--suffix-store runs/store`.
"""
from __future__ import annotations

import argparse
import json


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("suffix-store", help="write a store of the target's replies for "
                              "--spec suffix (from gen-drafter-data's JSONL)")
    p.add_argument("--replies", required=True, nargs="+",
                   help="gen-drafter-data output (JSONL); several files are read in order")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--model", default=None, help="target whose tokenizer encodes the replies "
                   "(default model)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="stop after this many tokens (the files' first replies)")
    p.set_defaults(func=cmd_suffix_store)
    return p


def read_replies(path: str, tokenizer, max_tokens: int | None = None) -> list[list[int]]:
    docs, total = [], 0
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                msgs = json.loads(line)["messages"]
                reply = next(m["content"] for m in reversed(msgs) if m["role"] == "assistant")
            except (ValueError, KeyError, TypeError, StopIteration):
                raise ValueError(f"replies: line {i} of {path} is not a gen-drafter-data record "
                                 "(a JSON object with an assistant message)") from None
            ids = tokenizer.encode(reply)
            if max_tokens is not None and total + len(ids) > max_tokens:
                break
            docs.append(ids)
            total += len(ids)
    return docs


def cmd_suffix_store(args) -> int:
    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.default_model import default_model_path
    from specdeploy.engine.suffix_store import SuffixStore
    from specdeploy.tokenizer import load_tokenizer

    model = args.model or default_model_path()
    cfg = open_checkpoint(model).config
    vocab = int(cfg.get("text_config", cfg)["vocab_size"])
    tok, docs = load_tokenizer(model), []
    for path in args.replies:
        left = None if args.max_tokens is None else args.max_tokens - sum(map(len, docs))
        docs += read_replies(path, tok, left)
    files = args.replies[0] if len(args.replies) == 1 else list(args.replies)
    out = SuffixStore.save(args.out, docs, vocab, meta={"replies_file": files})
    print(f"wrote {args.out}: {out['num_replies']} replies, {out['num_tokens']} tokens")
    return 0
