"""Depthwise causal conv1d (Mamba2 / GDN input mixing) with carried state."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from specdeploy.ops import elementwise as ew
from specdeploy.ops import state_rows
from specdeploy.ops.autograd import register_recompute_autograd

__all__ = ["ConvOutput", "causal_conv1d_ref", "causal_conv1d_core"]


class ConvOutput(NamedTuple):
    y: torch.Tensor  # [B, T, C] in x's dtype
    final_state: torch.Tensor  # [B, C, W-1]: the last W-1 inputs
    states: torch.Tensor | None  # [B, T, C, W-1]: state after each token (when asked)
    at: torch.Tensor | None = None  # [W', C, W-1]: states at `state_at` (when asked)


def _activate(y: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return ew.silu(y)
    if activation == "none":
        return y
    raise ValueError(f"unknown conv activation {activation!r}")


def _initial(x: torch.Tensor, width: int, initial_state: torch.Tensor | None) -> torch.Tensor:
    if initial_state is not None:
        return initial_state.to(x.dtype)
    return x.new_zeros(x.shape[0], x.shape[2], width - 1)


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token oracle. x: [B, T, C]; weight: [C, W]; bias: [C]; initial_state: [B, C, W-1].

    Returns (y [B, T, C], final_state [B, C, W-1]).
    """
    width = weight.shape[1]
    state = _initial(x.float(), width, initial_state).float()
    w = weight.float()
    ys = []
    for t in range(x.shape[1]):
        window = torch.cat((state, x[:, t, :, None].float()), dim=-1)  # [B, C, W]
        y = (window * w).sum(-1)
        if bias is not None:
            y = y + bias.float()
        ys.append(_activate(y, activation))
        state = window[..., 1:]
    y = torch.stack(ys, dim=1) if ys else x.float().new_zeros(x.shape)
    return y.to(x.dtype), state.to(x.dtype).clone()


def causal_conv1d_core(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    activation: str,
    return_states: bool = False,
    state_at: torch.Tensor | None = None,
) -> ConvOutput:
    """Vectorized conv (one F.conv1d over the state-prefixed sequence).

    Cached variants pass per-sequence ``initial_state`` (gathered from state slots) and, for
    speculative verification, ``return_states=True`` to get the state after every token;
    ``state_at`` [W', 2] (batch row, token): the states after those tokens only (prefix cache).
    """
    width = weight.shape[1]
    b, t, c = x.shape
    if t == 1 and state_at is None:  # decode: one C call (row_kernels.c conv_step_rows)
        step = state_rows.conv_step(x, weight, bias, initial_state, activation)
        if step is not None:
            y, final_state = step
            return ConvOutput(y, final_state, final_state[:, None] if return_states else None,
                              None)
    xs = torch.cat((_initial(x, width, initial_state).float(), x.float().transpose(1, 2)), dim=-1)
    at = None
    if state_at is not None:  # the state after token i is the window xs[i+1 : i+W]
        windows = xs.unfold(-1, width - 1, 1)  # [B, C, T+1, W-1]
        rows, tok = state_at[:, 0].to(x.device), state_at[:, 1].to(x.device)
        at = windows[rows, :, tok + 1].to(x.dtype)
    if t == 1:  # decode: one window dot product; F.conv1d's setup costs more than the math
        y = (xs * weight.float()).sum(-1)
        if bias is not None:
            y = y + bias.float()
        y = _activate(y, activation)[:, None].to(x.dtype)
        final_state = xs[..., 1:].to(x.dtype).contiguous()
        states = final_state[:, None] if return_states else None
        return ConvOutput(y, final_state, states, at)
    y = F.conv1d(xs, weight.float()[:, None, :], None if bias is None else bias.float(), groups=c)
    y = _activate(y, activation).transpose(1, 2).to(x.dtype)
    final_state = xs[..., t:].to(x.dtype).contiguous()
    states = None
    if return_states:
        # window t+1 of length W-1 is the state after token t
        states = xs.unfold(-1, width - 1, 1)[:, :, 1:].transpose(1, 2).to(x.dtype).contiguous()
    return ConvOutput(y.contiguous(), final_state, states, at)


def _causal_conv1d_kernel(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    out = causal_conv1d_core(x, weight, bias, initial_state, activation)
    return out.y, out.final_state


causal_conv1d = torch.library.custom_op(
    "specdeploy::causal_conv1d", _causal_conv1d_kernel, mutates_args=()
)
register_recompute_autograd(causal_conv1d, _causal_conv1d_kernel)


@causal_conv1d.register_fake
def _causal_conv1d_fake(x, weight, bias=None, initial_state=None, activation="silu"):
    return torch.empty_like(x), x.new_empty(x.shape[0], x.shape[2], weight.shape[1] - 1)
