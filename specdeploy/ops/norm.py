"""RMSNorm and gated (grouped) RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdeploy.ops import elementwise as ew
from specdeploy.ops import gpu_kernels, row_kernels
from specdeploy.ops.autograd import register_recompute_autograd

__all__ = ["rms_norm_ref", "gated_rms_norm_ref"]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim. x: [..., N], weight: [N] -> [..., N]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def gated_rms_norm_ref(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
) -> torch.Tensor:
    """Per-group RMSNorm with a SiLU gate. x, gate: [..., N]; weight: [N]; N % group_size == 0.

    norm_before_gate=False (Mamba2 / NemotronH): ``rmsnorm_per_group(x * silu(gate)) * weight``.
    norm_before_gate=True (Qwen3.5 GDN): ``rmsnorm_per_group(x) * weight * silu(gate)``.
    """
    return _gated(x, gate, weight, eps, group_size, norm_before_gate, F.silu)


def _gated(x, gate, weight, eps, group_size, norm_before_gate, silu):
    xf = x.float()
    gf = silu(gate.float())
    if not norm_before_gate:
        xf = xf * gf
    grouped = xf.unflatten(-1, (-1, group_size))
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    out = grouped.flatten(-2) * weight.float()
    if norm_before_gate:
        out = out * gf
    return out.to(x.dtype)


def _rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if gpu_kernels.candidate(x) and not torch.is_grad_enabled():
        out = gpu_kernels.rms_norm(x, weight, eps)  # one Triton launch (ops/gpu_kernels.py)
        if out is not None:
            return out
    out = row_kernels.rms_norm(x, weight, eps)  # CPU fp32: one C call (row_kernels.c)
    if out is not None:
        return out
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # NOTE: the ref without its casts; measured faster in-graph than F.rms_norm on this CPU
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    return rms_norm_ref(x, weight, eps)


rms_norm = torch.library.custom_op("specdeploy::rms_norm", _rms_norm_kernel, mutates_args=())
register_recompute_autograd(rms_norm, _rms_norm_kernel)


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


def _gated_rms_norm_kernel(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
) -> torch.Tensor:
    out = row_kernels.gated_rms_norm(x, gate, weight, eps, group_size, norm_before_gate)
    if out is not None:  # CPU fp32: one C call (row_kernels.c), each row on its own
        return out
    # NOTE: the gate's SiLU by ops/elementwise.py (the same bits wherever a row sits)
    return _gated(x, gate, weight, eps, group_size, norm_before_gate, ew.silu)


gated_rms_norm = torch.library.custom_op(
    "specdeploy::gated_rms_norm", _gated_rms_norm_kernel, mutates_args=()
)
register_recompute_autograd(gated_rms_norm, _gated_rms_norm_kernel)


@gated_rms_norm.register_fake
def _gated_rms_norm_fake(x, gate, weight, eps, group_size, norm_before_gate):
    return torch.empty_like(x)
