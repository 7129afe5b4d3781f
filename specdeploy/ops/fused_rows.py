"""Fused row ops that the `fuse_row_ops` pass puts in place of small torch op chains:
`add_rms_norm` (residual add + the next RMSNorm) and `silu_mul` (SwiGLU's gate on a fused
gate/up projection). Refs are the chains they replace; the CPU fp32 kernels are row_kernels.c."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdeploy.ops import gpu_kernels, row_kernels
from specdeploy.ops.norm import rms_norm_ref

__all__ = ["add_rms_norm_ref", "silu_mul_ref"]


def add_rms_norm_ref(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [..., N]; weight [N] -> (a + b, rms_norm(a + b))."""
    s = a + b
    return s, rms_norm_ref(s, weight, eps)


def silu_mul_ref(x: torch.Tensor, n: int) -> torch.Tensor:
    """x: [..., 2N] (gate, up) -> silu(gate) * up [..., N]."""
    return F.silu(x[..., :n]) * x[..., n:2 * n]


def _add_rms_norm_kernel(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    out = gpu_kernels.add_rms_norm(a, b, weight, eps) if gpu_kernels.candidate(a) else None
    if out is None:
        out = row_kernels.add_rms_norm(a, b, weight, eps)
    if out is not None:
        return out
    s = a + b
    return s, torch.ops.specdeploy.rms_norm(s, weight, eps)


def _silu_mul_kernel(x: torch.Tensor, n: int) -> torch.Tensor:
    out = gpu_kernels.silu_mul(x, n) if gpu_kernels.candidate(x) else None
    if out is None:
        out = row_kernels.silu_mul(x, n)
    return silu_mul_ref(x, n) if out is None else out


add_rms_norm = torch.library.custom_op("specdeploy::add_rms_norm", _add_rms_norm_kernel,
                                       mutates_args=())
silu_mul = torch.library.custom_op("specdeploy::silu_mul", _silu_mul_kernel, mutates_args=())


@add_rms_norm.register_fake
def _add_rms_norm_fake(a, b, weight, eps):
    return torch.empty_like(a), torch.empty_like(a)


@silu_mul.register_fake
def _silu_mul_fake(x, n):
    return x.new_empty(*x.shape[:-1], n)
