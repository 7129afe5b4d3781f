"""Greedy agreement with transformers of the exact and the fast (integer-dot) GGUF kernels.

    .venv/bin/python bench/fast_kernels_agreement.py [--model M] [--num-prompts 16]
        [--max-tokens 128] [--json-out FILE]

The fast kernels round each linear's input to 8-bit blocks (ops/ggml_int.py), so their greedy
tokens may leave transformers' fp32 ones where two candidates are close; this measures how
often and how early, on held-out ShareGPT first turns (chat template applied, as in
bench/acceptance.py): per prompt the first position where the continuations differ (None when
all --max-tokens agree; EOS ignored on both sides so every run has the same length), and the
share of identical continuations, for exact vs transformers, fast vs transformers and fast vs
exact; and at each first divergence from transformers, transformers' logit margin between its
pick and the other's (`margins_at_first_divergence`: a small margin is a near-tie). Timing
plays no part (safe to run niced on a busy machine).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance import heldout_prompts  # noqa: E402

from specdeploy import LLM, SamplingParams  # noqa: E402
from specdeploy.bench import hf_model_from_checkpoint, machine, print_json  # noqa: E402


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    firsts = [first_divergence(x, y) for x, y in zip(a, b)]
    diverged = sorted(f for f in firsts if f is not None)
    return {"identical_share": round(sum(f is None for f in firsts) / len(firsts), 3),
            "first_divergence_per_prompt": firsts,
            "median_first_divergence_of_diverged": diverged[len(diverged) // 2]
            if diverged else None,
            "matching_prefix_tokens_share": round(
                sum(len(x) if f is None else f for f, x in zip(firsts, a))
                / sum(len(x) for x in a), 3)}


def margins(hf, prompts: list[list[int]], ref: list[list[int]], other: list[list[int]]
            ) -> list[dict | None]:
    """Per prompt where `other` leaves transformers' tokens: transformers' own logit of its
    pick minus its logit of `other`'s pick at that position (a near-tie is a small margin; the
    logits' spread, max - min, for scale). None where they agree throughout."""
    out = []
    with torch.no_grad():
        for p, r, o in zip(prompts, ref, other):
            f = first_divergence(o, r)
            if f is None or f >= min(len(o), len(r)):
                out.append(None)
                continue
            logits = hf(torch.tensor([p + r[:f]])).logits[0, -1].double()
            out.append({"position": f,
                        "transformers_margin": round(float(logits[r[f]] - logits[o[f]]), 4),
                        "logit_spread": round(float(logits.max() - logits.min()), 2)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    runs, path, t0 = {}, None, time.perf_counter()
    for kernels in ("exact", "fast"):
        llm = LLM(args.model, dtype="float32", max_batch_size=1, max_seq_len=1024,
                  kernels=kernels)
        info = {i.name: i for i in llm.deployed.infos}["ggml_linears"]
        print(f"{kernels}: {info.detail}", file=sys.stderr)
        prompts = heldout_prompts(llm.tokenizer, args.num_prompts, args.max_prompt_tokens)
        runs[kernels] = [llm.generate([p], sp)[0].token_ids for p in prompts]
        path = llm.model_path
        del llm
    hf = hf_model_from_checkpoint(path)
    ref = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                              pad_token_id=0)
            ref.append(out[0, len(p):].tolist())
    print_json({"machine": machine(), "command": " ".join(["python"] + sys.argv),
                "model": str(path), "prompts": len(prompts), "max_tokens": args.max_tokens,
                "split": "held-out ShareGPT first turns (bench/acceptance.py heldout_prompts)",
                "exact_vs_transformers": compare(runs["exact"], ref),
                "fast_vs_transformers": compare(runs["fast"], ref),
                "fast_vs_exact": compare(runs["fast"], runs["exact"]),
                "margins_at_first_divergence": {
                    "exact": margins(hf, prompts, ref, runs["exact"]),
                    "fast": margins(hf, prompts, ref, runs["fast"])},
                "seconds": round(time.perf_counter() - t0, 1)}, args.json_out)


if __name__ == "__main__":
    main()
