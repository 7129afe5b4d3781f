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
from specdeploy.ops import row_kernels

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
        "linear_rows_max_isa": ([_I], _I),
        "moe_rows": ([_P, _I64, _I64, _P, _P, _I64, _I64, _P, _I64, _P, _I64, _I, _I, _P, _P,
                      _I, _P, _P, ctypes.c_float, ctypes.c_float], _I)})
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

    linear_fp32_rows.rows_call = (w, b)  # what a fused MoE block (ops/moe_block.py) calls
    return linear_fp32_rows


# linear_rows.c's ACT_* values, in order; "swiglu_oai": gpt-oss's clamped SwiGLU (ops/moe_bias.py)
ACTIVATIONS = ("swiglu", "relu2", "swiglu_oai")
WEIGHT_TYPES = (torch.float32, torch.bfloat16, torch.float16)  # its `wt` values, in order


def moe_unavailable() -> str | None:
    """None where `moe_rows` runs here, else why not (it needs the row kernels' SiLU)."""
    if library() is None:
        return "the batch-invariant fp32 kernel could not be built"
    if row_kernels._library() is None:
        return "the row kernels (their SiLU) could not be built"
    return None


def moe_rows(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             w_up: torch.Tensor, w_down: torch.Tensor, activation: str,
             b_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
             alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """A MoE layer's routed experts in one C call (`moe_rows` in linear_rows.c): x [T, H],
    topk_ids / topk_weights [T, k], w_up [E, I or 2I (swiglu / swiglu_oai, gate rows first),
    H] and w_down [E, H, I], fp32, bf16 or fp16 on the CPU, optional biases b_up [E, I or 2I] /
    b_down [E, H] (gpt-oss's; widened to fp32 exactly) -> [T, H] in x's dtype. `alpha` /
    `limit`: swiglu_oai's. Computes in fp32 (x rounded to fp32, 16-bit weights widened exactly);
    each token's output is the same bits whatever tokens share the call and whatever the
    thread count."""
    why = moe_unavailable()
    if why:
        raise RuntimeError(f"moe_rows: {why}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    e, n_up, h = w_up.shape
    i = w_down.shape[2]
    if (w_up.dtype not in WEIGHT_TYPES or w_down.dtype != w_up.dtype
            or tuple(w_down.shape[:2]) != (e, h)
            or n_up != (i if activation == "relu2" else 2 * i)
            or (b_up is not None and tuple(b_up.shape) != (e, n_up))
            or (b_down is not None and tuple(b_down.shape) != (e, h))):
        raise ValueError(f"moe_rows: fp32 or bf16 expert weights that fit together, got up "
                         f"{w_up.dtype} {tuple(w_up.shape)}, down {w_down.dtype} "
                         f"{tuple(w_down.shape)}, {activation}, biases "
                         f"{None if b_up is None else tuple(b_up.shape)} / "
                         f"{None if b_down is None else tuple(b_down.shape)}")
    if (x.device.type != "cpu" or w_up.device.type != "cpu" or x.dim() != 2
            or x.shape[1] != h or topk_ids.shape != topk_weights.shape
            or topk_ids.shape[0] != x.shape[0]):
        raise ValueError(f"moe_rows: x [T, {h}] and ids / weights [T, k] on the CPU, got x "
                         f"{tuple(x.shape)} on {x.device}, ids {tuple(topk_ids.shape)}, "
                         f"weights {tuple(topk_weights.shape)}")
    up, down = w_up.contiguous(), w_down.contiguous()
    xf = x.to(torch.float32).contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    wts = topk_weights.to(torch.float32).contiguous()
    bu, bd = (None if b is None else b.to(torch.float32).contiguous() for b in (b_up, b_down))
    out = torch.empty(xf.shape, dtype=torch.float32)
    rc = library().moe_rows(xf.data_ptr(), xf.shape[0], h, ids.data_ptr(), wts.data_ptr(),
                            ids.shape[1], e, up.data_ptr(), n_up, down.data_ptr(), i,
                            WEIGHT_TYPES.index(up.dtype), ACTIVATIONS.index(activation),
                            _silu_mul(), out.data_ptr(), torch.get_num_threads(),
                            None if bu is None else bu.data_ptr(),
                            None if bd is None else bd.data_ptr(), alpha, limit)
    if rc == -3:
        raise ValueError(f"moe_rows: expert ids must lie in [0, {e}) with 1..64 per token, got "
                         f"ids of shape {tuple(ids.shape)}")
    if rc:
        raise MemoryError("moe_rows: no scratch memory")
    return out if x.dtype is torch.float32 else out.to(x.dtype)


@lru_cache(maxsize=1)
def _silu_mul() -> int:
    return ctypes.cast(row_kernels._library().silu_mul_rows, _P).value
