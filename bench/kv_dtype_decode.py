"""Decode speed and KV bytes of one model at a long context with each KV cache dtype
(`kv_cache_dtype`): one deployment per dtype in one process, rounds alternating between them.

    PYTHONPATH=. .venv/bin/python bench/kv_dtype_decode.py [--model PATH] [--context 2048]
        [--tokens 64] [--rounds 3] [--dtypes auto fp8 fp8_e5m2] [--threads N] [--json-out FILE]

Each round: one request of `--context` prompt tokens (random ids from the vocabulary, seeded),
then `--tokens` greedy tokens (ignore_eos); decode tokens/s = tokens after the first over the
time after the first token: wall time, or with --threads 1 this thread's CPU time (the
engine and its kernels run on it; steadier on a shared machine). Ratios to the first dtype are
medians of per-round ratios. KV bytes per token: the plan's paged-KV bytes a page over its page
size.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.mla_rows import _machine  # noqa: E402
from specdeploy import LLM, SamplingParams  # noqa: E402
from specdeploy.cache.handlers import PagedKV  # noqa: E402


def _kv_bytes_per_token(llm: LLM) -> int:
    ps = llm.deployed.layout.page_size
    return sum(h.bytes_per_page(ps) for h in llm.deployed.resources
               if isinstance(h, PagedKV)) // ps


def _decode_rate(llm: LLM, prompt: list[int], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    first = []
    for out in llm.generate_stream(prompt, params):
        if not first and out.token_ids:
            first.append(clock())
    return (tokens - 1) / (clock() - first[0]) if first else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["auto", "fp8", "fp8_e5m2"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    max_len = a.context + a.tokens + 16
    llms = {d: LLM(a.model, kv_cache_dtype=d, max_batch_size=1, max_seq_len=max_len,
                   threads=a.threads) for d in a.dtypes}
    vocab = llms[a.dtypes[0]].deployed.hf_config.get("vocab_size", 32000)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab - 100, (a.context,), generator=g).tolist()
    rates = {d: [] for d in a.dtypes}
    for llm in llms.values():  # warm: graphs recorded, pages touched
        _decode_rate(llm, prompt[:64], 4)
    for _ in range(a.rounds):
        for d, llm in llms.items():
            rates[d].append(_decode_rate(llm, prompt, a.tokens))
            llm.reset_prefix_cache()
    base = a.dtypes[0]
    out = {"bench": "kv_dtype_decode", "machine": _machine(), "command": " ".join(sys.argv),
           "model": a.model or "default", "context": a.context, "tokens": a.tokens,
           "threads": torch.get_num_threads(),
           "rows": [{"kv_cache_dtype": d,
                     "cache_dtype": str({h.dtype for h in llms[d].deployed.resources
                                         if isinstance(h, PagedKV)}),
                     "kv_bytes_per_token": _kv_bytes_per_token(llms[d]),
                     "decode_tokens_per_s": round(statistics.median(rates[d]), 2),
                     "vs_" + base: round(statistics.median(
                         x / b for x, b in zip(rates[d], rates[base])), 3),
                     "rounds": [round(x, 2) for x in rates[d]]} for d in a.dtypes]}
    text = json.dumps(out, indent=1)
    print(text)
    if a.json_out:
        Path(a.json_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
