"""RMSNorm feeding one linear (and the SiLU-gated product after it) as one op, for a GPU's
decode and verify steps: `norm_linear` (a layer's first norm, then its q/k/v or in-projection)
and `add_norm_linear` (residual add + norm, then the fused gate/up projection [+ silu_mul] or
the next layer's q/k/v). The `fuse_norm_linears` pass puts them in place of those chains on a
CUDA device.

Why: a batch-1 decode step of a small model on a GPU is launch-bound (the default model's
replayed step: 311 launches, 0.93 ms on an H200, bench/results/gpu_h200_1204_final.json), and
each norm and each SiLU-gated product is a launch of its own between two matmuls. With the
kernel on (`gpu_kernels.set_gemv`, SPECDEPLOY_TRITON_GEMV=1) a layer of a Llama-type model takes
7 launches instead of 10. It is off by default until a GPU run measures it against cuBLAS
(bench/gpu_bench.py's `_gemv` rows); off, or where the kernel does not apply (more rows than
`GEMV_ROWS`, another device, quantized weights never reach here), each op runs the chain it
replaced, the same calls in the same order: the same bits as the unfused graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdeploy.ops import gpu_kernels
from specdeploy.ops.fused_rows import (
    _add_rms_norm_kernel,
    _silu_mul_kernel,
    add_rms_norm_ref,
    silu_mul_ref,
)
from specdeploy.ops.norm import _rms_norm_kernel, rms_norm_ref

__all__ = ["norm_linear_ref", "add_norm_linear_ref"]


def norm_linear_ref(x: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor,
                    bias: torch.Tensor | None, glu: int) -> torch.Tensor:
    """linear(rms_norm(x), w, bias), then silu_mul(., glu) when glu > 0. x [..., K]; w [N, K]."""
    y = F.linear(rms_norm_ref(x, norm_w, eps), w, bias)
    return silu_mul_ref(y, glu) if glu else y


def add_norm_linear_ref(a: torch.Tensor, b: torch.Tensor, norm_w: torch.Tensor, eps: float,
                        w: torch.Tensor, bias: torch.Tensor | None, glu: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(a + b, norm_linear_ref(a + b, ...))."""
    total, normed = add_rms_norm_ref(a, b, norm_w, eps)
    y = F.linear(normed, w, bias)
    return total, (silu_mul_ref(y, glu) if glu else y)


def _tail(normed: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, glu: int):
    y = F.linear(normed, w, bias)
    return _silu_mul_kernel(y, glu) if glu else y


def _norm_linear_kernel(x: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor,
                        bias: torch.Tensor | None, glu: int) -> torch.Tensor:
    if gpu_kernels.candidate(x) and not torch.is_grad_enabled():
        out = gpu_kernels.norm_linear(x, None, norm_w, eps, w, bias, glu)
        if out is not None:
            return out[1]
    return _tail(_rms_norm_kernel(x, norm_w, eps), w, bias, glu)


def _add_norm_linear_kernel(a: torch.Tensor, b: torch.Tensor, norm_w: torch.Tensor, eps: float,
                            w: torch.Tensor, bias: torch.Tensor | None, glu: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    if gpu_kernels.candidate(a) and not torch.is_grad_enabled():
        out = gpu_kernels.norm_linear(a, b, norm_w, eps, w, bias, glu)
        if out is not None:
            return out
    total, normed = _add_rms_norm_kernel(a, b, norm_w, eps)
    return total, _tail(normed, w, bias, glu)


norm_linear = torch.library.custom_op("specdeploy::norm_linear", _norm_linear_kernel,
                                      mutates_args=())
add_norm_linear = torch.library.custom_op("specdeploy::add_norm_linear",
                                          _add_norm_linear_kernel, mutates_args=())


def _out_like(x: torch.Tensor, w: torch.Tensor, glu: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], glu if glu else w.shape[0])


@norm_linear.register_fake
def _norm_linear_fake(x, norm_w, eps, w, bias, glu):
    return _out_like(x, w, glu)


@add_norm_linear.register_fake
def _add_norm_linear_fake(a, b, norm_w, eps, w, bias, glu):
    return torch.empty_like(a), _out_like(a, w, glu)
