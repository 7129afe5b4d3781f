"""One GGUF's load time, peak RSS and decode rate (batch 1, 96 tokens, 3 runs, 2 threads) under
the tree on PYTHONPATH: run it under two trees to compare them, e.g. before and after a kind
kept its blocks.

    PYTHONPATH=OLD_TREE .venv/bin/python bench/gguf_before_after.py FILE.gguf old
    PYTHONPATH=. .venv/bin/python bench/gguf_before_after.py FILE.gguf new
"""
from __future__ import annotations

import json
import resource
import sys
import time


def main() -> None:
    t0 = time.time()
    import torch

    from specdeploy import LLM, SamplingParams

    torch.set_num_threads(2)
    llm = LLM(sys.argv[1], max_batch_size=1, max_seq_len=512)
    load = time.time() - t0
    prompt = list(range(5, 40))
    rates = []
    for _ in range(3):
        (o,) = llm.generate([prompt], SamplingParams(max_tokens=96, ignore_eos=True))
        rates.append(o.metrics.decode_tokens_per_s)
    print(json.dumps({"tree": sys.argv[2], "file": sys.argv[1].split("/")[-1],
                      "load_s": round(load, 1),
                      "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                      "decode_tok_s": sorted(round(r, 1) for r in rates)}))


if __name__ == "__main__":
    main()
