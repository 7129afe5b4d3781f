"""Prefill cost of the chunked recurrent scans by scan chunk, with and without boundary states
every `--every` tokens (prefix-cache checkpoints). Prints one JSON object.

    python bench/scan_chunk.py [--tokens 1024] [--every 16] [--threads 1]

Why: hybrid targets deploy with pages of the scan chunk so that every page boundary is a chunk
end (its state comes free). The other way round, shrinking the scan chunk to a small page,
changes the scan's own cost; this measures both on the machine at hand. Sizes: hybrid-demo's
Mamba2 (8 heads, P = N = 64, one group) and a gated delta net of 8 heads, K = V = 64.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial

import torch

from specdeploy.bench import machine, print_json
from specdeploy.ops.gdn import gated_delta_rule_core
from specdeploy.ops.ssm import ssm_scan_core


def _ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t = args.tokens
    x, dl = torch.randn(1, t, 8, 64), torch.rand(1, t, 8) * 0.1
    A, D = -torch.rand(8), torch.randn(8)
    B, C = torch.randn(1, t, 1, 64), torch.randn(1, t, 1, 64)
    q, k, v = (torch.randn(1, t, 8, 64) for _ in range(3))
    g, beta = -torch.rand(1, t, 8) * 0.1, torch.rand(1, t, 8)
    at = torch.tensor([[0, i] for i in range(args.every - 1, t, args.every)])
    rows = []
    for ch in args.chunks:
        row = {"chunk": ch}
        for name, fn, inputs in (("ssm_ms", ssm_scan_core, (x, dl, A, B, C, D, ch, None, False)),
                                 ("gdn_ms", gated_delta_rule_core,
                                  (q, k, v, g, beta, None, True, 0.125, ch, False))):
            row[name] = _ms(partial(fn, *inputs, None), args.reps)
            row[name.replace("_ms", "_with_states_ms")] = _ms(partial(fn, *inputs, at), args.reps)
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    print_json({"machine": machine(), "args": vars(args), "rows": rows}, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
