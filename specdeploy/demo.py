"""`make demo`: load the embedded default model and chat a little (text and tokens/s)."""
from __future__ import annotations

import time

from specdeploy import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
]


def main() -> None:
    llm = LLM(max_batch_size=len(PROMPTS), max_seq_len=1024, progress=True)
    sp = SamplingParams(max_tokens=96)
    for prompt in PROMPTS:  # one at a time: the batch size 1 decode rate
        (out,) = llm.chat([{"role": "user", "content": prompt}], sp)
        m = out.metrics
        print(f"\n>>> {prompt}\n{out.text.strip()}\n[{len(out.token_ids)} tokens, "
              f"ttft {m.ttft * 1000:.0f} ms, decode {m.decode_tokens_per_s or 0:.1f} tokens/s]")
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], sp)
    wall = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    print(f"\nall {len(PROMPTS)} prompts as one batch: {n} tokens in {wall:.2f} s "
          f"= {n / wall:.1f} tokens/s")


if __name__ == "__main__":
    main()
