"""Where a speculative step's time goes at batch size 1, next to a plain decode step, in one run.

    .venv/bin/python bench/spec_phases.py [--methods eagle3,mtp,ngram,suffix] [--k 3]
        [--num-prompts 4] [--max-tokens 128] [--lookups 0,4:2] [--threads 2]
        [--controller off|cost] [--json-out FILE]

Greedy decoding of the first held-out ShareGPT prompts, no speculation and then each head
(shipped heads, bf16 with int8 weights as in bench/acceptance.py's speed runs), one process.
Each engine step is split into the target's forward (a plain decode step, or a verify step over
1 + K tokens), the drafter's forwards (the catch-up over the accepted tokens plus K - 1 single
steps), and the rest (scheduling, acceptance, sampling, bookkeeping: the step minus both). The
cost of a step in plain decode steps ("step_over_decode") and the mean accepted length give the
speedup these steps allow, accepted / step_over_decode, which the measured one should match.
Prefill steps are left out (the first step of each request).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.bench import machine, print_json
from specdeploy.training import data


class Timer:
    """Wraps methods of an object: total seconds per name, and per engine step the time of the
    step and of each name inside it."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        self.total[name] = 0.0

        def timed(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            self.total[name] += time.perf_counter() - t
            return out

        setattr(obj, attr, timed)

    def wrap_step(self, engine) -> None:
        fn = engine.step

        def step():
            before = dict(self.total)
            t = time.perf_counter()
            out = fn()
            row = {k: v - before[k] for k, v in self.total.items()}
            self.steps.append({"step": time.perf_counter() - t, **row})
            return out

        engine.step = step


def run(llm: LLM, prompts, max_tokens: int) -> dict:
    timer = Timer()
    d = llm.deployed
    timer.wrap(d, "forward", "target")
    if getattr(d, "draft_forward", None) is not None:
        timer.wrap(d, "draft_forward", "draft")
    timer.wrap_step(llm.engine)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rows, tokens = [], 0
    for p in prompts:
        timer.steps.clear()
        (o,) = llm.generate([p], sp)
        tokens += len(o.token_ids) - 1
        rows += [r for r in timer.steps[1:] if r.get("target")]  # step 0: the prefill
    n = len(rows)

    def mean_ms(key: str) -> float:
        return 1e3 * sum(r.get(key, 0.0) for r in rows) / n

    ms = {"step_ms": mean_ms("step"), "target_forward_ms": mean_ms("target"),
          "drafter_ms": mean_ms("draft")}
    ms["rest_ms"] = ms["step_ms"] - ms["target_forward_ms"] - ms["drafter_ms"]
    return {"decode_steps": n, "tokens": tokens, "tokens_per_step": tokens / n,
            **{k: round(v, 3) for k, v in ms.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="eagle3,mtp")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eagle3-dir", default=None, help="default: the shipped head")
    ap.add_argument("--mtp-dir", default=None, help="default: the shipped head")
    ap.add_argument("--lookups", default="0",
                    help="n-gram lookup drafts per head: 0 (off) and/or MAX:MIN, e.g. 0,4:2")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--model", default=None, help="default: the default model; or hybrid-demo")
    ap.add_argument("--draft-dtype", default="none", help="'none': the target's (the engine's "
                    "default)")
    ap.add_argument("--draft-quantize", default="auto",
                    help="the drafter's weights: auto (the engine's default), q8_0, int8, none")
    ap.add_argument("--controller", default="off", help="'cost': the cost controller on")
    args = ap.parse_args()
    draft_dtype = None if args.draft_dtype == "none" else args.draft_dtype
    draft_quantize = None if args.draft_quantize == "none" else args.draft_quantize
    torch.set_num_threads(args.threads)

    def make(spec):
        return LLM(args.model, dtype="float32", max_batch_size=1, max_seq_len=1024, spec=spec)

    base = make(None)
    _, held = data.split(data.load_conversations("sharegpt"))
    prompts = [data.prompt_ids(base.tokenizer, c, args.max_prompt_tokens)
               for c in held[:args.num_prompts]]
    llms = {"no_spec": base}
    for m in args.methods.split(","):
        for lk in args.lookups.split(","):
            mx, mn = (int(x) for x in (lk.split(":") + ["2"])[:2]) if lk != "0" else (0, 0)
            name = m if not mx else f"{m}+lookup{mx}:{mn}"
            if m in ("ngram", "suffix"):  # lookup drafts (+ the shipped store): no drafter
                extra = {"suffix_decoding_max_cached_requests": 0} if m == "suffix" else {}
                llms[name] = make(SpecConfig(m, args.k, controller=args.controller, **extra))
                continue
            llms[name] = make(SpecConfig(m, args.k, draft_model=getattr(args, f"{m}_dir"),
                                         draft_dtype=draft_dtype,
                                         draft_quantize=draft_quantize,
                                         prompt_lookup_max=mx, prompt_lookup_min=mn if mx else 2,
                                         controller=args.controller))
    for llm in llms.values():  # warm-up
        llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))
    rows = {name: run(llm, prompts, args.max_tokens) for name, llm in llms.items()}
    dec = rows["no_spec"]["step_ms"]
    for r in rows.values():
        r["step_over_decode"] = round(r["step_ms"] / dec, 3)
        r["verify_over_decode"] = round(r["target_forward_ms"] / rows["no_spec"][
            "target_forward_ms"], 3)
        r["speedup_allowed"] = round(r["tokens_per_step"] / r["step_over_decode"], 3)
        r["tokens_per_s"] = round(1e3 * r["tokens_per_step"] / r["step_ms"], 2)
        r["tokens_per_step"] = round(r["tokens_per_step"], 3)
    out = {"machine": machine(), "command": " ".join(["bench/spec_phases.py"] + sys.argv[1:]),
           "k": args.k, "prompts": args.num_prompts, "max_tokens": args.max_tokens,
           "drafter": {"dtype": draft_dtype, "quantize": draft_quantize}, "steps": rows}
    print_json(out, args.json_out)


if __name__ == "__main__":
    main()
