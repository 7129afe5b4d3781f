"""`make demo`: the embedded default model on a few chat prompts, without speculative decoding
and with `SpecConfig("auto")` (its fastest measured lossless configuration): text, tokens/s, the
speedup and the mean accepted length."""
from __future__ import annotations

import time

from specdeploy import LLM, SamplingParams, SpecConfig

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "List the days of the week.",
    "Explain in two sentences why the sky is blue.",
]


def run(llm: LLM, label: str) -> tuple[list[str], float]:
    sp = SamplingParams(max_tokens=64)
    texts, tokens, wall = [], 0, 0.0
    for prompt in PROMPTS:  # one at a time: the batch size 1 rate
        t0 = time.perf_counter()
        (out,) = llm.chat([{"role": "user", "content": prompt}], sp)
        wall += time.perf_counter() - t0
        tokens += len(out.token_ids)
        texts.append(out.text.strip())
        print(f"\n[{label}] >>> {prompt}\n{out.text.strip()}")
    stats = llm.stats()
    line = f"\n[{label}] {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tokens/s"
    if "mean_accepted_length" in stats:
        # NOTE: lookup runs may go past K; positions never reached are left out
        per = [round(a, 2) for a in stats["acceptance_per_position"]]
        while len(per) > stats["num_draft_tokens"] and not per[-1]:
            per.pop()
        line += (f", mean accepted length {stats['mean_accepted_length']:.2f} "
                 f"(per position {per})")
    print(line)
    return texts, tokens / wall


def describe(spec) -> str:
    parts = [spec.method, f"K={spec.num_draft_tokens}"]
    if spec.method not in ("ngram", "suffix") and spec.prompt_lookup_max:
        parts.append("+ n-gram lookup")
    if spec.controller == "cost":
        parts.append("cost controller")
    return ", ".join(parts)


ROUNDS = 3  # timed rounds after the shown run, the two deployments alternating


def timed(llm: LLM) -> float:
    """tokens/s of one silent pass over the prompts (greedy: the same tokens as shown)."""
    sp, tokens, wall = SamplingParams(max_tokens=64), 0, 0.0
    for prompt in PROMPTS:
        t0 = time.perf_counter()
        (out,) = llm.chat([{"role": "user", "content": prompt}], sp)
        wall += time.perf_counter() - t0
        tokens += len(out.token_ids)
    return tokens / wall


def main() -> None:
    # SpecConfig("auto"): the fastest lossless configuration bench/vs_llamacpp.py measured for
    # the default model (specdeploy/spec_auto.py), with the controller that drafts only where
    # drafts pay on this machine
    plain_llm = LLM(max_batch_size=1, max_seq_len=1024, progress=True)
    plain, plain_rate = run(plain_llm, "no speculation")
    # NOTE: no learning from finished requests (a suffix store's online part): the timed
    # rounds ask the same prompts again, and drafting their own replies back would flatter it
    spec = LLM(max_batch_size=1, max_seq_len=1024, progress=True,
               spec=SpecConfig("auto", suffix_decoding_max_cached_requests=0))
    label = f"speculative ({describe(spec.spec)})"
    texts, rate = run(spec, label)
    # NOTE: one pass of a few seconds swings by +-10% on a shared machine; the speedup is the
    # median of rounds in which the two deployments alternate
    ratios = [rate / plain_rate]
    for _ in range(ROUNDS - 1):
        p = timed(plain_llm)
        ratios.append(timed(spec) / p)
    ratios.sort()
    print(f"\nspeculative decoding: {ratios[len(ratios) // 2]:.2f}x the tokens/s of no "
          f"speculation (median of {len(ratios)} alternating rounds: "
          f"{', '.join(f'{r:.2f}' for r in ratios)})")
    print("greedy outputs identical with and without speculation:", texts == plain)


if __name__ == "__main__":
    main()
