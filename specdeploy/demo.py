"""`make demo`: the embedded default model on a few chat prompts, without and with speculative
decoding (the EAGLE-3 head shipped for it, alone and with n-gram lookup drafts): text, tokens/s
and the mean accepted length."""
from __future__ import annotations

import time

from specdeploy import LLM, SamplingParams, SpecConfig

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "List the days of the week.",
    "Explain in two sentences why the sky is blue.",
]


def run(llm: LLM, label: str) -> list[str]:
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
    return texts


# The drafter in bf16 with int8 weights: a draft step on a CPU is bound by reading its weights,
# and drafts never change the output (the fp32 target verifies them).
DRAFTER = dict(draft_dtype="bfloat16", draft_quantize="int8")


def main() -> None:
    plain = run(LLM(max_batch_size=1, max_seq_len=1024, progress=True), "no speculation")
    spec = LLM(max_batch_size=1, max_seq_len=1024, progress=True,
               spec=SpecConfig("eagle3", num_draft_tokens=3, **DRAFTER))
    texts = run(spec, "EAGLE-3, K=3")
    del spec
    # lookup runs start at K and double while accepted whole, up to 16 drafts
    hybrid = LLM(max_batch_size=1, max_seq_len=1024, progress=True,
                 spec=SpecConfig("eagle3", num_draft_tokens=3, prompt_lookup_max=4,
                                 prompt_lookup_num_tokens=16, **DRAFTER))
    texts_lookup = run(hybrid, "EAGLE-3 + n-gram lookup, K=3")
    print("\ngreedy outputs identical with and without speculation:",
          texts == plain and texts_lookup == plain)


if __name__ == "__main__":
    main()
