"""Does a trained head generalize? Acceptance on training-split prompts it trained on vs ones it
did not see, in one run.

    .venv/bin/python bench/seen_unseen.py --trained-ids self.jsonl [--methods eagle3,mtp]
        [--num-prompts 16] [--max-tokens 128] [--json-out FILE]

`--trained-ids`: the gen-drafter-data JSONL the heads trained on (its "id" fields), or a text
file with one id per line. Both groups come from the same seeded training-split order (every
n-th prompt of each group), so they differ only in whether the head saw the target's reply.
A held-out-like gap between them is overfitting, which more data (not more steps) fixes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.bench import machine, print_json
from specdeploy.training.selfgen import training_prompts


def read_ids(path: Path) -> set[str]:
    lines = [x for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    if lines and lines[0].lstrip().startswith("{"):
        return {json.loads(x)["id"] for x in lines}
    return {x.strip() for x in lines}


def spread(items: list, n: int) -> list:
    step = max(len(items) // n, 1)
    return items[::step][:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--trained-ids", required=True)
    ap.add_argument("--methods", default="eagle3,mtp")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=192,
                    help="as gen-drafter-data's (prompts it would have answered)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    seen = read_ids(Path(args.trained_ids))
    out = {"machine": machine(), "command": " ".join(["bench/seen_unseen.py"] + sys.argv[1:]),
           "k": args.k, "max_tokens": args.max_tokens, "greedy": True, "results": {}}
    groups = None
    for method in args.methods.split(","):
        spec = SpecConfig(method, args.k, controller="off")  # acceptance of K drafts every step
        llm = LLM(args.model, dtype="float32", max_batch_size=8, spec=spec)
        if groups is None:
            ps, _ = training_prompts(llm.tokenizer, "sharegpt", 10**6, args.max_prompt_tokens)
            s = [p for p in ps if p[0] in seen]
            u = [p for p in ps if p[0] not in seen]
            if not s or not u:
                raise SystemExit(f"--trained-ids: {len(s)} trained and {len(u)} unseen prompts "
                                 "among the training split; need both")
            groups = {"trained_on": spread(s, args.num_prompts),
                      "unseen": spread(u, args.num_prompts)}
            out["prompts"] = {g: len(v) for g, v in groups.items()}
        for g, prompts in groups.items():
            llm.engine.reset_spec_stats()  # NOTE: fresh counters per group
            llm.generate([ids for _, _, ids in prompts],
                         SamplingParams(max_tokens=args.max_tokens, temperature=0))
            st = llm.engine.spec_stats.as_dict()
            out["results"].setdefault(method, {})[g] = {
                "mean_accepted_length": round(st["mean_accepted_length"], 3),
                "acceptance_per_position": [round(a, 3) for a in st["acceptance_per_position"]]}
            print(method, g, out["results"][method][g], file=sys.stderr, flush=True)
        del llm
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print_json(out, args.json_out)


if __name__ == "__main__":
    main()
