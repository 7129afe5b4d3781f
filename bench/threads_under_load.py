"""Decoding with a fixed thread count vs `threads="auto"` (engine/threads.py), idle and with one
busy process beside it, in one run.

    .venv/bin/python bench/threads_under_load.py [--threads N] [--max-tokens 256] [--json-out F]

The default model, batch 1, greedy, the first held-out prompt (bench/acceptance.py). Each
configuration decodes the prompt `--rounds` times idle, then again while a spinning process
(pure Python, one core) runs beside it: the load a laptop's browser or build puts on a core.
Prints JSON: tokens/s per configuration and condition, the governor's choice and trial
counts, and the greedy tokens' agreement (auto must give the fixed count's tokens).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance import heldout_prompts  # noqa: E402

from specdeploy import LLM, SamplingParams  # noqa: E402
from specdeploy.bench import machine, print_json  # noqa: E402


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(10000):
            x += 1


def _rate(llm: LLM, prompt: list[int], n: int) -> tuple[float, list[int]]:
    t = time.perf_counter()
    (o,) = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
    return len(o.token_ids) / (time.perf_counter() - t), o.token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--note", default="")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llms = {"fixed": LLM(max_batch_size=1, max_seq_len=1024, threads=args.threads),
            "auto": LLM(max_batch_size=1, max_seq_len=1024, threads="auto")}
    torch.set_num_threads(args.threads)
    prompt = heldout_prompts(llms["fixed"].tokenizer, 1, 256)[0]
    for llm in llms.values():
        _rate(llm, prompt[:32], 8)  # warm-up
    rates: dict = {name: {"idle": [], "one_busy_core": []} for name in llms}
    tokens: dict = {}
    for cond in ("idle", "one_busy_core"):
        stop, proc = mp.Event(), None
        if cond == "one_busy_core":
            proc = mp.Process(target=_spin, args=(stop,), daemon=True)
            proc.start()
            time.sleep(0.5)
        try:
            for _ in range(args.rounds):
                for name, llm in llms.items():
                    if name == "fixed":
                        torch.set_num_threads(args.threads)
                    r, toks = _rate(llm, prompt, args.max_tokens)
                    rates[name][cond].append(round(r, 1))
                    tokens.setdefault(name, toks)
        finally:
            stop.set()
            if proc is not None:
                proc.join(5)
    gov = llms["auto"].engine.threads
    print_json({
        "bench": "threads_under_load", "machine": machine(), "threads": args.threads,
        "command": " ".join(["python"] + sys.argv), "note": args.note,
        "max_tokens": args.max_tokens, "prompt_tokens": len(prompt),
        "tokens_per_s": rates,
        "auto_vs_fixed": {c: round(sum(rates["auto"][c]) / max(sum(rates["fixed"][c]), 1e-9), 3)
                          for c in ("idle", "one_busy_core")},
        "governor": None if gov is None else gov.as_dict(),
        "same_tokens": tokens.get("auto") == tokens.get("fixed")},
        args.json_out)


if __name__ == "__main__":
    main()
