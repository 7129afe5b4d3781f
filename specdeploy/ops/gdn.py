"""Gated delta rule (Gated DeltaNet linear attention, fla / transformers convention)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdeploy.ops import elementwise as ew
from specdeploy.ops import state_rows
from specdeploy.ops.autograd import register_recompute_autograd
from specdeploy.ops.scan_states import states_at

__all__ = ["DeltaOutput", "l2norm", "gated_delta_rule_ref", "gated_delta_rule_core"]


class DeltaOutput(NamedTuple):
    o: torch.Tensor  # [B, T, H, V] fp32
    final_state: torch.Tensor  # [B, H, K, V] fp32
    states: torch.Tensor | None  # [B, T, H, K, V] fp32: state after each token (when asked)
    at: torch.Tensor | None = None  # [W, H, K, V] fp32: states at `state_at` (when asked)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm: ``x * rsqrt(sum(x^2) + eps)`` over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, use_qk_l2norm, scale):
    """fp32 [B, H, T, *] tensors, q / k / v contiguous; q/k heads repeated when Hk divides Hv
    (grouped values). NOTE: contiguous in [B, H, T, *] once here, the chunked form's batched
    matmuls take their operands (and transposes) as views; left as views of [B, T, H, *], each
    matmul copied its operands (~25% of the core's time at 384 tokens, 32 heads of 128)."""
    rep = v.shape[2] // k.shape[2]
    q, k, v, g, beta = (t.float().transpose(1, 2) for t in (q, k, v, g, beta))
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    # NOTE: scale <= 0 means the default K**-0.5 (what transformers always uses).
    return q * (scale if scale > 0 else q.shape[-1] ** -0.5), k, v, g, beta


def decode_step(q, k, v, g, beta, state, slots, use_qk_l2norm: bool, scale: float):
    """One token [B, 1, ...] of each sequence in one C call (row_kernels.c gdn_step_rows: the
    l2norm, the scale and the q / k heads' sharing in the step), or None where the kernel does
    not take the tensors. The cached op's in-place decode steps (`slots`) and the core's
    one-token form (verify steps' rows) both come here: the same bits."""
    return state_rows.gdn_step(q[:, 0].float(), k[:, 0].float(), v[:, 0].float(),
                                g[:, 0].float(), beta[:, 0].float(), state, slots,
                                use_qk_l2norm, scale if scale > 0 else q.shape[-1] ** -0.5)


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
        q, k: [B, T, H, K] (or [B, T, Hk, K] with H % Hk == 0: each q/k head serves H/Hk
        consecutive value heads, as in transformers); v: [B, T, H, V]; g (log decay), beta:
        [B, T, H]; initial_state: [B, H, K, V]; scale <= 0 means K**-0.5.
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


def _chunk(t: torch.Tensor, size: int) -> torch.Tensor:
    """[B, H, T, ...] -> [B, H, T/size, size, ...], zero padding T up to a multiple of size."""
    pad = (-t.shape[2]) % size
    if pad:
        t = torch.cat((t, t.new_zeros(*t.shape[:2], pad, *t.shape[3:])), dim=2)
    return t.unflatten(2, (-1, size))


def gated_delta_rule_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    use_qk_l2norm: bool,
    scale: float,
    chunk_size: int = 64,
    return_states: bool = False,
    state_at: torch.Tensor | None = None,
) -> DeltaOutput:
    """Chunked gated delta rule (WY / UT form). Shapes as in :func:`gated_delta_rule_ref`.

    Inside a chunk with start state S0 and cumulative log decay c_i, the per-token updates
    u_i = beta_i (v_i - S~_i^T k_i) solve a unit lower-triangular system
    ``(I + A) U = beta V - beta exp(c) K S0`` with ``A_ij = beta_i exp(c_i - c_j) k_i·k_j`` (j < i),
    so ``U = U0 - W S0`` where U0, W do not depend on S0 and are solved for all chunks at once.
    Then ``S_i = exp(c_i) S0 + sum_{j<=i} exp(c_i - c_j) k_j u_j^T`` gives outputs, the chunk's
    final state and (``return_states``) the state after every token. Only S0 is carried across
    chunks, so cached variants pass per-sequence ``initial_state``. ``state_at`` [W, 2] host
    int64 (batch row, token) asks for S_i after a few tokens only (prefix-cache checkpoints;
    ops/scan_states.py). All outputs fp32.
    """
    if q.shape[1] == 1:  # decode: one C call (row_kernels.c gdn_step_rows), decode and verify
        step = decode_step(q, k, v, g, beta, initial_state, None, use_qk_l2norm, scale)
        if step is not None:
            o, state = step
            at = None if state_at is None else state[state_at[:, 0].to(q.device)]
            return DeltaOutput(o[:, None], state, state[:, None] if return_states else None, at)
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, use_qk_l2norm, scale)
    b, h, t, dk = kf.shape
    dv = vf.shape[-1]
    if t == 1:  # decode in torch: the recurrence itself, no chunk solve
        state = vf.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
        state = state * ew.exp(gf[:, :, 0, None, None])
        k0 = kf[:, :, 0]
        delta = (vf[:, :, 0] - (k0[:, :, None, :] @ state)[:, :, 0]) * bf[:, :, 0, None]
        state = state + k0[..., None] * delta[..., None, :]
        o = (qf[:, :, 0, None, :] @ state)[:, :, 0]  # [B, H, V]
        at = None if state_at is None else state[state_at[:, 0].to(q.device)]
        return DeltaOutput(o[:, None], state, state[:, None] if return_states else None, at)
    size = max(1, min(chunk_size, t)) if chunk_size > 0 else max(1, t)
    qc, kc, vc = _chunk(qf, size), _chunk(kf, size), _chunk(vf, size)  # [B, H, c, l, *]
    bc = _chunk(bf, size)[..., None]  # [B, H, c, l, 1]
    cum = _chunk(gf, size).cumsum(-1)  # [B, H, c, l]
    diff = cum[..., :, None] - cum[..., None, :]
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = ew.exp(diff.masked_fill(~lower, float("-inf")))  # [B, H, c, i, j], j <= i
    eye = torch.eye(size, device=q.device)
    system = (bc * (kc @ kc.transpose(-1, -2)) * decay).tril(-1) + eye
    # NOTE: inverting once and multiplying is several times faster on CPU than solving for the
    # (K + V)-column right-hand side directly, at the same accuracy.
    eye = eye.expand_as(system)
    inv = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    u0 = inv @ (bc * vc)  # U = u0 - w @ S0
    w = inv @ (bc * ew.exp(cum)[..., None] * kc)
    qk = (qc @ kc.transpose(-1, -2)) * decay  # intra-chunk attention incl. the diagonal
    q_in = qc * ew.exp(cum)[..., None]  # queries reading the decayed start state
    k_out = kc * ew.exp(cum[..., -1:] - cum)[..., None]  # keys decayed to the chunk's end
    end_decay = ew.exp(cum[..., -1])[..., None, None]  # [B, H, c, 1, 1]
    if initial_state is None:
        state = vf.new_zeros(b, h, dk, dv)
    else:
        state = initial_state.float()
    outs, starts, updates = [], [], []
    for c in range(cum.shape[2]):
        u = u0[:, :, c] - w[:, :, c] @ state
        outs.append(q_in[:, :, c] @ state + qk[:, :, c] @ u)
        starts.append(state)
        updates.append(u)
        state = end_decay[:, :, c] * state + k_out[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :t].transpose(1, 2)
    states = at = None
    if return_states or state_at is not None:
        start = torch.stack(starts, dim=2)  # [B, H, c, K, V]
    if return_states:
        us = torch.stack(updates, dim=2)  # [B, H, c, l, V]
        within = torch.einsum("bhcij,bhcjk,bhcjv->bhcikv", decay, kc, us)
        states = within + ew.exp(cum)[..., None, None] * start[:, :, :, None]
        states = states.flatten(2, 3)[:, :, :t].transpose(1, 2)
    if state_at is not None:  # the rows of `states` above, for the asked tokens only
        at = states_at(state_at, size, t, start, state, cum, kc, torch.stack(updates, dim=2))
    return DeltaOutput(o.contiguous(), state, states, at)


def _gated_delta_rule_kernel(
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
    out = gated_delta_rule_core(q, k, v, g, beta, initial_state, use_qk_l2norm, scale, chunk_size)
    return out.o.to(q.dtype), out.final_state


gated_delta_rule = torch.library.custom_op(
    "specdeploy::gated_delta_rule", _gated_delta_rule_kernel, mutates_args=()
)
register_recompute_autograd(gated_delta_rule, _gated_delta_rule_kernel)


@gated_delta_rule.register_fake
def _gated_delta_rule_fake(
    q, k, v, g, beta, initial_state=None, use_qk_l2norm=False, scale=0.0, chunk_size=64
):
    b, t, h, dv = v.shape
    return v.new_empty(b, t, h, dv, dtype=q.dtype), v.new_empty(
        b, h, k.shape[-1], dv, dtype=torch.float32
    )
