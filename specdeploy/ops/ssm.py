"""Mamba2 selective state-space scan (SSD)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdeploy.ops import elementwise as ew
from specdeploy.ops import state_rows
from specdeploy.ops.autograd import register_recompute_autograd
from specdeploy.ops.scan_states import states_at

__all__ = ["ScanOutput", "ssm_dt", "ssm_scan_ref", "ssm_scan_core"]


class ScanOutput(NamedTuple):
    y: torch.Tensor  # [B, T, H, P] fp32
    final_state: torch.Tensor  # [B, H, P, N] fp32
    states: torch.Tensor | None  # [B, T, H, P, N] fp32: state after each token (when asked)
    at: torch.Tensor | None = None  # [W, H, P, N] fp32: states at `state_at` (when asked)


def ssm_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, dt_max: float) -> torch.Tensor:
    """Discretization step: ``clamp(softplus(dt + dt_bias), dt_min, dt_max)`` in fp32."""
    return ew.softplus(dt.float() + dt_bias.float()).clamp(dt_min, dt_max)


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


def _chunk(t: torch.Tensor, size: int) -> torch.Tensor:
    """[B, T, H, ...] -> head-major chunks [B, H, T/size, size, ...], zero padding T."""
    pad = (-t.shape[1]) % size
    if pad:
        t = torch.cat((t, t.new_zeros(t.shape[0], pad, *t.shape[2:])), dim=1)
    return t.movedim(1, 2).unflatten(2, (-1, size))


def _ssm_step(x, delta, A, B, C, D, initial_state, rep, return_states) -> ScanOutput:
    """One token (decode): the recurrence itself, no chunk bookkeeping; one C call where the
    row kernels take the tensors (row_kernels.c ssm_step_rows), decode and verify rows alike."""
    step = state_rows.ssm_step(x[:, 0], delta[:, 0], A, B[:, 0], C[:, 0], D, initial_state)
    if step is not None:
        y, state = step
        return ScanOutput(y[:, None], state, state[:, None] if return_states else None)
    xf, dt = x[:, 0].float(), delta[:, 0].float()  # [B, H, P], [B, H]
    Bh = B[:, 0].float().repeat_interleave(rep, dim=1)  # [B, H, N]
    Ch = C[:, 0].float().repeat_interleave(rep, dim=1)
    decay = ew.exp(dt * A.float())[..., None, None]
    update = (dt[..., None] * xf)[..., None] * Bh[:, :, None, :]  # [B, H, P, N]
    state = update if initial_state is None else decay * initial_state.float() + update
    y = (state @ Ch[..., None])[..., 0] + D.float()[:, None] * xf
    return ScanOutput(y[:, None], state, state[:, None] if return_states else None)


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
    state_at: torch.Tensor | None = None,
) -> ScanOutput:
    """Chunked SSD scan with an already discretized ``delta`` [B, T, H] (see :func:`ssm_dt`).

    Within a chunk the scan is a masked "attention" (C_i·B_j) * exp(cumA_i - cumA_j) * delta_j;
    across chunks only the [B, H, P, N] state is carried, so cached variants pass per-sequence
    ``initial_state`` and, for speculative verification, ``return_states=True``.
    ``state_at`` [W, 2] host int64 (batch row, token) asks for the state after a few tokens
    only (prefix-cache checkpoints; ops/scan_states.py): free at a chunk's or the segment's
    last token, one within-chunk sum otherwise, never T states.
    chunk_size <= 0 means one chunk. Shapes as in :func:`ssm_scan_ref`; all outputs fp32.
    """
    b, t, h, p = x.shape
    n = B.shape[-1]
    rep = h // B.shape[2]
    if t == 1:
        out = _ssm_step(x, delta, A, B, C, D, initial_state, rep, return_states)
        if state_at is None:
            return out
        return out._replace(at=out.final_state[state_at[:, 0].to(x.device)])
    size = max(1, min(chunk_size, t)) if chunk_size > 0 else max(1, t)
    xf, delta = x.float(), delta.float()
    # head-major [B, H, c, l, *] so every contraction below is a plain batched matmul
    xs = _chunk(xf * delta[..., None], size)  # dt-scaled inputs
    Bc = _chunk(B.float().repeat_interleave(rep, dim=2), size)
    Cc = _chunk(C.float().repeat_interleave(rep, dim=2), size)
    cum = _chunk(delta * A.float(), size).cumsum(-1)  # [B, H, c, l] cumulative log decay (<= 0)
    # decay[i, j] = exp(cum_i - cum_j) for j <= i; masking before exp keeps it finite
    lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
    decay = ew.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")))
    y = ((Cc @ Bc.transpose(-1, -2)) * decay) @ xs  # [B, H, c, l, P] intra-chunk part
    # contribution of each chunk's own inputs to the state at its end: [B, H, c, P, N]
    chunk_states = xs.transpose(-1, -2) @ (Bc * ew.exp(cum[..., -1:] - cum)[..., None])
    chunk_decay = ew.exp(cum[..., -1])  # [B, H, c]
    if initial_state is None:
        state = xf.new_zeros(b, h, p, n)
    else:
        state = initial_state.float()
    starts = []
    for c in range(cum.shape[2]):
        starts.append(state)
        state = chunk_decay[:, :, c, None, None] * state + chunk_states[:, :, c]
    start = torch.stack(starts, dim=2)  # [B, H, c, P, N]: state entering each chunk
    y = y + (Cc @ start.transpose(-1, -2)) * ew.exp(cum)[..., None]
    y = y.flatten(2, 3)[:, :, :t].transpose(1, 2) + D.float()[:, None] * xf
    states = at = None
    if return_states:
        within = torch.einsum("bhcij,bhcjp,bhcjn->bhcipn", decay, xs, Bc)
        states = within + ew.exp(cum)[..., None, None] * start[:, :, :, None]
        states = states.flatten(2, 3)[:, :, :t].transpose(1, 2)
    if state_at is not None:  # the rows of `states` above, for the asked tokens only
        at = states_at(state_at, size, t, start, state, cum, xs, Bc)
    return ScanOutput(y.contiguous(), state, states, at)


def _ssm_scan_kernel(
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
    delta = ssm_dt(dt, dt_bias, dt_min, dt_max)
    out = ssm_scan_core(x, delta, A, B, C, D, chunk_size, initial_state)
    return out.y.to(x.dtype), out.final_state


ssm_scan = torch.library.custom_op("specdeploy::ssm_scan", _ssm_scan_kernel, mutates_args=())
register_recompute_autograd(ssm_scan, _ssm_scan_kernel)


@ssm_scan.register_fake
def _ssm_scan_fake(x, dt, A, B, C, D, dt_bias, dt_min, dt_max, chunk_size, initial_state=None):
    b, _, h, p = x.shape
    return torch.empty_like(x), x.new_empty(b, h, p, B.shape[-1], dtype=torch.float32)
