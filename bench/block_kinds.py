"""GGUF block kinds on the "fast" kernels that run them, by rows in the call.

    PYTHONPATH=. python bench/block_kinds.py [--kinds q4_0 q4_1 q5_0 q5_1 q8_0 iq4_nl q4_k
        q5_k q6_k] [--rows 1 4] [--reps 16] [--threads 2] [--json-out FILE]

A step's linears: 30 layers of SmolLM2-135M's (fused q/k/v, o, fused gate/up, down; Q4-Q5:
~60-75 MB, more than a 32 MB last-level cache), quantized by gguf-py (IQ4_NL, which it cannot
quantize: random valid blocks). The K-quants and IQ4_XS (256-value super-blocks, which 576 is not a
multiple of: llama-quantize gives SmolLM2 Q5_0 there) take 12 layers of a 1024-wide model's
(fused q/k/v 1536, o, gate/up 6144, down from 3072; Q4_K ~80 MB), random valid blocks. Per
kind the integer-dot kernel on the GGUF blocks (ops/ggml_int.py) and, for the kinds it has, the
tiled kernel on the repacked copy (ops/ggml_tiled.py: what a deployment runs where the outputs
are in 16s), timed alternately in one process; ms for all the layers (medians of --reps), and
tiled / int. The IQ1 / IQ2 / IQ3 kinds (ops/ggml_iq.c) have no tiled copy: their int_ms beside
Q4_K's (another kind: timed in its own turn, not alternated) is what they cost.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
SHAPES_K, LAYERS_K = [(1536, 1024), (1024, 1024), (6144, 1024), (1024, 3072)], 12
RANDOM = ("iq4_nl", "iq4_xs", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",  # gguf-py cannot make
          "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")


def _shapes(kind: str) -> tuple[list[tuple[int, int]], int]:
    from specdeploy.ops.ggml_linear import block_values

    return (SHAPES_K, LAYERS_K) if block_values(kind) == 256 else (SHAPES, 30)


def _weights(kind: str, rng: np.random.Generator) -> list:
    import gguf

    from specdeploy.ops.ggml_linear import make_weight

    qt = getattr(gguf.GGMLQuantizationType, kind.upper())
    out = []
    shapes, layers = _shapes(kind)
    for _ in range(layers):
        for n, k in shapes:
            if kind in RANDOM:
                from tests.checkpoint.gguf_nemotron_h_layout import random_kquant

                raw = random_kquant(qt, (n, k), rng)
            else:
                raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qt)
            out.append(make_weight(kind, torch.from_numpy(raw), (n, k)))
    return out


def main() -> None:
    from specdeploy.bench import machine, print_json
    from specdeploy.ops import ggml_int, ggml_tiled

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl",
                                                   "iq4_xs", "q2_k", "q3_k", "q4_k", "q5_k",
                                                   "q6_k"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", default="avx2")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    results = {}
    for kind in a.kinds:
        ws = _weights(kind, rng)
        paths = {"int": [ggml_int.bound_linear(w, None, a.isa) for w in ws]}
        if kind in ggml_tiled.TILED_KINDS:
            paths["tiled"] = [ggml_tiled.tiled_linear_fn(ggml_tiled.repack(w), None, a.isa)
                              for w in ws]
        for rows in a.rows:
            xs = {k: torch.randn(rows, k) for _, k in _shapes(kind)[0]}
            times = {name: [] for name in paths}
            for rep in range(a.reps + 1):
                for name in (list(paths) if rep % 2 else list(paths)[::-1]):
                    t = time.perf_counter()
                    for w, f in zip(ws, paths[name]):
                        f(xs[w.shape[1]])
                    if rep:  # one warm-up
                        times[name].append(time.perf_counter() - t)
            row = {f"{name}_ms": round(statistics.median(v) * 1e3, 3)
                   for name, v in times.items()}
            if "tiled" in paths:
                row["tiled_over_int"] = round(row["tiled_ms"] / row["int_ms"], 3)
            results[f"{kind}_rows_{rows}"] = row
            print(kind, rows, row, file=sys.stderr, flush=True)
    print_json({"bench": "block_kinds", "machine": machine(), "threads": a.threads,
                "isa": a.isa, "command": " ".join(["bench/block_kinds.py"] + sys.argv[1:]),
                "results": results}, a.json_out)


if __name__ == "__main__":
    main()
