"""Our block kernels vs llama.cpp's own dot products, per 256 values, on the same blocks.

    PYTHONPATH=.:/work/llamacpp .venv/bin/python bench/vs_ggml_vec_dot.py \\
        [--kinds q4_k iq2_xxs ...] [--json-out FILE]

One thread, a 1024 x 4096 matrix of valid blocks (gguf-py's quantization of random values for
Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0, random blocks (tests/checkpoint/gguf_nemotron_h_layout.py
`random_kquant`) for the others; ~0.6-4.4 MB: the kernels' own cost, not memory's). llama.cpp:
libggml-cpu's `ggml_vec_dot_<kind>_<q8_K | q8_0 | q8_1>` over the rows from a C loop (its
activations quantized beforehand by `quantize_row_<that type>`, not timed: what its matmul does
once per call); ours: the integer-dot kernel on the blocks as stored (ops/ggml_int.py,
activation quantization included) and, where a kind has one, the tiled kernel on its repacked
copy (ops/ggml_tiled.py: what a deployment runs by default for every kind but the IQ1 / IQ2 /
ternary ones, which it takes on request). Medians of alternating calls; ns per 256 values (a
K-quant's super-block, 8 blocks of the 32-value kinds) and row, and ours / llama.cpp. Outputs
are checked against each other (the same dot products, another activation quantization: 2% of
the row norm).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
KINDS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "q2_k", "q3_k", "q4_k", "q5_k",
         "q6_k", "iq4_xs", "iq3_s", "iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s",
         "tq2_0", "tq1_0")
# llama.cpp's activation type per kind (the rest: q8_K) and its bytes per 32 values
VEC_DOT_TYPE = {"q4_0": "q8_0", "q5_0": "q8_0", "q8_0": "q8_0", "iq4_nl": "q8_0",
                "q4_1": "q8_1", "q5_1": "q8_1"}
ACT_BYTES = {"q8_0": 34, "q8_1": 36, "q8_K": 292 / 8}
LEGACY = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")  # gguf-py quantizes these
_LOOP = r"""
#include <stddef.h>
typedef void (*vec_dot_t)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void rows_loop(void *fn, int n, int rows, const char *w, size_t row_bytes, const void *y,
               float *out) {
    for (int r = 0; r < rows; r++) ((vec_dot_t)fn)(n, out + r, 0, w + r * row_bytes, 0, y, 0, 1);
}
"""


def _ggml() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    with tempfile.TemporaryDirectory() as tmp:
        src, so = Path(tmp) / "loop.c", Path(tmp) / "loop.so"
        src.write_text(_LOOP)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
        loop = ctypes.CDLL(str(so))
    p = ctypes.c_void_p
    loop.rows_loop.argtypes = [p, ctypes.c_int, ctypes.c_int, p, ctypes.c_size_t, p, p]
    for t in ("q8_K", "q8_0", "q8_1"):
        getattr(lib, f"quantize_row_{t}").argtypes = [p, p, ctypes.c_int64]
    lib.ggml_cpu_init()  # NOTE: fills the fp16 -> fp32 table the dot products read d through
    return lib, loop


def _time(fns: dict, reps: int) -> dict:
    times = {k: [] for k in fns}
    for rep in range(reps + 1):
        for name in (list(fns) if rep % 2 else list(fns)[::-1]):
            t0 = time.perf_counter()
            for _ in range(4):
                fns[name]()
            if rep:
                times[name].append((time.perf_counter() - t0) / 4)
    return {k: statistics.median(v) for k, v in times.items()}


def _kind(kind: str, lib, loop, x, isa: str, shape: tuple, rng, reps: int) -> dict:
    import gguf

    from specdeploy.ops import ggml_int, ggml_tiled
    from specdeploy.ops.ggml_linear import make_weight
    from tests.checkpoint.gguf_nemotron_h_layout import random_kquant

    n, k = shape
    qt = gguf.GGMLQuantizationType[kind.upper()]
    if kind in LEGACY:
        raw = gguf.quants.quantize((rng.standard_normal(shape) * 0.02).astype(np.float32), qt)
        raw = torch.from_numpy(np.ascontiguousarray(raw).reshape(n, -1))
    else:
        raw = torch.from_numpy(random_kquant(qt, shape, rng))
    w = make_weight(kind, raw.reshape(n, -1), shape)
    vt = VEC_DOT_TYPE.get(kind, "q8_K")
    y8 = torch.zeros(int(k // 32 * ACT_BYTES[vt]) + 64, dtype=torch.uint8)
    getattr(lib, f"quantize_row_{vt}")(x.data_ptr(), y8.data_ptr(), k)
    addr = ctypes.cast(getattr(lib, f"ggml_vec_dot_{kind.replace('_k', '_K')}_{vt}"),
                       ctypes.c_void_p).value
    theirs, got = torch.empty(n), {}
    row_bytes = raw[0].numel()
    fns = {"llama.cpp": lambda: loop.rows_loop(addr, k, n, raw.data_ptr(), row_bytes,
                                               y8.data_ptr(), theirs.data_ptr()),
           "int": lambda: got.__setitem__("int", ggml_int.ggml_linear_int(x, w, isa=isa))}
    try:
        tw = ggml_tiled.repack(w)
        fns["tiled"] = lambda: got.__setitem__("tiled", ggml_tiled.tiled_linear(x, tw))
    except (ValueError, RuntimeError) as e:
        print(f"{kind}: no tiled copy ({e})", file=sys.stderr)
    t = _time(fns, reps)
    scale = theirs.norm().item()
    errs = {m: round((v[0] - theirs).norm().item() / scale, 4) for m, v in got.items()}
    if any(e > 0.02 for e in errs.values()):
        raise SystemExit(f"{kind}: outputs disagree with llama.cpp's: {errs}")
    per = 1e9 / (n * k / 256)
    row = {m: round(s * per, 2) for m, s in t.items()}
    row.update({f"{m}_vs_llama.cpp": round(t[m] / t["llama.cpp"], 3) for m in t
                if m != "llama.cpp"}, rel_err=errs)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    from specdeploy.ops import ggml_int

    torch.set_num_threads(1)
    lib, loop = _ggml()
    n, k = 1024, 4096
    rng = np.random.default_rng(0)
    x = torch.randn(1, k)
    isa = ggml_int.default_isa()
    out = {"machine": platform.processor() or platform.machine(), "simd": isa,
           "command": " ".join(sys.argv), "matrix": [n, k], "threads": 1, "kinds": {}}
    for kind in args.kinds:
        row = _kind(kind, lib, loop, x, isa, (n, k), rng, args.reps)
        out["kinds"][kind] = row
        print(kind, json.dumps(row), flush=True)
    text = json.dumps(out, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text if os.environ.get("VERBOSE") else "ns per 256 values and row (1 thread)")


if __name__ == "__main__":
    main()
