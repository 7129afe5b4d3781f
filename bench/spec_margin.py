"""The cost controller's drafter margin (DRAFTER_MARGIN) A/B, paired within one process.

    .venv/bin/python bench/spec_margin.py [--model hybrid-demo|default] [--method mtp]
        [--margins 0,0.05] [--rounds 2] [--num-prompts 6] [--max-tokens 128] [--json-out F]

Plain decoding and one deployment of METHOD + controller per margin, side by side in this
process; each held-out ShareGPT prompt is decoded (greedy) by each in a rotated order. Output
tokens / wall seconds of each, over plain's.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.bench import machine, print_json
from specdeploy.training import data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="hybrid-demo", help="'default': the default model")
    ap.add_argument("--method", default="mtp")
    ap.add_argument("--margins", default="0,0.05")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = None if args.model == "default" else args.model
    kw = dict(max_batch_size=1, max_seq_len=1024)
    llms = {"plain": LLM(model, **kw)}
    for m in args.margins.split(","):
        llm = llms[f"margin {m}"] = LLM(model, spec=SpecConfig(args.method, 3), **kw)
        llm.engine.controller.margin = float(m)
    names = list(llms)
    _, held = data.split(data.load_conversations("sharegpt"))
    prompts = [data.prompt_ids(llms["plain"].tokenizer, c, 256)
               for c in held[:args.num_prompts]]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for llm in llms.values():
        llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))
    secs, toks = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    for _ in range(args.rounds):
        for i, p in enumerate(prompts):
            for s in names[i % len(names):] + names[:i % len(names)]:
                t = time.perf_counter()
                (o,) = llms[s].generate([p], sp)
                secs[s] += time.perf_counter() - t
                toks[s] += len(o.outputs[0].token_ids)
    rate = {s: toks[s] / secs[s] for s in names}
    print_json({"machine": machine(), "command": " ".join(["bench/spec_margin.py"] + sys.argv[1:]),
                "tokens_per_s": {s: round(v, 1) for s, v in rate.items()},
                "over_plain": {s: round(v / rate["plain"], 3) for s, v in rate.items()}},
               args.json_out)


if __name__ == "__main__":
    main()
