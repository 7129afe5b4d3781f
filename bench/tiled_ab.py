"""The tiled GGUF kernel (ops/ggml_tiled.c) against another build of it, in one process.

    PYTHONPATH=. python bench/tiled_ab.py --baseline-source OLD.c [--kinds q4_1 q8_0 q4_0
        q4_k q5_k q6_k] [--rows 1 2 4 8] [--reps 60] [--threads 2] [--lm-head] [--json-out FILE]

A step's linears: 30 layers of SmolLM2-135M's (fused q/k/v, o, fused gate/up, down; ~66 MB
of Q4_1, more than a 32 MB last-level cache, so the weights come from memory as in a decode
step), each weight quantized by gguf-py and repacked once; `--lm-head` adds the tied 49152 x
576 Q8_0 LM head as a kind of its own (`lm_q8_0`). The baseline source and this tree's are
compiled with the deployment's flags; per rep both run, in alternating order, and the JSON
gives each one's median and the median (and quartiles) of the per-rep ratio this / baseline,
so a drift of a shared host hits both sides of a ratio. Outputs are compared bit for bit.
The K-quants take bench/block_kinds.py's weights (12 layers of a 1024-wide model, random valid
super-blocks). OLD.c's #includes are read beside it (a copy of the ops directory's files).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def _load(stem: str, source: Path):
    from specdeploy.ops import ggml_linear as gl
    from specdeploy.ops import ggml_tiled

    lib, errors = gl.load_compiled(stem, source, ggml_tiled._FLAGS, {
        "ggml_tiled_linear": ([ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                               ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_int], ctypes.c_int)})
    if lib is None:
        raise SystemExit(f"{source}: {'; '.join(errors)}")
    return lib


def _weights(kind: str) -> list[tuple[int, int, torch.Tensor]]:
    import gguf

    from specdeploy.ops import ggml_tiled
    from specdeploy.ops.ggml_linear import make_weight

    if kind.endswith("_k"):  # (block_kinds.py: the script's own directory is on sys.path)
        import numpy as np
        from block_kinds import _weights as kind_weights

        return [(*w.shape, ggml_tiled.repack(w).packed)
                for w in kind_weights(kind, np.random.default_rng(0))]
    g = torch.Generator().manual_seed(0)
    qk = "q8_0" if kind == "lm_q8_0" else kind
    qt = getattr(gguf.GGMLQuantizationType, qk.upper())
    shapes = [(49152, 576)] if kind == "lm_q8_0" else SHAPES * LAYERS
    out = []
    for n, k in shapes:
        raw = gguf.quants.quantize(torch.randn(n, k, generator=g).numpy(), qt)
        out.append((n, k, ggml_tiled.repack(make_weight(qk, torch.from_numpy(raw),
                                                        (n, k))).packed))
    return out


def _run(lib, ws, xs, ys, code: int, isa: int, rows: int, threads: int) -> float:
    t = time.perf_counter()
    for n, k, w in ws:
        if lib.ggml_tiled_linear(code, isa, xs[k].data_ptr(), rows, k, w.data_ptr(), n,
                                 ys[n].data_ptr(), threads):
            raise RuntimeError("the kernel failed")
    return time.perf_counter() - t


def main() -> None:
    from specdeploy.bench import machine, print_json
    from specdeploy.ops import ggml_int, ggml_tiled
    from specdeploy.ops.ggml_linear import KINDS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-source", type=Path, required=True)
    ap.add_argument("--kinds", nargs="+", default=["q4_1", "q8_0"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", default="avx2")
    ap.add_argument("--lm-head", action="store_true")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    libs = {"baseline": _load("ggml_tiled_ab_baseline", a.baseline_source),
            "this": _load("ggml_tiled_ab_this", ggml_tiled.SOURCE)}
    isa = ggml_int.ISAS.index(a.isa)
    results = {}
    for kind in a.kinds + (["lm_q8_0"] if a.lm_head else []):
        code = KINDS["q8_0" if kind == "lm_q8_0" else kind][0]
        ws = _weights(kind)
        for rows in a.rows:
            xs = {k: torch.randn(rows, k) for _, k, _ in ws}
            ys = {name: {n: torch.empty(rows, n) for n, _, _ in ws} for name in libs}

            times = {name: [] for name in libs}
            for rep in range(a.reps + 2):
                for name in (("baseline", "this") if rep % 2 else ("this", "baseline")):
                    dt = _run(libs[name], ws, xs, ys[name], code, isa, rows, a.threads)
                    if rep >= 2:  # two warm-ups
                        times[name].append(dt)
            ratios = sorted(t / b for t, b in zip(times["this"], times["baseline"]))
            q = len(ratios) // 4
            results[f"{kind}_rows_{rows}"] = {
                "baseline_ms": round(statistics.median(times["baseline"]) * 1e3, 3),
                "this_ms": round(statistics.median(times["this"]) * 1e3, 3),
                "ratio_median": round(statistics.median(ratios), 3),
                "ratio_quartiles": [round(ratios[q], 3), round(ratios[-q - 1], 3)],
                "same_bits": all(torch.equal(ys["this"][n], ys["baseline"][n])
                                 for n in ys["this"])}
            print(kind, rows, results[f"{kind}_rows_{rows}"], file=sys.stderr, flush=True)
    print_json({"bench": "tiled_ab", "machine": machine(), "threads": a.threads, "isa": a.isa,
                "command": " ".join(["bench/tiled_ab.py"] + sys.argv[1:]),
                "baseline_source": str(a.baseline_source), "results": results}, a.json_out)


if __name__ == "__main__":
    main()
