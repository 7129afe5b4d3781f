"""The batch-invariant fp32 linear (ops/linear_rows.py) against torch's (the BLAS), by rows.

    PYTHONPATH=. .venv/bin/python bench/fp32_rows.py [--rows 1 4 16 64 256] [--reps 7]
        [--json-out FILE]

Weights: a Qwen3.5-MoE GDN layer's `ssm_out` shape [2048, 4096] (what a Qwen3.5 K-quant GGUF
keeps in fp32: its value-head reorder cannot move K-quant columns) and a [512, 2048] router-like
one, 4 distinct copies each cycled so caches are cold; ms per call (median of --reps rounds of
all copies), both kernels in one process.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdeploy.ops.linear_rows import linear_rows  # noqa: E402

SHAPES = [(2048, 4096), (512, 2048)]


def _time(fn, ws, x, reps: int) -> float:
    fn(x, ws[0])
    per = []
    for _ in range(reps):
        t = time.perf_counter()
        for w in ws:
            fn(x, w)
        per.append((time.perf_counter() - t) / len(ws) * 1e3)
    return statistics.median(per)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    out = {}
    for n, k in SHAPES:
        ws = [torch.randn(n, k) for _ in range(4)]
        for r in args.rows:
            x = torch.randn(r, k)
            blas = _time(F.linear, ws, x, args.reps)
            rows = _time(linear_rows, ws, x, args.reps)
            out[f"{n}x{k}/{r}"] = {"blas_ms": round(blas, 3), "rows_ms": round(rows, 3),
                                   "rows_over_blas": round(rows / blas, 3)}
    result = {"machine": platform.machine(), "threads": torch.get_num_threads(),
              "command": "bench/fp32_rows.py " + " ".join(sys.argv[1:]), "results": out}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
