"""One decode row of attention on the CPU's C kernel (ops/attention_rows.c) over a paged cache
held as fp32, bf16, fp16, FP8 E4M3 or E5M2 (`kv_cache_dtype`), in one process, the dtypes
interleaved within each round: what the cache dtype costs or saves per step at a context
length (the cache is read once per row; FP8 reads a quarter of fp32's bytes, half of bf16's).

    PYTHONPATH=. .venv/bin/python bench/kv_dtype_rows.py [--lens 1024 4096 16384] [--rounds 7]
        [--threads 1] [--json-out FILE]

Llama-3-8B's heads (32 query heads, 8 KV heads of 128), pages of 16 in a shuffled page table,
the row at the last position. ms per call (at 1 thread the thread's CPU time, steadier on a
shared machine; else wall time): the median over rounds; ratios to bf16 (the fast
path's default cache) are medians of per-round ratios. bf16 is read as fp32 here (the
AVX512-BF16 dot products off) so every dtype takes the same arithmetic.
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
from specdeploy.ops import attention_rows as ar  # noqa: E402

HQ, HKV, D, PS = 32, 8, 128, 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _once(q, kc, vc, pages, pos, reps: int = 5) -> float:
    # NOTE: this thread's CPU time at 1 thread (a shared machine's other processes take cores,
    # not this thread's time), wall time otherwise
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    t = clock()
    for _ in range(reps):
        ar.attention_rows(q, kc, vc, pages, pos, D ** -0.5)
    return (clock() - t) / reps * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    if ar.unavailable() is not None:
        print(json.dumps({"error": f"attention kernel unavailable: {ar.unavailable()}"}))
        return 1
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    with ar.bf16_dots(False):
        for n in a.lens:
            pages = torch.randperm(n // PS, generator=g)
            k = torch.randn(n // PS, PS, HKV, D, generator=g)
            v = torch.randn(n // PS, PS, HKV, D, generator=g)
            caches = {name: (k.to(dt), v.to(dt)) for name, dt in DTYPES.items()}
            q = torch.randn(1, HQ, D, generator=g)
            times = {name: [] for name in DTYPES}
            for kc, vc in caches.values():  # warm
                _once(q, kc, vc, pages, n - 1, 1)
            for _ in range(a.rounds):
                for name, (kc, vc) in caches.items():
                    times[name].append(_once(q, kc, vc, pages, n - 1))
            med = {name: statistics.median(t) for name, t in times.items()}
            ratio = {name: statistics.median(b / x for b, x in zip(times["bf16"], t))
                     for name, t in times.items()}
            rows.append({"keys": n, "ms": {k2: round(v2, 4) for k2, v2 in med.items()},
                         "speed_vs_bf16": {k2: round(v2, 3) for k2, v2 in ratio.items()},
                         "cache_MiB_per_layer": {
                             name: round(2 * kc.numel() * kc.element_size() / 2 ** 20, 2)
                             for name, (kc, _) in caches.items()}})
    out = {"bench": "kv_dtype_rows", "machine": _machine(), "threads": a.threads,
           "heads": [HQ, HKV, D], "page_size": PS, "rounds": a.rounds,
           "command": " ".join(sys.argv), "rows": rows}
    text = json.dumps(out, indent=1)
    print(text)
    if a.json_out:
        Path(a.json_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
