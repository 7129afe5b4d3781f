"""Acceptance and speedup of trained drafters on the held-out ShareGPT split, in one run.

    .venv/bin/python bench/acceptance.py [--model M] [--methods eagle3,mtp] [--ks 1,2,3,4,5]
        [--num-prompts 16] [--max-tokens 64] [--speed-prompts 4] [--hf] [--json-out FILE]

1. Acceptance: for each head (shipped heads of the default model unless --eagle3-dir/--mtp-dir)
   and K, the mean accepted length (1 + accepted / verify steps, bonus included) and per-position
   acceptance over `--num-prompts` held-out prompts (the first user turn; the split recorded in
   the heads' training.json), greedy and at temperature 0.7 (rejection sampling, fixed seed).
2. Speed at batch size 1, greedy (lossless, so every run makes the same tokens): decode tokens/s
   without speculation, with each head at `--speed-ks` (and each --lookups setting), and (--hf)
   transformers' `generate` (a per-token rate: it always makes --decode-tokens tokens).

One deployment per head serves every K <= max K when the target has no recurrent state (a
Llama: the KV cache is positional, nothing else depends on K); other targets rebuild per K.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.bench import hf_model_from_checkpoint, machine, peak_rss_mib
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


def spec_llm(args, method: str, k: int, draft: str | None) -> LLM:
    return LLM(args.model, dtype="float32", max_batch_size=args.batch_size,
               max_seq_len=args.max_seq_len, spec=SpecConfig(method, k, draft_model=draft))


def variants(args, method: str) -> list[tuple[str, tuple[int, int] | None]]:
    """(name, n-gram lookup (max n, min n)) pairs run for a head, one per --lookups value."""
    out = []
    for v in args.lookups:
        mx, _, mn = v.partition(":")
        mx, mn = int(mx), int(mn or min(2, int(mx)))
        out.append((method, None) if mx == 0 else (f"{method}+lookup{mx}:{mn}", (mx, mn)))
    return out


def acceptance(args, prompts) -> dict:
    out: dict = {}
    for method in args.methods:
        draft = getattr(args, f"{method}_dir")
        kmax = max(args.ks)
        llm = spec_llm(args, method, kmax, draft)
        reuse = not llm.deployed._spec_pairs  # no recurrent spec state: K is free up to kmax
        for k in args.ks:
            if reuse:
                with_k(llm, k, args.batch_size)
            else:
                llm = spec_llm(args, method, k, draft)
            for name, lookup in variants(args, method):
                llm.engine.lookup = lookup
                row = out.setdefault(name, {})[f"K={k}"] = {}
                for temp in args.temperatures:
                    sp = SamplingParams(max_tokens=args.max_tokens, temperature=temp, seed=0)
                    llm.engine.spec_stats = type(llm.engine.spec_stats)(k)
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
                    if lookup:
                        r["lookup_share_of_steps"] = round(
                            s["lookup_steps"] / max(s["draft_steps"], 1), 3)
                        r["lookup_mean_accepted_length"] = round(
                            1 + s["lookup_accepted_tokens"] / max(s["lookup_steps"], 1), 3)
                    print(f"{name} K={k} T={temp}: {r}", file=sys.stderr)
        del llm
    return out


def decode_rate(llm: LLM, prompts, n: int, ignore_eos: bool) -> float:
    """Decode tokens/s over the prompts (prefill excluded). Greedy speculation is lossless, so
    every configuration makes the same tokens even when EOS ends a reply early."""
    sp = SamplingParams(max_tokens=n, ignore_eos=ignore_eos)
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    tokens = secs = 0.0
    for p in prompts:
        (o,) = llm.generate([p], sp)
        m = o.metrics
        tokens += len(o.token_ids) - 1
        secs += (len(o.token_ids) - 1) / m.decode_tokens_per_s
    return tokens / secs


@torch.inference_mode()
def hf_rate(model, prompts, n: int) -> float:
    tokens = secs = 0.0
    for p in prompts:
        x = torch.tensor([p])
        times = []
        for m in (1, n):
            t = time.perf_counter()
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=m,
                           min_new_tokens=m, do_sample=False, pad_token_id=0)
            times.append(time.perf_counter() - t)
        tokens += n - 1
        secs += times[1] - times[0]  # prefill (the 1-token run) subtracted
    return tokens / secs


def speed(args, prompts) -> dict:
    n, ps = args.decode_tokens, prompts[:args.speed_prompts]
    base = LLM(args.model, dtype="float32", max_batch_size=1, max_seq_len=args.max_seq_len)
    res = {"decode_tokens": n, "prompts": len(ps), "ignore_eos": args.ignore_eos,
           "no_spec_tokens_per_s": round(decode_rate(base, ps, n, args.ignore_eos), 2)}
    model_path = base.model_path
    del base
    for method in args.methods:
        for k in args.speed_ks:
            llm = LLM(args.model, dtype="float32", max_batch_size=1, max_seq_len=args.max_seq_len,
                      spec=SpecConfig(method, k, draft_model=getattr(args, f"{method}_dir")))
            for name, lookup in variants(args, method):
                llm.engine.lookup = lookup
                llm.engine.spec_stats = type(llm.engine.spec_stats)(k)
                rate = decode_rate(llm, ps, n, args.ignore_eos)
                st = llm.stats()
                res[f"{name}_K={k}"] = {
                    "tokens_per_s": round(rate, 2),
                    "speedup_vs_no_spec": round(rate / res["no_spec_tokens_per_s"], 3),
                    "mean_accepted_length": round(st["mean_accepted_length"], 3)}
                print(f"speed {name} K={k}: {res[f'{name}_K={k}']}", file=sys.stderr)
            del llm
    if args.hf:
        hf = hf_model_from_checkpoint(model_path)
        res["transformers_generate_tokens_per_s"] = round(hf_rate(hf, ps, n), 2)
        for v in list(res.values()):
            if isinstance(v, dict):
                v["speedup_vs_transformers"] = round(
                    v["tokens_per_s"] / res["transformers_generate_tokens_per_s"], 3)
        res["no_spec_vs_transformers"] = round(
            res["no_spec_tokens_per_s"] / res["transformers_generate_tokens_per_s"], 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--methods", default="eagle3,mtp")
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
                    help="n-gram lookup settings per head, MAX[:MIN] n (0 = the plain head)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="speed runs: decode exactly --decode-tokens (past EOS) per prompt")
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
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdeploy.tokenizer import load_tokenizer

    tok = load_tokenizer(args.model)
    prompts = heldout_prompts(tok, max(args.num_prompts, args.speed_prompts),
                              args.max_prompt_tokens)
    t0 = time.perf_counter()
    result = {"machine": machine(), "command": " ".join(sys.argv),
              "model": args.model or "default (SmolLM2-135M-Instruct)",
              "heldout_prompts": args.num_prompts, "max_tokens": args.max_tokens,
              "acceptance": acceptance(args, prompts[:args.num_prompts])}
    if not args.skip_speed:
        result["speed_bs1"] = speed(args, prompts)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["peak_rss_mib"] = round(peak_rss_mib(), 1)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
