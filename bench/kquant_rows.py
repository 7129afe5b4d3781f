"""GGUF K-quant matrices (Q4_K / Q5_K / Q6_K) on the exact block kernel and on the integer-dot
one (`<kind>_int_<isa>`, kernels="fast") against fp32 and Q4_0, by input rows, one run:
milliseconds for all the calls (median of --reps, caches cold: --layers distinct weights
cycled) and bytes per weight.

The shapes are a Qwen3.5-MoE-like layer's (hidden 2048; an expert's gate+up [1024, 2048] and
down [2048, 512]) plus a square 2048 projection. K-quant blocks are random valid ones (gguf-py
cannot quantize to them), Q4_0 is gguf-py's quantization of the fp32 weights.

    PYTHONPATH=. python bench/kquant_rows.py [--rows 1 4 8 16] [--reps 7] [--threads 2]
        [--isa avx2] [--baseline-source OLD.c] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SHAPES = [(2048, 2048), (1024, 2048), (2048, 512)]


def _linear_int(lib, x: torch.Tensor, w, isa: str) -> torch.Tensor:
    from specdeploy.ops import ggml_int
    from specdeploy.ops.ggml_linear import KINDS

    y = torch.empty(x.shape[0], w.shape[0])
    if lib.ggml_linear_int(KINDS[w.kind][0], ggml_int.ISAS.index(isa), x.data_ptr(), x.shape[0],
                           x.shape[1], w.blocks.data_ptr(), w.shape[0], y.data_ptr(),
                           torch.get_num_threads()):
        raise RuntimeError("baseline kernel failed")
    return y


def main() -> None:
    import gguf

    from specdeploy.ops import ggml_int
    from specdeploy.ops.ggml_linear import ggml_linear, load_compiled, make_weight
    from tests.checkpoint.gguf_nemotron_h_layout import Q, random_kquant

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--isa", help="the integer kernel's ISA path (default: the best here)")
    ap.add_argument("--baseline-source", type=Path,
                    help="another version of ggml_kernels_int.c (e.g. `git show "
                    "<commit>:specdeploy/ops/ggml_kernels_int.c > old.c`), timed beside this "
                    "one as <kind>_int_<isa>_baseline")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    kinds: dict[str, list] = {"fp32": [], "q4_0": [], "q4_k": [], "q5_k": [], "q6_k": []}
    qt = {"q4_0": Q.Q4_0, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
    for _ in range(args.layers):
        for n, k in SHAPES:
            a = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
            kinds["fp32"].append(torch.from_numpy(a))
            kinds["q4_0"].append(make_weight("q4_0", torch.from_numpy(
                gguf.quants.quantize(a, Q.Q4_0)), (n, k)))
            for name in ("q4_k", "q5_k", "q6_k"):
                kinds[name].append(make_weight(name, torch.from_numpy(
                    random_kquant(qt[name], (n, k), rng)), (n, k)))
    out = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
           "command": " ".join(sys.argv), "shapes": SHAPES, "layers": args.layers, "ms": {},
           "bytes_per_weight": {"fp32": 4.0, **{k: round(v[0].blocks.numel() / (
               v[0].shape[0] * v[0].shape[1]), 4) for k, v in kinds.items() if k != "fp32"}}}
    baseline = None
    if args.baseline_source:
        baseline, errors = load_compiled("ggml_kernels_int_baseline", args.baseline_source,
                                         ggml_int._FLAGS, {"ggml_linear_int": (
                                             [ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                              ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                              ctypes.c_int, ctypes.c_void_p, ctypes.c_int],
                                             ctypes.c_int)})
        if baseline is None:
            raise SystemExit(f"--baseline-source: {'; '.join(errors)}")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for _, k in SHAPES}
        isa = None if ggml_int.kernel_unavailable() else (args.isa or ggml_int.default_isa())
        runs = [(name, ws, torch.nn.functional.linear if name == "fp32" else ggml_linear)
                for name, ws in kinds.items()]
        if isa is not None:  # the integer-dot kernels (kernels="fast"), 8-bit activations
            runs += [(f"{name}_int_{isa}", ws,
                      lambda x, w, isa=isa: ggml_int.ggml_linear_int(x, w, isa=isa))
                     for name, ws in kinds.items() if name != "fp32"]
            if baseline is not None:
                runs += [(f"{name}_int_{isa}_baseline", ws,
                          lambda x, w, isa=isa: _linear_int(baseline, x, w, isa))
                         for name, ws in kinds.items() if name != "fp32"]
        for _name, ws, fn in runs:
            for w in ws:  # warm-up
                fn(xs[w.shape[1]], w)
        times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
        for _ in range(args.reps):  # NOTE: the runs interleaved rep by rep (a noisy host)
            for name, ws, fn in runs:
                t0 = time.perf_counter()
                for w in ws:
                    fn(xs[w.shape[1]], w)
                times[name].append((time.perf_counter() - t0) * 1e3)
        for name, ts in times.items():
            out["ms"].setdefault(name, {})[rows] = round(statistics.median(ts), 3)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
