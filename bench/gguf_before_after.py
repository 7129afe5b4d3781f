"""One GGUF's load time, peak RSS and decode rate (batch 1, 96 tokens, 3 runs, 2 threads) under
the tree on PYTHONPATH: run it under two trees to compare them, e.g. before and after a kind
kept its blocks.

    PYTHONPATH=OLD_TREE .venv/bin/python bench/gguf_before_after.py FILE.gguf old
    PYTHONPATH=. .venv/bin/python bench/gguf_before_after.py FILE.gguf new [--spec mtp]

FILE "default" is the embedded default model; `--spec METHOD` (eagle3, mtp, ...: SpecConfig's
methods, K = 3, the cost controller) deploys it speculatively (its shipped heads, a GGUF's own
MTP layers), for what a drafter costs in memory. FILE may be a checkpoint directory (a bf16
safetensors one: SPECDEPLOY_HALF_BLOCKS=0 / 1 for before / after); `--prefill` adds a
384-token prompt's prefill rate.
"""
from __future__ import annotations

import argparse
import json
import resource
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("tree")
    ap.add_argument("--spec", default=None)
    ap.add_argument("--prefill", action="store_true", help="+ a 384-token prompt's prefill rate")
    args = ap.parse_args()
    t0 = time.time()
    import torch

    from specdeploy import LLM, SamplingParams, SpecConfig

    torch.set_num_threads(2)
    spec = None if args.spec is None else SpecConfig(args.spec, 3)
    llm = LLM(None if args.file == "default" else args.file, max_batch_size=1, max_seq_len=512,
              spec=spec)
    load = time.time() - t0
    prompt = "Write a short story about a robot who learns to paint, in five sentences."
    rates = []
    for _ in range(3):
        (o,) = llm.generate([prompt], SamplingParams(max_tokens=96, ignore_eos=True))
        rates.append(o.metrics.decode_tokens_per_s)
    prefill = []  # a 384-token prompt's time to its first token (the engine's chunks)
    for _ in range(3 if args.prefill else 0):
        (o,) = llm.generate([list(range(100, 484))], SamplingParams(max_tokens=1))
        prefill.append(384 / o.metrics.ttft)
    print(json.dumps({"tree": args.tree, "file": args.file.split("/")[-1], "spec": args.spec,
                      "prefill_tok_s": sorted(round(r, 1) for r in prefill) or None,
                      "load_s": round(load, 1),
                      "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                      "rss_after_mib": _rss_mib(),
                      "decode_tok_s": sorted(round(r, 1) for r in rates)}))


def _rss_mib() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return int(f.read().split("VmRSS:")[1].split()[0]) // 1024
    except (OSError, IndexError, ValueError):
        return None


if __name__ == "__main__":
    main()
