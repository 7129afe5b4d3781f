"""A/B of two builds of the integer-dot kernel (ops/ggml_kernels_int.c and the files it includes),
alternating in one process: ns per super-block and row, and B / A, per kind and row count. The
two outputs must be bit-identical (a change of schedule, not of arithmetic).

    mkdir -p /tmp/ab/A /tmp/ab/B
    cp specdeploy/ops/ggml_kernels_int.c specdeploy/ops/ggml_iq*.c /tmp/ab/A/   # baseline
    cp ... /tmp/ab/B/                                                           # the change
    PYTHONPATH=. .venv/bin/python bench/int_ab.py /tmp/ab/A /tmp/ab/B iq2_xxs,iq3_s 1,4

Random blocks (tests/checkpoint/gguf_nemotron_h_layout.py `random_kquant`), a 1024 x 2048
matrix (L2-sized: the kernel's own cost, not memory's), 1 thread, 40 alternations of 5 calls.
"""
from __future__ import annotations

import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import gguf

    from specdeploy.ops import ggml_int as gi
    from specdeploy.ops import ggml_iq
    from specdeploy.ops import ggml_linear as gl
    from tests.checkpoint.gguf_nemotron_h_layout import random_kquant

    ptr, int_ = ctypes.c_void_p, ctypes.c_int
    libs = []
    for d in sys.argv[1:3]:
        lib, err = gl.load_compiled("ab_" + Path(d).name, Path(d) / "ggml_kernels_int.c",
                                    gi._FLAGS, {"ggml_linear_int": (
                                        [int_, int_, ptr, int_, int_, ptr, int_, ptr, int_], int_),
                                        "ggml_iq_init": ([ptr], None)})
        if lib is None:
            raise SystemExit(f"{d}: {err}")
        ggml_iq.init(lib)
        libs.append(lib)
    kinds, rows = sys.argv[3].split(","), [int(r) for r in sys.argv[4].split(",")]
    torch.set_num_threads(1)
    n, k = 1024, 2048
    for kind in kinds:
        w = torch.from_numpy(random_kquant(gguf.GGMLQuantizationType[kind.upper()], (n, k),
                                           np.random.default_rng(0)))
        for r in rows:
            x, ys = torch.randn(r, k), [torch.empty(r, n) for _ in libs]
            times = [[], []]
            for rep in range(41):
                for i in ((0, 1) if rep % 2 else (1, 0)):
                    t0 = time.perf_counter()
                    for _ in range(5):
                        libs[i].ggml_linear_int(gl.KINDS[kind][0], 1, x.data_ptr(), r, k,
                                                w.data_ptr(), n, ys[i].data_ptr(), 1)
                    if rep:  # one warm-up
                        times[i].append((time.perf_counter() - t0) / 5)
            if not torch.equal(ys[0], ys[1]):
                raise SystemExit(f"{kind} rows {r}: the builds' outputs differ")
            a, b = statistics.median(times[0]), statistics.median(times[1])
            per = 1e9 / (n * k / 256) / r
            print(f"{kind} rows {r}: A {a * per:.1f} B {b * per:.1f} ns a super-block row, "
                  f"B / A {b / a:.3f}")


if __name__ == "__main__":
    main()
