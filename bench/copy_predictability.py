"""How much of a target's own replies a copy rule would predict: the share of reply tokens equal
to the token that followed the previous occurrence of the same two preceding tokens (prompt
included). A rough ceiling for what an attention head that learns to copy adds to a drafter.
Reads a `specdeploy gen-drafter-data` JSONL file; prints one JSON object. With --lookup MAX:MIN
it also replays n-gram lookup drafting (specdeploy/engine/lookup.py) at every reply position
with K drafts: how often it fires, how often its first draft is right, and how many of its K
drafts the greedy target would accept.

    python bench/copy_predictability.py FILE.jsonl [--lookup 4:2 --k 3]
"""
from __future__ import annotations

import argparse
import json
import sys


def copy_hits(ids: list[int], start: int) -> tuple[int, int]:
    """(hits, scored) over positions >= start (and >= 2)."""
    last: dict[tuple[int, int], int] = {}
    hits = scored = 0
    for i in range(2, len(ids)):
        key = (ids[i - 2], ids[i - 1])
        if i >= start:
            scored += 1
            j = last.get(key)
            hits += j is not None and ids[j] == ids[i]
        last[key] = i
    return hits, scored


def lookup_replay(ids: list[int], start: int, max_n: int, min_n: int, k: int
                  ) -> tuple[int, int, int, int]:
    """(positions, fired, first draft right, drafts accepted) over reply positions."""
    from specdeploy.engine.lookup import NgramIndex

    index = NgramIndex(max_n, min_n)
    pos = fired = first = accepted = 0
    for i in range(max(start, 1), len(ids)):
        pos += 1
        d = index.propose(ids[:i], k)
        if d is None:
            continue
        fired += 1
        a = 0
        while a < k and i + a < len(ids) and d[a] == ids[i + a]:
            a += 1
        first += a > 0
        accepted += a
    return pos, fired, first, accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path")
    ap.add_argument("--lookup", default=None, help="MAX:MIN n-gram lengths to replay")
    ap.add_argument("--k", type=int, default=3)
    args = ap.parse_args()
    hits = scored = n = 0
    tot = [0, 0, 0, 0]
    with open(args.path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            h, s = copy_hits(r["token_ids"], r["prompt_len"])
            hits, scored, n = hits + h, scored + s, n + 1
            if args.lookup:
                mx, mn = (int(v) for v in args.lookup.split(":"))
                got = lookup_replay(r["token_ids"], r["prompt_len"], mx, mn, args.k)
                tot = [a + b for a, b in zip(tot, got)]
    out = {"command": " ".join(["python"] + sys.argv), "records": n,
           "reply_tokens": scored, "copy_predictable": round(hits / scored, 4)}
    if args.lookup:
        pos, fired, first, accepted = tot
        out["lookup"] = {"setting": args.lookup, "k": args.k,
                         "fires_at": round(fired / pos, 4),
                         "first_draft_right_when_fired": round(first / max(fired, 1), 4),
                         "accepted_drafts_when_fired": round(accepted / max(fired, 1), 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
