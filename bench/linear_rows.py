"""Cost of the linear layers of one step by number of input rows, with caches cold as in a real
step (30 layers' worth of distinct SmolLM2-sized weights), for the ways `pack_linear_weights`
can run a linear: plain `F.linear`, W @ x^T, and a oneDNN-packed weight; and `q4_1`, the same
weights quantized to GGUF Q4_1 blocks and run by `ggml_linears` (ops/ggml_kernels.c; left out
where that kernel cannot be built), `q4_1_dequant` those blocks dequantized one weight at a
time into a reused buffer and multiplied (`ggml_linears`' path above MAX_ROWS rows); and
`q4_1_int_<isa>`, the integer-dot kernels
(ops/ggml_kernels_int.c) on the same blocks, per ISA path this CPU runs, and `q4_1_tiled_<isa>`
the same model on those blocks repacked in tiles of 16 outputs (ops/ggml_tiled.c), AMX off;
`q4_1_tiled_amx` the avx512_vnni path with AMX at every row count, where the CPU has it.
Prints one JSON object (median of --reps, milliseconds for all 30 layers). --lm-head adds
`q8_0_lm_head_tiled_<isa>`: one call of the tied lm_head (49152 x 576, Q8_0 as in the default
GGUF) on the tiled kernel; --only keeps the kinds whose names start with one of its prefixes.

    python bench/linear_rows.py [--rows 1 2 4 6 8 16 64 256] [--reps 5] [--threads 1]
                                [--lm-head] [--only q4_1_tiled q8_0]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

# SmolLM2-135M per layer: fused q/k/v, o, fused gate/up, down
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def _q4_1_blocks(ws) -> dict | None:
    """id(fp32 weight) -> its Q4_1 GGMLWeight (quantized by gguf), or None without the kernel."""
    from specdeploy.ops.ggml_linear import kernel_unavailable, make_weight

    if kernel_unavailable() is not None:
        return None
    import gguf

    out = {}
    for layer in ws:
        for w in layer:
            raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)
            out[id(w)] = make_weight("q4_1", torch.from_numpy(raw), tuple(w.shape))
    return out


def _lm_heads() -> dict:
    """name -> x -> logits: the tied lm_head (49152 x 576) as Q8_0 blocks on the tiled kernel,
    per SIMD ISA path (empty where that kernel cannot be built)."""
    from specdeploy.ops import ggml_tiled
    from specdeploy.ops.ggml_linear import kernel_unavailable, make_weight

    if kernel_unavailable() is not None or ggml_tiled.kernel_unavailable() is not None:
        return {}
    import gguf

    w = torch.randn(49152, 576, generator=torch.Generator().manual_seed(1))
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    tw = ggml_tiled.repack(make_weight("q8_0", torch.from_numpy(raw), tuple(w.shape)))
    return {f"q8_0_lm_head_tiled_{name}":
            _amx_switched(ggml_tiled.tiled_linear_fn(tw, None, isa), rows)
            for name, isa, rows in _tiled_paths()}


def _tiled_paths() -> list[tuple[str, str, int]]:
    """(name, ISA, AMX min rows) of each tiled path to time: the SIMD ISAs with AMX off, then
    `amx` (the avx512_vnni path with AMX at every row count) where this CPU lets us use it."""
    from specdeploy.ops import ggml_tiled

    paths = [(isa, isa, 0) for isa in ggml_tiled.supported_isas() if isa != "scalar"]
    if ggml_tiled.amx_usable():
        paths.append(("amx", "avx512_vnni", 1))
    return paths


def _amx_switched(fn, min_rows: int):
    from specdeploy.ops import ggml_tiled

    def run(*args):
        with ggml_tiled.amx(min_rows):
            return fn(*args)
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time (with --threads 1, what the work costs on "
                         "a machine that other jobs share)")
    ap.add_argument("--lm-head", action="store_true")
    ap.add_argument("--only", nargs="+", default=None, help="kind name prefixes to keep")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    g = torch.Generator().manual_seed(0)
    ws = [[torch.randn(n, k, generator=g) for n, k in SHAPES] for _ in range(LAYERS)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in ws]
    blocks = _q4_1_blocks(ws)
    kinds = {
        "plain": lambda x, w, p: F.linear(x, w),
        "w_xt": lambda x, w, p: torch.mm(w, x.t()).t().contiguous(),
        # one row as two columns: the BLAS threads a GEMM but not a GEMV (pack_linears.py)
        "w_xt_2col": lambda x, w, p: torch.mm(w, torch.cat([x, x]).t())[:, :x.shape[0]].t(),
        "packed": lambda x, w, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
    }
    if blocks is not None:
        from specdeploy.ops.ggml_linear import ggml_linear

        kinds["q4_1"] = lambda x, w, p: ggml_linear(x, blocks[id(w)])
        from specdeploy.deploy.passes.ggml_linears import dequant_linear

        # the one-copy fp32 path of prefill: dequantize into the reused buffer, then the GEMM
        kinds["q4_1_dequant"] = lambda x, w, p: dequant_linear(x, blocks[id(w)], None)
        from specdeploy.ops import ggml_int

        for isa in ggml_int.supported_isas():  # the integer-dot kernels, each ISA path
            kinds[f"q4_1_int_{isa}"] = (
                lambda x, w, p, isa=isa: ggml_int.ggml_linear_int(x, blocks[id(w)], isa=isa))
        from specdeploy.ops import ggml_tiled

        tiled = {k: ggml_tiled.repack(v) for k, v in blocks.items()} \
            if ggml_tiled.kernel_unavailable() is None else {}
        # the same, tiled (not scalar: the reference path, far too slow to time here)
        for name, isa, rows in _tiled_paths() if tiled else ():
            kinds[f"q4_1_tiled_{name}"] = _amx_switched(
                lambda x, w, p, isa=isa: ggml_tiled.tiled_linear(x, tiled[id(w)], isa=isa), rows)
    lm_heads = _lm_heads() if args.lm_head else {}
    keep = (lambda name: any(name.startswith(p) for p in args.only)) if args.only else bool
    kinds = {k: v for k, v in kinds.items() if keep(k)}
    lm_heads = {k: v for k, v in lm_heads.items() if keep(k)}
    out = {}
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
        times = {k: [] for k in kinds}
        for _ in range(args.reps):  # interleaved: the three share the machine's drift
            for name, fn in kinds.items():
                t0 = clock()
                for layer_w, layer_p in zip(ws, packed):
                    for w, p in zip(layer_w, layer_p):
                        fn(xs[w.shape[1]], w, p)
                times[name].append((clock() - t0) * 1e3)
            for name, fn in lm_heads.items():
                times.setdefault(name, [])
                x = xs[576]
                t0 = clock()
                fn(x)
                times[name].append((clock() - t0) * 1e3)
        out[f"rows_{m}"] = {k: round(statistics.median(v), 1) for k, v in times.items()}
    print(json.dumps({"machine": {"cores": os.cpu_count(), "torch": torch.__version__,
                                  "threads": args.threads,
                                  "clock": args.clock},
                      "command": " ".join(["python"] + sys.argv), "ms_for_30_layers": out},
                     indent=1))


if __name__ == "__main__":
    main()
