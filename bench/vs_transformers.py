"""specdeploy vs transformers' `generate` on the same model, prompts and machine, in one run.

    .venv/bin/python bench/vs_transformers.py [--model M] [--threads 2] [--json-out FILE]

Measures (fp32, greedy, EOS ignored so both make the same number of tokens):
  1. batch size 1 decode tokens/s: ours (engine decode rate) vs `generate` ((N-1) tokens over the
     time beyond a 1-token generate, i.e. prefill subtracted);
  2. C concurrent ShareGPT requests (closed loop) vs transformers running them one by one.
Prints one JSON object with the machine, the command and the ratios.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from specdeploy import LLM, SamplingParams
from specdeploy.bench import (
    hf_model_from_checkpoint,
    load_prompts,
    machine,
    peak_rss_mib,
    print_json,
    run_closed_loop,
)


@torch.inference_mode()
def hf_generate(model, ids: list[int], n: int) -> tuple[list[int], float]:
    x = torch.tensor([ids])
    t = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist(), time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--backend", default="graph")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    llm = LLM(args.model, dtype="float32", max_batch_size=args.concurrency, max_seq_len=1024,
              backend=args.backend, progress=True)
    hf = hf_model_from_checkpoint(llm.model_path)
    tok = llm.tokenizer

    # 1. batch size 1 decode.
    n = args.decode_tokens
    prompt = llm.chat_ids([{"role": "user", "content": "Tell me a long story about a robot."}])
    sp = SamplingParams(max_tokens=n, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    (ours,) = llm.generate([prompt], sp)
    hf_generate(hf, prompt, 8)  # warm-up
    _, t1 = hf_generate(hf, prompt, 1)
    hf_ids, tn = hf_generate(hf, prompt, n)
    ours_bs1 = ours.metrics.decode_tokens_per_s
    hf_bs1 = (n - 1) / (tn - t1)
    agree = next((i for i, (a, b) in enumerate(zip(ours.token_ids, hf_ids)) if a != b), n)

    # 2. concurrent ShareGPT vs sequential transformers.
    texts = load_prompts("sharegpt", args.num_prompts)
    ids = [tok.encode(t)[: args.max_prompt_tokens] for t in texts]
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    conc = run_closed_loop(llm, ids, sp, args.concurrency)
    t = time.perf_counter()
    hf_tokens = sum(len(hf_generate(hf, p, args.max_tokens)[0]) for p in ids)
    hf_wall = time.perf_counter() - t
    hf_tps = hf_tokens / hf_wall

    result = {
        "machine": machine(), "command": " ".join(sys.argv), "model": str(llm.model_path),
        "backend": args.backend, "dtype": "float32",
        "bs1_decode": {"ours_tokens_per_s": ours_bs1, "transformers_tokens_per_s": hf_bs1,
                       "ratio": ours_bs1 / hf_bs1, "tokens": n, "prompt_tokens": len(prompt),
                       "greedy_tokens_agree_prefix": agree},
        "concurrent": {"concurrency": args.concurrency, "num_prompts": len(ids),
                       "max_tokens": args.max_tokens,
                       "ours_tokens_per_s": conc["output_tokens_per_s"],
                       "transformers_sequential_tokens_per_s": hf_tps,
                       "ratio": conc["output_tokens_per_s"] / hf_tps,
                       "ours_ttft_s": conc["ttft_s"], "ours_itl_s": conc["itl_s"]},
        "peak_rss_mib": peak_rss_mib(),
    }
    print_json(result, args.json_out, indent=2)


if __name__ == "__main__":
    main()
