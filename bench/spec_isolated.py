"""Speculation against plain decoding with one deployment per process, as a user runs it.

    PYTHONPATH=. .venv/bin/python bench/spec_isolated.py [--model hybrid-demo]
        [--settings plain,mtp:1,mtp:3,mtp:cost,suffix:cost] [--k 3] [--rounds 4]
        [--num-prompts 6] [--max-tokens 128] [--threads 2] [--draft-quantize auto|none|q8_0|int8]
        [--json-out FILE]

Why processes: bench/spec_controller.py keeps every setting's deployment in one process, and on
a model whose weights are a good part of the last-level cache (hybrid-demo: a 50 MB fp32 LM
head, its oneDNN copy, per deployment) the settings evict each other's weights as they take
turns, so each prompt starts cold, a cost a lone deployment never pays. Here each (setting,
round) is a fresh process: load, one 8-token warm-up request, then the first --num-prompts
held-out ShareGPT prompts one after another (greedy, batch 1), timed in the process. Rounds
take the settings in a rotated order; ratios to plain are per round (the round's plain run),
then their median, so a machine whose speed drifts between rounds moves both sides alike.
A setting is `plain` or `METHOD:K` (K fixed drafts every step) or `METHOD:cost` (the engine's
cost controller, SpecConfig's default) with the deployment's chain length --k; `alt:` before it
runs the code of the checkout --alt-root (e.g. a `git worktree` of an earlier commit) instead.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> None:
    import torch

    root = Path.cwd()  # this checkout, or --alt-root's for `alt:` settings
    sys.path.insert(0, str(root))
    sys.path.insert(0, str(root / "bench"))
    from spec_controller import FixedK

    from specdeploy import LLM, SamplingParams, SpecConfig
    from specdeploy.training import data

    torch.set_num_threads(args.threads)
    spec, fixed = None, None
    setting = args.child.removeprefix("alt:")  # (alt: already chose the checkout)
    if setting != "plain":
        method, k = setting.split(":")
        quant = None if args.draft_quantize == "none" else args.draft_quantize
        drafter = method not in ("ngram", "suffix")
        spec = SpecConfig(method, args.k, controller="cost",
                          draft_dtype="bfloat16" if drafter and quant == "int8" else None,
                          draft_quantize=quant if drafter else None,
                          suffix_decoding_max_cached_requests=0)
        fixed = None if k == "cost" else int(k)
    model = None if args.model == "default" else args.model
    llm = LLM(model, dtype="float32", max_batch_size=1, max_seq_len=1024, spec=spec)
    if fixed is not None:
        llm.engine.set_controller(FixedK(fixed))
    _, held = data.split(data.load_conversations("sharegpt"))
    prompts = [data.prompt_ids(llm.tokenizer, c, 256) for c in held[:args.num_prompts]]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    steps0 = llm.engine.stats.num_steps
    tokens, t = 0, time.perf_counter()
    for p in prompts:
        (o,) = llm.generate([p], sp, use_tqdm=False)
        tokens += len(o.token_ids)
    dt = time.perf_counter() - t
    print(json.dumps({"tokens": tokens, "s": dt, "steps": llm.engine.stats.num_steps - steps0}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="hybrid-demo", help="'default': the default model")
    ap.add_argument("--settings", default="plain,mtp:1,mtp:3,mtp:cost,suffix:cost")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-quantize", default="auto", choices=("auto", "none", "q8_0", "int8"))
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--alt-root", default=None,
                    help="another checkout: settings 'alt:METHOD:K' run its code (A/B)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    names = args.settings.split(",")
    if "plain" not in names:
        names.insert(0, "plain")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                   if k not in ("json_out", "child", "settings", "rounds", "alt_root")]
    for r in range(args.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            alt = name.startswith("alt:")
            if alt and not args.alt_root:
                raise SystemExit(f"{name}: needs --alt-root")
            root = Path(args.alt_root).resolve() if alt else ROOT
            out = subprocess.run([sys.executable, __file__, *passthrough, "--child", name],
                                 capture_output=True, text=True, timeout=900, cwd=root,
                                 env={**os.environ, "PYTHONPATH": str(root)})
            if out.returncode:
                raise SystemExit(f"{name}: exit {out.returncode}\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append(row)
            print(f"round {r} {name}: {row['tokens'] / row['s']:.1f} tok/s", file=sys.stderr,
                  flush=True)
    result = {}
    for n in names:
        rates = [x["tokens"] / x["s"] for x in runs[n]]
        ratios = [a["tokens"] / a["s"] / (p["tokens"] / p["s"])
                  for a, p in zip(runs[n], runs["plain"])]
        result[n] = {"tokens_per_s_median": round(statistics.median(rates), 1),
                     "tokens_per_s": [round(x, 1) for x in rates],
                     "over_plain_median": round(statistics.median(ratios), 3),
                     "over_plain_per_round": [round(x, 3) for x in ratios],
                     "tokens_per_step": round(sum(x["tokens"] for x in runs[n])
                                              / sum(x["steps"] for x in runs[n]), 2)}
    from specdeploy.bench import machine, print_json

    print_json({"machine": machine(), "command": "bench/spec_isolated.py "
                + " ".join(sys.argv[1:]), "results": result}, args.json_out)


if __name__ == "__main__":
    main()
