"""Is the draft vocabulary what limits the MTP head? Widen it at load time and save the copies.

    .venv/bin/python bench/widen_mtp_vocab.py --replies self.jsonl --sizes 12288 24576 \
        --out runs/mtp_vocab [--mtp-dir DIR] [--json-out FILE]

An MTP head's LM-head rows are the target's, so its draft vocab can grow without training: the
ids it drafts over now, plus the most frequent other reply tokens of `--replies` (a
gen-drafter-data JSONL). Prints the share of those reply tokens each vocab covers, and writes
each widened head to OUT/v<size> for `bench/acceptance.py --methods mtp --mtp-dir OUT/v<size>`.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import specdeploy
from specdeploy.bench import print_json
from specdeploy.drafters_registry import drafters_dir
from specdeploy.models.drafters.mtp_head import load_mtp_head, save_mtp_head


def reply_counts(path: str, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    with open(path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            ids = torch.tensor(r["token_ids"][r["prompt_len"]:], dtype=torch.long)
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replies", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[12288, 24576])
    ap.add_argument("--out", required=True)
    ap.add_argument("--mtp-dir", default=str(drafters_dir() / "smollm2-135m-instruct" / "mtp"))
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    target = specdeploy.load_model(None)
    head = load_mtp_head(args.mtp_dir, target, dtype=torch.float32)
    ids = head.d2t + torch.arange(head.d2t.shape[0])
    counts = reply_counts(args.replies, target.cfg.vocab_size)
    total = int(counts.sum())
    cover = {str(len(ids)): round(int(counts[ids].sum()) / total, 4)}
    out = {"command": " ".join(["bench/widen_mtp_vocab.py"] + sys.argv[1:]),
           "reply_tokens": total, "coverage": cover}
    for n in args.sizes:
        score = counts.double()
        score[ids] = float("inf")  # NOTE: the trained vocab stays; the rest by frequency
        wide = torch.topk(score, n).indices.sort().values
        cover[str(n)] = round(int(counts[wide].sum()) / total, 4)
        head.set_draft_vocab(wide)
        save_mtp_head(head, f"{args.out}/v{n}", dtype=torch.bfloat16)
    print_json(out, args.json_out)


if __name__ == "__main__":
    main()
