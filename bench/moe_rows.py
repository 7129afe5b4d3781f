"""A MoE layer's fp32 / bf16 routed experts: one C call (linear_rows.c `moe_rows`) against the
per-expert loop of BLAS GEMMs (ops/moe.py `moe_experts_fast`), by tokens, in one process.

    PYTHONPATH=. .venv/bin/python bench/moe_rows.py [--tokens 1 4 16 64 128 256 1024]
        [--reps 20] [--threads 2] [--json-out FILE]

Shapes: hybrid-demo's (8 experts of 256 -> 192 -> 256, top-2, relu2) and a Qwen3.5-MoE-like
layer (64 experts of 1024 -> 2 x 256 -> 1024, top-8, swiglu); weights fp32 and bf16, inputs in
the weights' dtype, random routing (distinct experts per token). ms per call, median of --reps
after 3 warm-up calls. `ops/moe.py`'s ONE_CALL_MAX_TOKENS is where the loop starts winning.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdeploy.bench import machine, print_json  # noqa: E402
from specdeploy.ops import linear_rows  # noqa: E402
from specdeploy.ops.moe import moe_experts_fast  # noqa: E402

SHAPES = {"hybrid-demo": (8, 256, 192, 2, "relu2"),
          "qwen3.5-moe-like": (64, 1024, 256, 8, "swiglu")}


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    per = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        per.append(time.perf_counter() - t)
    return statistics.median(per) * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256, 1024])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (e, h, i, k, act) in SHAPES.items():
        n_up = 2 * i if act == "swiglu" else i
        for dtype in (torch.float32, torch.bfloat16):
            w_up = (torch.randn(e, n_up, h, generator=g) / h**0.5).to(dtype)
            w_down = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
            for t in args.tokens:
                x = torch.randn(t, h, generator=g).to(dtype)
                ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
                wts = torch.rand(t, k, generator=g)
                reps = max(3, args.reps if t <= 128 else args.reps // 4)
                args = (x, ids, wts, w_up, w_down, act)
                loop = _time(lambda a=args: moe_experts_fast(*a), reps)
                one = _time(lambda a=args: linear_rows.moe_rows(*a), reps)
                out[f"{name}/{str(dtype)[6:]}/{t}"] = {
                    "loop_ms": round(loop, 3), "one_call_ms": round(one, 3),
                    "loop_over_one_call": round(loop / one, 2)}
    result = {"machine": machine(), "command": "bench/moe_rows.py " + " ".join(sys.argv[1:]),
              "results": out}
    print_json(result, args.json_out)
    return result


if __name__ == "__main__":
    main()
