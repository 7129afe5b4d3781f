"""How much of a target's own replies a copy rule would predict: the share of reply tokens equal
to the token that followed the previous occurrence of the same two preceding tokens (prompt
included). A rough ceiling for what an attention head that learns to copy adds to a drafter.
Reads a `specdeploy gen-drafter-data` JSONL file; prints one JSON object.

    python bench/copy_predictability.py FILE.jsonl
"""
from __future__ import annotations

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


def main() -> None:
    path = sys.argv[1]
    hits = scored = n = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            h, s = copy_hits(r["token_ids"], r["prompt_len"])
            hits, scored, n = hits + h, scored + s, n + 1
    print(json.dumps({"command": " ".join(["python"] + sys.argv), "records": n,
                      "reply_tokens": scored, "copy_predictable": round(hits / scored, 4)}))


if __name__ == "__main__":
    main()
