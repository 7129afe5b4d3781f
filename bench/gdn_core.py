"""The chunked gated delta rule (ops/gdn.py `gated_delta_rule_core`, what a Qwen3.5 / Qwen3-Next
prefill runs per linear-attention layer) under the tree on PYTHONPATH: run it under two trees
to compare them.

    PYTHONPATH=OLD_TREE .venv/bin/python bench/gdn_core.py [--tokens 384] [--heads 16 32]
    PYTHONPATH=. .venv/bin/python bench/gdn_core.py ...

Random inputs of Qwen3-Next's linear-attention shape by default (16 q / k heads, 32 value
heads, 128 wide), one sequence, l2norm on, a start state; the machine's threads. Prints JSON:
the median and minimum of 15 calls (after 2), and a checksum of the outputs (equal across
trees when the change keeps the bits).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--heads", type=int, nargs=2, default=[16, 32], metavar=("HK", "H"))
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    from specdeploy.ops.gdn import gated_delta_rule_core

    torch.manual_seed(0)
    (hk, h), d, t = args.heads, args.dim, args.tokens
    q, k, v = torch.randn(1, t, hk, d), torch.randn(1, t, hk, d), torch.randn(1, t, h, d)
    g, beta = -torch.rand(1, t, h) * 0.5, torch.rand(1, t, h)
    s0 = torch.randn(1, h, d, d) * 0.1
    times = []
    for i in range(args.reps + 2):
        t0 = time.perf_counter()
        out = gated_delta_rule_core(q, k, v, g, beta, s0, True, 0.0, 64)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    print(json.dumps({
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "command": " ".join(sys.argv), "tree": os.environ.get("PYTHONPATH", ""),
        "shape": {"tokens": t, "qk_heads": hk, "v_heads": h, "dim": d},
        "median_ms": round(statistics.median(times) * 1e3, 2), "min_ms": round(min(times) * 1e3, 2),
        "checksum": [round(out.o.double().sum().item(), 6),
                     round(out.final_state.double().sum().item(), 6)]}))


if __name__ == "__main__":
    main()
