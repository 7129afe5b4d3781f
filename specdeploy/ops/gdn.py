"""Gated delta rule (Gated DeltaNet linear attention, fla / transformers convention)."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["DeltaOutput", "l2norm", "gated_delta_rule_ref", "gated_delta_rule_core"]


class DeltaOutput(NamedTuple):
    o: torch.Tensor  # [B, T, H, V] fp32
    final_state: torch.Tensor  # [B, H, K, V] fp32
    states: torch.Tensor | None  # [B, T, H, K, V] fp32: state after each token (when asked)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm: ``x * rsqrt(sum(x^2) + eps)`` over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, use_qk_l2norm, scale):
    """fp32 [B, H, T, *] tensors; q/k heads repeated when Hk divides Hv (grouped values)."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v, g, beta = (t.float().transpose(1, 2) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    # NOTE: scale <= 0 means the default K**-0.5 (what transformers always uses).
    return q * (scale if scale > 0 else q.shape[-1] ** -0.5), k, v, g, beta


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    scale: float = 0.0,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token oracle (chunk_size is ignored).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g (log decay), beta: [B, T, H];
        initial_state: [B, H, K, V].
    Returns:
        (o [B, T, H, V] in q's dtype, final_state [B, H, K, V] fp32).
    Per token: ``S = exp(g) S; S += k ⊗ (beta (v - S^T k)); o = S^T (q * scale)``.
    """
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, use_qk_l2norm, scale)
    b, h, t, dk = kf.shape
    if initial_state is None:
        state = vf.new_zeros(b, h, dk, vf.shape[-1])
    else:
        state = initial_state.float()
    outs = []
    for i in range(t):
        state = state * gf[:, :, i, None, None].exp()
        k_t = kf[:, :, i]
        pred = (state * k_t[..., None]).sum(-2)
        delta = (vf[:, :, i] - pred) * bf[:, :, i, None]
        state = state + k_t[..., None] * delta[..., None, :]
        outs.append((state * qf[:, :, i, :, None]).sum(-2))
    o = torch.stack(outs, dim=1) if outs else vf.transpose(1, 2).clone()
    return o.to(q.dtype), state.clone()


def gated_delta_rule_core(*args, **kwargs) -> DeltaOutput:
    raise NotImplementedError


@torch.library.custom_op("specdeploy::gated_delta_rule", mutates_args=())
def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    scale: float = 0.0,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    return gated_delta_rule_ref(q, k, v, g, beta, initial_state, use_qk_l2norm, scale, chunk_size)


@gated_delta_rule.register_fake
def _gated_delta_rule_fake(
    q, k, v, g, beta, initial_state=None, use_qk_l2norm=False, scale=0.0, chunk_size=64
):
    b, t, h, dv = v.shape
    return v.new_empty(b, t, h, dv, dtype=q.dtype), v.new_empty(
        b, h, k.shape[-1], dv, dtype=torch.float32
    )
