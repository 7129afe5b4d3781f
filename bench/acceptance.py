"""Acceptance and speedup of trained drafters on the held-out ShareGPT split, in one run.

    .venv/bin/python bench/acceptance.py [--model M] [--methods eagle3,mtp] [--ks 1,2,3,4,5]
        [--num-prompts 16] [--max-tokens 64] [--speed-prompts 4] [--hf] [--json-out FILE]

1. Acceptance: for each head (shipped heads of the default model unless --eagle3-dir/--mtp-dir)
   and K, the mean accepted length (1 + accepted / verify steps, bonus included) and per-position
   acceptance over `--num-prompts` held-out prompts (the first user turn; the split recorded in
   the heads' training.json), greedy and at temperature 0.7 (rejection sampling, fixed seed).
2. Speed at batch size 1, greedy (lossless, so every run makes the same tokens): decode tokens/s
   without speculation, with each head at `--speed-ks` (and each --lookups setting), and (--hf)
   transformers' `generate` (a per-token rate: it always makes --decode-tokens tokens), run
   interleaved over `--speed-rounds` rounds; medians of rates and of per-round ratios.
   `--draft-dtype bfloat16 --draft-quantize int8` deploys the heads at that precision (both parts).

One deployment per head serves every K <= max K when the target has no recurrent state (a
Llama: the KV cache is positional, nothing else depends on K); other targets rebuild per K.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.bench import hf_model_from_checkpoint, machine, peak_rss_mib, print_json
from specdeploy.engine.speculative import SpecEngine
from specdeploy.training import data


def heldout_prompts(tok, n: int, max_prompt_tokens: int) -> list[list[int]]:
    _, held = data.split(data.load_conversations("sharegpt"))
    return [data.prompt_ids(tok, c, max_prompt_tokens) for c in held[:n]]


def with_k(llm: LLM, k: int, max_batch_size: int) -> None:
    """Point `llm` at a fresh SpecEngine drafting k tokens (k <= the deployed K)."""
    d = llm.deployed
    d.num_draft_tokens = k
    llm.engine = SpecEngine(d, llm.tokenizer, max_batch_size=max_batch_size, seed=0,
                            eos_token_ids=llm.engine.eos_token_ids)


def spec_config(args, method: str, k: int, draft: str | None) -> SpecConfig:
    # NOTE: sized for the longest lookup run asked for (a recurrent target's spec state)
    longest = max([t or 0 for _, (lk, t), _ in variants(args, method) if lk] + [0])
    return SpecConfig(method, k, draft_model=draft, draft_dtype=args.draft_dtype,
                      draft_quantize=args.draft_quantize, prompt_lookup_max=4 if longest else 0,
                      prompt_lookup_num_tokens=max(longest, k) if longest else None,
                      controller="off")


def spec_llm(args, method: str, k: int, draft: str | None) -> LLM:
    return LLM(args.model, dtype="float32", max_batch_size=args.batch_size,
               max_seq_len=args.max_seq_len, spec=spec_config(args, method, k, draft))


def variants(args, method: str) -> list[tuple[str, tuple, float]]:
    """(name, (n-gram lookup (max n, min n) or None, lookup drafts or None = K),
    draft_min_prob) per --lookups x --draft-min-probs."""
    out = []
    for v in args.lookups:
        mx, mn, n = (v.split(":") + ["", ""])[:3]
        mx, mn, n = int(mx), int(mn or min(2, int(mx))), int(n) if n else None
        if method == "ngram" and not mx:
            continue  # lookup is all it drafts with
        name = method if mx == 0 else f"{method}+lookup{mx}:{mn}" + (f":{n}" if n else "")
        for p in args.draft_min_probs:
            out.append((name + (f"+stop{p:g}" if p else ""),
                        ((mx, mn) if mx else None, n), p))
    return out


def acceptance(args, prompts) -> dict:
    out: dict = {}
    for method in args.methods:
        draft = getattr(args, f"{method}_dir", None)
        kmax = max(args.ks)
        llm = spec_llm(args, method, kmax, draft)
        reuse = not llm.deployed._spec_pairs  # no recurrent spec state: K is free up to kmax
        for k in args.ks:
            if reuse:
                with_k(llm, k, args.batch_size)
            else:
                llm = spec_llm(args, method, k, draft)
            for name, lookup, min_prob in variants(args, method):
                llm.engine.draft_min_prob = min_prob
                row = out.setdefault(name, {})[f"K={k}"] = {}
                for temp in args.temperatures:
                    sp = SamplingParams(max_tokens=args.max_tokens, temperature=temp, seed=0)
                    llm.engine.set_lookup(*lookup)  # NOTE: resets the counters
                    t = time.perf_counter()
                    outs = llm.generate(prompts, sp)
                    s = llm.engine.spec_stats.as_dict()
                    row[f"temperature={temp}"] = r = {
                        "mean_accepted_length": round(s["mean_accepted_length"], 3),
                        "acceptance_rate": round(s["acceptance_rate"], 3),
                        "acceptance_per_position": [round(a, 3)
                                                    for a in s["acceptance_per_position"]],
                        "draft_steps": s["draft_steps"],
                        "output_tokens": sum(len(o.token_ids) for o in outs),
                        "wall_s": round(time.perf_counter() - t, 1)}
                    if min_prob:
                        steps = max(s["draft_steps"] + s["undrafted_steps"], 1)
                        r["drafts_per_step"] = round(s["draft_tokens"] / steps, 3)
                        r["undrafted_share_of_steps"] = round(s["undrafted_steps"] / steps, 3)
                    if lookup:
                        r["lookup_share_of_steps"] = round(
                            s["lookup_steps"] / max(s["draft_steps"], 1), 3)
                        r["lookup_mean_accepted_length"] = round(
                            1 + s["lookup_accepted_tokens"] / max(s["lookup_steps"], 1), 3)
                    print(f"{name} K={k} T={temp}: {r}", file=sys.stderr)
        del llm
    return out


def decode_time(llm: LLM, prompt, n: int, ignore_eos: bool) -> tuple[int, float]:
    """(decode tokens, seconds) of one greedy request (prefill excluded). Greedy speculation is
    lossless, so every configuration makes the same tokens even when EOS ends a reply early."""
    (o,) = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=ignore_eos))
    tokens = len(o.token_ids) - 1
    return tokens, tokens / o.metrics.decode_tokens_per_s


@torch.inference_mode()
def hf_time(model, prompt, n: int) -> tuple[int, float]:
    """transformers' generate: n tokens minus a 1-token run (its prefill)."""
    x = torch.tensor([prompt])
    times = []
    for m in (1, n):
        t = time.perf_counter()
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=m,
                       min_new_tokens=m, do_sample=False, pad_token_id=0)
        times.append(time.perf_counter() - t)
    return n - 1, times[1] - times[0]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def speed(args, prompts) -> dict:
    """Every configuration is deployed first, then `--speed-rounds` rounds run them interleaved
    (each prompt through every configuration in turn), so a noisy machine slows all of them
    alike; rates and ratios are medians over rounds (each round's ratio taken within it)."""
    n, ps = args.decode_tokens, prompts[:args.speed_prompts]
    configs: dict = {"no_spec": (LLM(args.model, dtype="float32", max_batch_size=1,
                                     max_seq_len=args.max_seq_len), None, None)}
    model_path = configs["no_spec"][0].model_path
    for method in args.methods:
        for k in args.speed_ks:
            llm = LLM(args.model, dtype="float32", max_batch_size=1, max_seq_len=args.max_seq_len,
                      spec=spec_config(args, method, k, getattr(args, f"{method}_dir", None)))
            for name, lookup, min_prob in variants(args, method):
                configs[f"{name}_K={k}"] = (llm, (lookup, min_prob), k)
    hf = hf_model_from_checkpoint(model_path) if args.hf else None
    for llm, _, _ in configs.values():  # warm-up
        llm.generate([ps[0]], SamplingParams(max_tokens=4, ignore_eos=True))
    rates: dict = {name: [] for name in configs}
    accepted: dict = {name: [] for name in configs}
    if hf is not None:
        rates["transformers"] = []
    for r in range(args.speed_rounds):
        tot = {name: [0, 0.0] for name in rates}
        for p in ps:
            for name, (llm, setting, k) in configs.items():
                if k is not None:
                    lookup, llm.engine.draft_min_prob = setting
                    llm.engine.set_lookup(*lookup)  # NOTE: resets the counters
                t, sec = decode_time(llm, p, n, args.ignore_eos)
                tot[name][0] += t
                tot[name][1] += sec
                if k is not None:
                    st = llm.stats()  # NOTE: steps left undrafted count, as in SpecStats
                    accepted[name].append((st["accepted_tokens"],
                                           st["draft_steps"] + st["undrafted_steps"]))
            if hf is not None:
                t, sec = hf_time(hf, p, n)
                tot["transformers"][0] += t
                tot["transformers"][1] += sec
        for name, (t, sec) in tot.items():
            rates[name].append(t / sec)
        print(f"speed round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rates.items()),
              file=sys.stderr)
    base = rates["no_spec"]
    res = {"decode_tokens": n, "prompts": len(ps), "rounds": args.speed_rounds,
           "ignore_eos": args.ignore_eos, "draft_dtype": args.draft_dtype,
           "draft_quantize": args.draft_quantize,
           "no_spec_tokens_per_s": round(_median(base), 2),
           "no_spec_tokens_per_s_per_round": [round(x, 2) for x in base]}
    if hf is not None:
        res["transformers_generate_tokens_per_s"] = round(_median(rates["transformers"]), 2)
        res["no_spec_vs_transformers"] = round(
            _median([a / b for a, b in zip(base, rates["transformers"])]), 3)
    for name in configs:
        if name == "no_spec":
            continue
        acc = sum(a for a, _ in accepted[name]) / max(sum(s for _, s in accepted[name]), 1)
        row = res[name] = {
            "tokens_per_s": round(_median(rates[name]), 2),
            "speedup_vs_no_spec": round(_median([a / b for a, b in zip(rates[name], base)]), 3),
            "speedup_vs_no_spec_per_round": [round(a / b, 3) for a, b in zip(rates[name], base)],
            "mean_accepted_length": round(1 + acc, 3)}
        if hf is not None:
            row["speedup_vs_transformers"] = round(
                _median([a / b for a, b in zip(rates[name], rates["transformers"])]), 3)
        print(f"speed {name}: {row}", file=sys.stderr)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--methods", default="eagle3,mtp",
                    help="any of eagle3, mtp, ngram (lookup drafts only: give --lookups)")
    ap.add_argument("--eagle3-dir", default=None, help="default: the shipped head")
    ap.add_argument("--mtp-dir", default=None, help="default: the shipped head")
    ap.add_argument("--ks", default="1,2,3,4,5")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8, help="acceptance runs only")
    ap.add_argument("--speed-prompts", type=int, default=3)
    ap.add_argument("--speed-ks", default="3")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--lookups", default="0",
                    help="n-gram lookup settings per head, MAX[:MIN[:TOKENS]]: n-gram lengths and "
                         "how many drafts a match makes (default K); 0 = the plain head")
    ap.add_argument("--draft-min-probs", default="0",
                    help="draft confidence stops per head (SpecConfig.draft_min_prob; 0 = off)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="speed runs: decode exactly --decode-tokens (past EOS) per prompt")
    ap.add_argument("--speed-rounds", type=int, default=3,
                    help="interleaved rounds over all configurations (medians reported)")
    ap.add_argument("--draft-dtype", default=None, help="e.g. bfloat16 (default: the target's)")
    ap.add_argument("--draft-quantize", default=None, help="int8: weight-only drafter")
    ap.add_argument("--hf", action="store_true", help="also time transformers' generate")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    args.ks = [int(k) for k in args.ks.split(",")]
    args.speed_ks = [int(k) for k in args.speed_ks.split(",") if k]
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.lookups = [v for v in args.lookups.split(",") if v]
    args.draft_min_probs = [float(p) for p in args.draft_min_probs.split(",") if p]
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdeploy.checkpoint.shipped import resolve_model_name
    from specdeploy.tokenizer import load_tokenizer

    name, args.model = args.model, resolve_model_name(args.model)  # e.g. "hybrid-demo"
    tok = load_tokenizer(args.model)
    prompts = heldout_prompts(tok, max(args.num_prompts, args.speed_prompts),
                              args.max_prompt_tokens)
    t0 = time.perf_counter()
    result = {"machine": machine(), "command": " ".join(sys.argv),
              "model": name or "default (SmolLM2-135M-Instruct)",
              "heldout_prompts": args.num_prompts, "max_tokens": args.max_tokens,
              "acceptance": acceptance(args, prompts[:args.num_prompts])}
    if not args.skip_speed:
        result["speed_bs1"] = speed(args, prompts)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["peak_rss_mib"] = round(peak_rss_mib(), 1)
    print_json(result, args.json_out)


if __name__ == "__main__":
    main()
