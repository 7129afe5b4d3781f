"""Batch-invariant fp32 linears (`linear_rows.c`): each output row is the same bits whatever the
other rows of the call and the thread count.

Where the fast GGUF kernels run (`kernels="fast"`: each linear's input rows rounded to 8-bit
blocks), a last-bit difference upstream can move a rounding step and so change an activation
by ~1/127 of its block's scale: a verify row then differs from the decode row it replays by
~1e-3 in logprob, and greedy speculation is not lossless at near-ties of that size. The fp32
linears of such a graph (a GGUF's F32 routers, tensors of types without a block kernel) must
then not depend on the row count, which a BLAS does not promise (GEMV for one row, GEMM or a
K-split for more). This kernel is that. `bench/fp32_rows.py` (bench/results/
fp32_rows_amx_1206.json; 2 threads, AVX-512), time vs the BLAS's for a [2048, 4096] weight:
0.94x at 1 row, 0.60x at 4, 0.87x at 16, 1.16x at 64, 1.56x at 256. Compiled on first use next
to the other kernels; None from `library()` when it cannot be (one warning; callers keep
aten.linear).
"""
from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

from specdeploy.ops import ggml_linear as _gl

SOURCE = Path(__file__).with_name("linear_rows.c")
# NOTE: no -m flags (the AVX2 path carries its target); -ffp-contract=off keeps the generic
# path's operations the ones written (fmaf where the AVX2 path fuses)
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
_I64, _P, _I = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    if os.environ.get("SPECDEPLOY_ROW_KERNELS", "1") == "0":
        return None
    lib, errors = _gl.load_compiled("linear_rows", SOURCE, _FLAGS, {
        "linear_rows": ([_P, _I64, _I64, _P, _I64, _P, _P, _I], None),
        "linear_rows_max_isa": ([_I], _I)})
    if lib is not None:
        return lib
    _gl.warn_unbuilt("the batch-invariant fp32 linear", "; ".join(errors))
    return None


@contextmanager
def max_isa(level: int):
    """Within: no path wider than `level` (0 generic C, 1 AVX2, 2 AVX-512). For tests: the
    same bits on each."""
    lib = library()
    before = lib.linear_rows_max_isa(level)
    try:
        yield
    finally:
        lib.linear_rows_max_isa(before)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """`x[..., K] @ weight[N, K]^T (+ bias)`, fp32 on the CPU, batch-invariant (see above)."""
    n, k = weight.shape
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
            or x.shape[-1] != k):
        raise ValueError(f"linear_rows: fp32 CPU tensors with x[..., {k}], got x {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}, weight {weight.dtype}")
    x2 = x.reshape(-1, k).contiguous()
    w = weight.contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if x2.shape[0]:
        library().linear_rows(x2.data_ptr(), x2.shape[0], k, w.data_ptr(), n,
                              None if b is None else b.data_ptr(), y.data_ptr(),
                              torch.get_num_threads())
    return y.view(*x.shape[:-1], n)


def bound(weight: torch.Tensor, bias: torch.Tensor | None):
    """x -> linear_rows(x, weight, bias) with the weight made contiguous once."""
    w = weight.detach().contiguous()
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()

    def linear_fp32_rows(x: torch.Tensor) -> torch.Tensor:
        return linear_rows(x, w, b)

    return linear_fp32_rows
