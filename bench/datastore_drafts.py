"""Would a datastore of the target's own replies draft well where prompt lookup finds nothing?
An offline replay (no timing): REST-style drafts, lossless like any drafts, costing no forward.

    .venv/bin/python bench/datastore_drafts.py --store runs/self.jsonl [--held 24] [--k 3]
        [--json-out FILE]

`--store`: `specdeploy gen-drafter-data` output (the target's greedy replies to training-split
prompts; e.g. bench/finetune_default_heads_cpu.sh step 2, or 10 minutes of
`specdeploy gen-drafter-data --data P.jsonl --out self.jsonl --batch-size 64 --max-minutes 10`).
The datastore: for n = 6..2, n-gram -> counts of the next token over those replies. The held-out
replies: the default model's greedy replies (fast kernels, <= 128 tokens) to the first `--held`
held-out ShareGPT first turns. Each step of a replayed reply drafts up to K tokens: "lookup" by
prompt lookup (the longest of the last 4..2 tokens found earlier in prompt + reply, its most
recent match), "store" by a greedy chain over the datastore (the longest n-gram present decides;
it drafts its most frequent next token if that was seen >= min_count times and is >= share of
that n-gram's continuations), "both" lookup first, the datastore where lookup found nothing.
Prints, per setting, the mean accepted length (tokens per step) and the drafts verified per
step (the rows a verify step adds).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys

from specdeploy import LLM, SamplingParams
from specdeploy.bench import machine, print_json
from specdeploy.training import data

NS = (6, 5, 4, 3, 2)
SETTINGS = ((1, 0.0), (2, 0.3), (2, 0.5), (3, 0.6), (5, 0.7))  # (min_count, share)


def build_tables(tok, store_path: str) -> tuple[dict, int]:
    tables = {n: collections.defaultdict(collections.Counter) for n in NS}
    total = 0
    with open(store_path) as f:
        for line in f:
            ids = tok.encode(json.loads(line)["messages"][-1]["content"])
            total += len(ids)
            for n in NS:
                t = tables[n]
                for i in range(n, len(ids)):
                    t[tuple(ids[i - n:i])][ids[i]] += 1
    return tables, total


def prompt_lookup(ctx: list[int], k: int) -> list[int]:
    for n in (4, 3, 2):
        if len(ctx) <= n:
            continue
        pat = ctx[-n:]
        for s in range(len(ctx) - n - 1, -1, -1):
            if ctx[s:s + n] == pat:
                return ctx[s + n:s + n + k]
    return []


def store_chain(tables, ctx: list[int], k: int, min_count: int, share: float) -> list[int]:
    out, c = [], list(ctx)
    for _ in range(k):
        hit = None
        for n in NS:
            cnt = tables[n].get(tuple(c[-n:])) if len(c) >= n else None
            if cnt:
                (t, top), tot = cnt.most_common(1)[0], sum(cnt.values())
                if top >= min_count and top / tot >= share:
                    hit = t
                break  # the longest context present decides
        if hit is None:
            break
        out.append(hit)
        c.append(hit)
    return out


def replay(held, tables, mode: str, k: int, min_count: int = 2, share: float = 0.5) -> dict:
    steps = toks = rows = 0
    for prompt, reply in held:
        i = 0
        while i < len(reply):
            ctx = prompt + reply[:i]
            d = prompt_lookup(ctx, k) if mode in ("lookup", "both") else []
            if not d and mode in ("store", "both"):
                d = store_chain(tables, ctx, k, min_count, share)
            a = 0
            while a < len(d) and i + a < len(reply) and d[a] == reply[i + a]:
                a += 1
            i, steps, rows = i + a + 1, steps + 1, rows + len(d)
        toks += len(reply)
    return {"mean_accepted_length": round(toks / steps, 3),
            "drafts_per_step": round(rows / steps, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--held", type=int, default=24)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    llm = LLM(threads=2, max_batch_size=8)
    _, conv = data.split(data.load_conversations("sharegpt"))
    prompts = [data.prompt_ids(llm.tokenizer, c, 256) for c in conv[:args.held]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens))
    held = [(p, o.token_ids) for p, o in zip(prompts, outs)]
    tables, total = build_tables(llm.tokenizer, args.store)
    results = {"lookup": replay(held, tables, "lookup", args.k)}
    for mc, share in SETTINGS:
        for mode in ("store", "both"):
            results[f"{mode} min_count={mc} share={share}"] = replay(held, tables, mode, args.k,
                                                                     mc, share)
    print_json({"machine": machine(), "command": " ".join(["bench/datastore_drafts.py"]
                                                         + sys.argv[1:]),
                "datastore_tokens": total, "held_out_replies": len(held), "k": args.k,
                "results": results}, args.json_out)


if __name__ == "__main__":
    main()
