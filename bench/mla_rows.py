"""One decode row of DeepSeek's absorbed MLA attention on the CPU: the C row kernel's wide path
(ops/attention_wide.c) against the per-row torch fallback that ran before it (SDPA over the
row's gathered keys, `cached_attention._decode_one`), in one process.

    PYTHONPATH=. .venv/bin/python bench/mla_rows.py [--heads 128 16] [--lens 512 2048 8192]
        [--reps 7] [--threads 1 2] [--json-out FILE]

Widths as released: one KV head of 576 (latent 512 + rope 64) whose value is its first 512
dims (one cache, `PagedKV(value_in_key=True)`), pages of 64 in a shuffled page table, the row at
the last position. ms per call: the median of --reps (the fallback: of max(2, reps // 3) where
one call passes a second); the C path with fp32 and bf16 caches, the fallback with fp32; at
each thread count. On a shared machine, 1 thread is the steadier figure: a 2-thread call waits
for both threads, so a core taken by another process costs a scheduler slice (~4 ms).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdeploy.ops import attention_rows as ar  # noqa: E402
from specdeploy.ops import cached_attention as ca  # noqa: E402

D, DV, PS, SCALE = 576, 512, 64, 0.1352


def _machine() -> dict:
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": model, "arch": platform.machine(), "cores": os.cpu_count(),
            "simd": sorted(f for f in flags if f in {"avx2", "fma", "f16c", "avx512f",
                                                     "avx512_bf16", "amx_bf16"}),
            "torch": torch.__version__}


def _time(fn, args: tuple, reps: int) -> float:
    fn(*args)
    t = time.perf_counter()
    fn(*args)
    once = time.perf_counter() - t
    n = max(2, reps // 3) if once > 1.0 else reps
    per = []
    for _ in range(n):
        t = time.perf_counter()
        fn(*args)
        per.append((time.perf_counter() - t) * 1e3)
    return statistics.median(per)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    ap.add_argument("--lens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    if ar.unavailable():
        raise SystemExit(f"the C row kernel is unavailable here: {ar.unavailable()}")
    load0 = os.getloadavg()
    g = torch.Generator().manual_seed(0)
    out = {}
    for hq in args.heads:
        for n in args.lens:
            pages = torch.randperm(-(-n // PS), generator=g)
            kc = torch.randn(pages.numel(), PS, 1, D, generator=g)
            kb = kc.bfloat16()
            q = torch.randn(1, hq, D, generator=g)
            for th in args.threads:
                torch.set_num_threads(th)
                c32 = _time(ar.attention_rows, (q, kc, kc[..., :DV], pages, n - 1, SCALE),
                            args.reps)
                c16 = _time(ar.attention_rows, (q, kb, kb[..., :DV], pages, n - 1, SCALE),
                            args.reps)
                torch_ms = _time(ca._decode_one, (q, kc, kc[..., :DV], pages, n - 1, SCALE),
                                 args.reps)
                out[f"heads{hq}/len{n}/threads{th}"] = {
                    "c_fp32_ms": round(c32, 3), "c_bf16_ms": round(c16, 3),
                    "torch_fallback_fp32_ms": round(torch_ms, 3),
                    "speedup_fp32": round(torch_ms / c32, 1),
                    "c_fp32_gflops": round(2 * hq * n * (D + DV) / c32 / 1e6, 1)}
    result = {"machine": _machine(),
              "loadavg_before_after": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
              "command": "bench/mla_rows.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "results": out}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
