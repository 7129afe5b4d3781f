"""Mamba2 selective state-space scan (SSD)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["ScanOutput", "ssm_dt", "ssm_scan_ref", "ssm_scan_core"]


class ScanOutput(NamedTuple):
    y: torch.Tensor  # [B, T, H, P] fp32
    final_state: torch.Tensor  # [B, H, P, N] fp32
    states: torch.Tensor | None  # [B, T, H, P, N] fp32: state after each token (when asked)


def ssm_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, dt_max: float) -> torch.Tensor:
    """Discretization step: ``clamp(softplus(dt + dt_bias), dt_min, dt_max)`` in fp32."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(dt_min, dt_max)


def ssm_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_min: float,
    dt_max: float,
    chunk_size: int = 0,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token oracle (chunk_size is ignored).

    Args:
        x: [B, T, H, P]; dt: [B, T, H] raw; A: [H] (= -exp(A_log)); B, C: [B, T, G, N];
        D, dt_bias: [H]; initial_state: [B, H, P, N].
    Returns:
        (y [B, T, H, P] in x's dtype, final_state [B, H, P, N] fp32).
    """
    b, t, h, p = x.shape
    rep = h // B.shape[2]
    delta = ssm_dt(dt, dt_bias, dt_min, dt_max)  # [B, T, H]
    Bh = B.float().repeat_interleave(rep, dim=2)
    Ch = C.float().repeat_interleave(rep, dim=2)
    xf = x.float()
    if initial_state is None:
        state = x.new_zeros(b, h, p, B.shape[-1], dtype=torch.float32)
    else:
        state = initial_state.float()
    ys = []
    for i in range(t):
        decay = torch.exp(delta[:, i] * A.float())[:, :, None, None]
        update = (delta[:, i, :, None] * xf[:, i])[..., None] * Bh[:, i, :, None, :]
        state = decay * state + update
        ys.append((state * Ch[:, i, :, None, :]).sum(-1) + D.float()[:, None] * xf[:, i])
    y = torch.stack(ys, dim=1) if ys else xf.clone()
    return y.to(x.dtype), state.clone()


def ssm_scan_core(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None,
    return_states: bool = False,
) -> ScanOutput:
    """Scan with an already discretized ``delta`` [B, T, H] (see :func:`ssm_dt`); fp32 outputs."""
    raise NotImplementedError


@torch.library.custom_op("specdeploy::ssm_scan", mutates_args=())
def ssm_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_min: float,
    dt_max: float,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return ssm_scan_ref(x, dt, A, B, C, D, dt_bias, dt_min, dt_max, chunk_size, initial_state)


@ssm_scan.register_fake
def _ssm_scan_fake(x, dt, A, B, C, D, dt_bias, dt_min, dt_max, chunk_size, initial_state=None):
    b, _, h, p = x.shape
    return torch.empty_like(x), x.new_empty(b, h, p, B.shape[-1], dtype=torch.float32)
