"""Prefill with and without the GGUF kernels' AMX path (ops/ggml_tiled.py), side by side: the
default model (fast kernels, 2 threads unless --threads), one request of --prompt-len held-out
prompt tokens and one output token (the time to the first token is the prefill's), rounds
interleaved between the settings in one deployment (AMX's thresholds are read at each kernel
call). Prints JSON: per setting the median seconds and prompt tokens/s, and the median of
per-round ratios. Where the CPU has no AMX, says so and measures nothing.

    .venv/bin/python bench/prefill_amx.py [--prompt-len 512] [--rounds 7] [--threads 2]
        [--json-out FILE]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance import heldout_prompts  # noqa: E402

from specdeploy import LLM, SamplingParams  # noqa: E402
from specdeploy.bench import machine, print_json  # noqa: E402
from specdeploy.ops import ggml_tiled  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    head = {"machine": machine(), "command": " ".join(sys.argv),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if not ggml_tiled.amx_usable():
        print_json({**head, "skipped": "no AMX-INT8 on this CPU (or not granted)"},
                   args.json_out)
        return
    llm = LLM(max_batch_size=1, max_seq_len=args.prompt_len + 64)
    ids: list[int] = []
    for p in heldout_prompts(llm.tokenizer, 64, 448):  # held-out text, joined to the length
        ids += p
        if len(ids) >= args.prompt_len:
            break
    ids = ids[:args.prompt_len]
    sp = SamplingParams(max_tokens=1, temperature=0)
    settings = {"amx": ggml_tiled.amx_min_rows(), "no_amx": 0}
    times: dict[str, list[float]] = {k: [] for k in settings}
    for r in range(args.rounds + 1):  # the first round warms up, not counted
        for name in (settings if r % 2 else reversed(settings)):
            with ggml_tiled.amx(settings[name]):
                llm.reset_prefix_cache()  # NOTE: else the second run reuses the first's pages
                t0 = time.perf_counter()
                llm.generate([ids], sp)
                dt = time.perf_counter() - t0
            if r:
                times[name].append(dt)
    out = {name: {"seconds": round(statistics.median(v), 4),
                  "prompt_tokens_per_s": round(args.prompt_len / statistics.median(v), 1),
                  "per_round_s": [round(x, 4) for x in v]} for name, v in times.items()}
    ratio = statistics.median(b / a for a, b in zip(times["amx"], times["no_amx"]))
    print_json({**head, "prompt_len": args.prompt_len, "rounds": args.rounds,
                "amx_min_rows": settings["amx"], "settings": out,
                "amx_speedup": round(ratio, 3)}, args.json_out)


if __name__ == "__main__":
    main()
