"""Plain decoding vs fixed K = 1..K vs the cost controller (engine/spec_control.py), batch 1.

    .venv/bin/python bench/spec_controller.py [--model NAME] [--methods eagle3,mtp,ngram]
        [--k 3] [--num-prompts 3] [--max-tokens 96] [--threads 2] [--rounds 1]
        [--margins 0,0.05] [--draft-quantize int8|q8_0|auto] [--ignore-eos] [--json-out FILE]

Greedy decoding of the first held-out ShareGPT prompts. One deployment per method at K; fixed
K' < K runs on it with a controller that always asks K' drafts (the same work a K' deployment
does: K' verify rows, K' - 1 chain forwards). Settings take turns prompt by prompt, so a
machine shared with other work slows them alike; with --rounds N the prompts go round N times,
the settings' order rotating by one each prompt (none always follows the same one).
`--margins` adds, per method, a controller at each of those margins (`CostController.margin`:
the share by which a step with drafter drafts must beat plain in the cost model; the engine's
own controller, `{method}_cost`, uses spec_control.DRAFTER_MARGIN), over the same calibration.
`--draft-quantize q8_0` runs the drafter as `SpecConfig`'s default does on a GGUF target (fp32,
Q8_0 weights on the integer-dot kernels); `auto` is that default whatever the target (hybrid-demo,
fp32 safetensors: the drafter in fp32 as the target); the default here, int8, is bf16 with int8
weights.
Prints tokens/s per setting, its ratio to plain (tokens over time, all rounds), the per-round
ratios, the controller's calibration time and its steps by number of drafts.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.bench import machine, print_json
from specdeploy.engine.spec_control import CostController, cut_drafts
from specdeploy.training import data


class FixedK(CostController):
    """Always `k` drafts: drafter chains stop at k, lookup runs are cut to k."""

    def __init__(self, k: int):
        super().__init__(None, k, k, probe_every=0)
        self.fixed = k

    def resized(self, k: int, max_k: int, drafter: bool) -> CostController:
        return self

    def observe(self, seq, accepted: int, drafted: int, from_lookup: bool) -> None:
        pass

    def observe_draft(self, seqs: list, seconds: float) -> bool:  # no cost model to teach
        return False

    def observe_step(self, rows: int, seconds: float, keys: float = 0.0) -> None:
        pass

    def observe_overhead(self, seconds: float) -> None:
        pass

    def plan(self, seqs: list, fixed_rows: int = 0, fixed_tokens: float = 0.0) -> None:
        for s in seqs:
            s.spec.limit = self.fixed

    def cut(self, seqs: list) -> None:
        for s in seqs:
            if len(s.spec.drafts) > self.fixed:
                cut_drafts(s.spec, self.fixed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the default model; or hybrid-demo")
    ap.add_argument("--methods", default="eagle3,mtp,ngram", help="also suffix")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--fixed", default=None, help="fixed K' < K to run, e.g. 1 (default: all)")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--margins", default=None, help="e.g. 0,0.05: a controller at each")
    ap.add_argument("--draft-quantize", default="int8", choices=("int8", "q8_0", "auto"))
    ap.add_argument("--ignore-eos", action="store_true", help="every reply max-tokens long")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    def make(spec):
        return LLM(args.model, dtype="float32", max_batch_size=1, max_seq_len=1024, spec=spec)

    base = make(None)
    _, held = data.split(data.load_conversations("sharegpt"))
    prompts = [data.prompt_ids(base.tokenizer, c, args.max_prompt_tokens)
               for c in held[:args.num_prompts]]
    settings = {"plain": (base, None)}
    calib = {}
    for m in args.methods.split(","):
        drafter = m not in ("ngram", "suffix")  # a drafter model
        bf16 = drafter and args.draft_quantize == "int8"
        # NOTE: no learning from finished requests: the settings of one method share the
        # deployment and ask the same prompt in turn
        llm = make(SpecConfig(m, args.k, draft_dtype="bfloat16" if bf16 else None,
                              draft_quantize=args.draft_quantize if drafter else None,
                              suffix_decoding_max_cached_requests=0,
                              controller="off"))  # calibrated below, timed
        t = time.perf_counter()
        llm.engine.set_controller("cost")
        calib[m] = round(time.perf_counter() - t, 2)
        print(f"{m}: calibrated in {calib[m]} s", file=sys.stderr, flush=True)
        cost = llm.engine.controller  # one controller for all prompts: its global EMAs learn
        for k in range(1, args.k) if args.fixed is None else map(int, args.fixed.split(",")):
            settings[f"{m}_k{k}"] = (llm, FixedK(k))
        settings[f"{m}_k{args.k}"] = (llm, "off")
        settings[f"{m}_cost"] = (llm, cost)
        for x in args.margins.split(",") if args.margins else ():
            settings[f"{m}_cost_margin{x}"] = (llm, CostController(
                llm.engine._measured, args.k, llm.engine.max_k, margin=float(x)))
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=args.ignore_eos)
    for llm, ctl in settings.values():  # warm-up
        if ctl is not None:
            llm.engine.set_controller(ctl)
        llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))
    rows = {n: {"tokens": 0, "s": 0.0, "steps_by_num_drafts": None, "round_rates": []}
            for n in settings}
    names = list(settings)
    for r in range(args.rounds):
        done = {n: (rows[n]["tokens"], rows[n]["s"]) for n in names}
        for i, p in enumerate(prompts):
            shift = (i + r * len(prompts)) % len(names)
            for name in names[shift:] + names[:shift]:
                run_one(name, settings[name], p, sp, rows)
        for n in names:
            rows[n]["round_rates"].append((rows[n]["tokens"] - done[n][0])
                                          / (rows[n]["s"] - done[n][1]))
    plain, plain_rounds = rows["plain"]["tokens"] / rows["plain"]["s"], rows["plain"][
        "round_rates"]
    for r in rows.values():
        r["over_plain_per_round"] = [round(a / b, 3) for a, b in
                                     zip(r.pop("round_rates"), plain_rounds)]
        r["tokens_per_s"] = round(r["tokens"] / r["s"], 2)
        r["over_plain"] = round(r["tokens"] / r["s"] / plain, 3)
        r["s"] = round(r["s"], 2)
    out = {"machine": machine(), "command": " ".join(["bench/spec_controller.py"] + sys.argv[1:]),
           "model": args.model or "default", "k": args.k, "prompts": args.num_prompts,
           "max_tokens": args.max_tokens, "rounds": args.rounds, "batch": 1,
           "calibration_s": calib, "settings": rows}
    print_json(out, args.json_out)


def run_one(name: str, setting, p, sp, rows) -> None:
    """One prompt through one setting; its tokens, time and steps added to `rows[name]`."""
    llm, ctl = setting
    if ctl is not None:
        llm.engine.set_controller(ctl)
        llm.engine.reset_spec_stats()
    t = time.perf_counter()
    (o,) = llm.generate([p], sp)
    rows[name]["s"] += time.perf_counter() - t
    rows[name]["tokens"] += len(o.token_ids)
    print(f"{name}: {rows[name]['tokens'] / rows[name]['s']:.2f} tok/s so far", file=sys.stderr,
          flush=True)
    if ctl is not None:
        s = llm.stats()
        prev = rows[name]["steps_by_num_drafts"] or [0] * len(s["steps_by_num_drafts"])
        rows[name]["steps_by_num_drafts"] = [a + b for a, b in zip(prev,
                                                                   s["steps_by_num_drafts"])]


if __name__ == "__main__":
    main()
