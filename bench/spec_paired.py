"""Speculative settings against plain decoding, paired within one process.

    .venv/bin/python bench/spec_paired.py [--model hybrid-demo|default|DIR] [--rounds 2]
        [--settings plain,mtp:cost,mtp:1,suffix:cost] [--num-prompts 6] [--max-tokens 128]
        [--threads 2] [--json-out FILE]

Every setting is deployed in this one process, and each held-out ShareGPT prompt is decoded
(greedy) by every setting in turn, the order rotated per prompt: on a shared host whose speed
drifts by 15-25% between runs (bench/spec_isolated.py's processes), the ratios of settings
timed side by side are what stay comparable. A setting is `plain`, or `METHOD:K` (a fixed
chain of K drafts, no controller) or `METHOD:cost` (K = 3 with the cost controller, the
default). Output tokens / wall seconds of each setting's requests (prefill included), and each
over plain's. For an A/B of two trees run it once per checkout (PYTHONPATH=OTHER_TREE for the
other), alternating.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.bench import machine, print_json
from specdeploy.training import data


def make(model: str | None, setting: str) -> LLM:
    kw = dict(max_batch_size=1, max_seq_len=1024)
    if setting == "plain":
        return LLM(model, **kw)
    method, k = setting.split(":")
    if k == "cost":
        return LLM(model, spec=SpecConfig(method, 3), **kw)
    return LLM(model, spec=SpecConfig(method, int(k), controller="off"), **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="hybrid-demo", help="'default': the default model")
    ap.add_argument("--settings", default="plain,mtp:cost,mtp:1,suffix:cost")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    settings = args.settings.split(",")
    if "plain" not in settings:
        raise SystemExit("--settings: needs plain (the ratios' base)")
    torch.set_num_threads(args.threads)
    model = None if args.model == "default" else args.model
    llms = {s: make(model, s) for s in settings}
    _, held = data.split(data.load_conversations("sharegpt"))
    tok = llms["plain"].tokenizer
    prompts = [data.prompt_ids(tok, c, 256) for c in held[:args.num_prompts]]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for llm in llms.values():  # warm-up (first-use captures, the controller's calibration)
        llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))
    secs = dict.fromkeys(settings, 0.0)
    toks = dict.fromkeys(settings, 0)
    outs: dict[str, list] = {s: [] for s in settings}
    for _ in range(args.rounds):
        for i, p in enumerate(prompts):
            for s in settings[i % len(settings):] + settings[:i % len(settings)]:
                t = time.perf_counter()
                (o,) = llms[s].generate([p], sp)
                secs[s] += time.perf_counter() - t
                toks[s] += len(o.outputs[0].token_ids)
                outs[s].append(o.outputs[0].token_ids)
    rate = {s: toks[s] / secs[s] for s in settings}
    same = {s: outs[s] == outs["plain"] for s in settings}
    stats = {s: {k: v for k, v in llms[s].stats().items()
                 if k in ("mean_accepted_length", "acceptance_per_position",
                          "steps_by_num_drafts")} for s in settings if s != "plain"}
    print_json({"machine": machine(), "command": " ".join(["bench/spec_paired.py"] + sys.argv[1:]),
                "model": args.model, "prompts": len(prompts), "max_tokens": args.max_tokens,
                "rounds": args.rounds,
                "tokens_per_s": {s: round(v, 1) for s, v in rate.items()},
                "over_plain": {s: round(v / rate["plain"], 3) for s, v in rate.items()},
                "greedy_equals_plain": same, "spec_stats": stats}, args.json_out)


if __name__ == "__main__":
    main()
