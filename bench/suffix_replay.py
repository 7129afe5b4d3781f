"""How well does a suffix store (engine/suffix_store.py) draft the default model's replies, and
how far can its own estimate be trusted? An offline replay (no timing; drafts are lossless).

    .venv/bin/python bench/suffix_replay.py [--store DIR|shipped[,DIR...]] [--skip 6]
        [--held 24] [--max-tokens 128] [--json-out FILE]

The replies: the default model's greedy replies (`LLM()` defaults) to held-out ShareGPT first
turns `--skip`..`--skip + --held` (the bench's first 6 are skipped: this tunes nothing on
them). Each reply is replayed step by step as the engine drafts with lookup + store at K (the
longest run of accepted drafts, then the target's token): lookup (n 4..2 over prompt + reply)
first, the store where lookup finds nothing. Prints the mean accepted length (tokens per step)
and the drafts verified per step for lookup alone and for lookup + store at several
`min_prob`; and, over every store draft that was reached (its earlier drafts accepted), the
acceptance by bucket of the store's estimate (what engine/spec_accept.py STORE_PRIOR starts
from).
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance import heldout_prompts  # noqa: E402

from specdeploy import LLM, SamplingParams, SpecConfig  # noqa: E402
from specdeploy.bench import machine, print_json  # noqa: E402
from specdeploy.engine.lookup import NgramIndex  # noqa: E402
from specdeploy.engine.spec_accept import STORE_BUCKETS, store_bucket  # noqa: E402
from specdeploy.engine.suffix_store import MAX_N, SuffixStore  # noqa: E402


def replay(prompt, reply, k, store, min_prob, buckets=None):
    """(steps, drafts verified) replaying `reply` after `prompt`."""
    seq, t, steps, rows = list(prompt), 0, 0, 0
    idx = NgramIndex(4, 2)
    while t < len(reply):
        drafts = idx.propose(seq, k)
        if drafts is None and store is not None:
            store.min_prob = min_prob
            drafts, conf = store.propose(seq[-MAX_N:], k)
            if buckets is not None:
                for j, (d, c) in enumerate(zip(drafts, conf)):
                    ok = t + j < len(reply) and d == reply[t + j]
                    buckets[store_bucket(c)].append(ok)
                    if not ok:
                        break
        drafts = drafts or []
        a = 0
        while a < len(drafts) and t + a < len(reply) and drafts[a] == reply[t + a]:
            a += 1
        n = min(a + 1, len(reply) - t)
        seq += reply[t:t + n]
        t += n
        steps += 1
        rows += len(drafts)
    return steps, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="shipped")
    ap.add_argument("--skip", type=int, default=6)
    ap.add_argument("--held", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    llm = LLM(max_batch_size=min(args.held, 32))
    prompts = heldout_prompts(llm.tokenizer, args.skip + args.held, 256)[args.skip:]
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens))
    replies = [o.token_ids for o in outs]
    total = sum(map(len, replies))
    names = [n for n in args.store.split(",") if n]
    runs = {name: replay_store(llm, name, prompts, replies, args.k) for name in names}
    print_json({"machine": machine(), "command": " ".join(["python"] + sys.argv),
                "k": args.k, "replies": len(replies), "reply_tokens": total,
                # several stores: side by side on the same replies
                **(runs[names[0]] if len(names) == 1 else {"stores": runs})}, args.json_out)


def load_store(llm, name: str) -> SuffixStore:
    if name == "shipped":  # what a deployment with SpecConfig("suffix") loads
        corpus = LLM(max_batch_size=1, spec=SpecConfig("suffix")).deployed.suffix_corpus
        if corpus is None:
            raise SystemExit("--store shipped: no store is shipped for the default model")
        return SuffixStore(llm.deployed.vocab_size, corpus)
    return SuffixStore.load(name, llm.deployed.vocab_size)


def replay_store(llm, name: str, prompts, replies, k: int) -> dict:
    store = load_store(llm, name)
    total = sum(map(len, replies))
    rows = {}
    buckets = collections.defaultdict(list)
    for row, st, mp in [("lookup", None, 0.0)] + [(f"lookup+store min_prob {p}", store, p)
                                                   for p in (0.0, 0.05, 0.1, 0.2, 0.3)]:
        steps = drafted = 0
        for p, r in zip(prompts, replies):
            s, d = replay(p, r, k, st, mp, buckets if mp == 0.0 and st else None)
            steps, drafted = steps + s, drafted + d
        rows[row] = {"mean_accepted_length": round(total / steps, 3),
                     "drafts_per_step": round(drafted / steps, 3)}
    edges = (0.0,) + STORE_BUCKETS + (1.0,)
    calib = {f"[{edges[b]}, {edges[b + 1]})": {"drafts": len(v),
                                               "accepted": round(sum(v) / max(len(v), 1), 3)}
             for b, v in sorted(buckets.items())}
    return {"store": name, "store_tokens": store.num_tokens, "results": rows,
            "store_estimate_calibration": calib}


if __name__ == "__main__":
    main()
