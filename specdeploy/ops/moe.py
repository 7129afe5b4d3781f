"""Mixture-of-experts: routing (plain torch) and the routed-experts op."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from specdeploy.ops import linear_rows, row_kernels
from specdeploy.ops.autograd import register_recompute_autograd
from specdeploy.ops.moe_grouped import expert_activation, moe_experts_grouped

__all__ = ["Routing", "route_softmax_topk", "route_sigmoid", "moe_experts_ref", "moe_experts_fast",
           "moe_experts_loop"]


class Routing(NamedTuple):
    ids: torch.Tensor  # [T, k] int64 expert ids
    weights: torch.Tensor  # [T, k] combine weights


def _softmax_topk_torch(logits: torch.Tensor, k: int, renormalize: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    probs = logits.float().softmax(-1)
    weights, ids = probs.topk(k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights.to(logits.dtype)


def _softmax_topk_kernel(logits: torch.Tensor, k: int, renormalize: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    if not torch.is_grad_enabled():  # CPU fp32: one C call a step (row_kernels.c)
        out = row_kernels.moe_route(logits, None, k, False, renormalize=renormalize)
        if out is not None:
            return out
    return _softmax_topk_torch(logits, k, renormalize)


_softmax_topk_op = torch.library.custom_op("specdeploy::route_softmax_topk",
                                           _softmax_topk_kernel, mutates_args=())
register_recompute_autograd(_softmax_topk_op, _softmax_topk_torch)


@_softmax_topk_op.register_fake
def _softmax_topk_fake(logits, k, renormalize):
    return (logits.new_empty(logits.shape[0], k, dtype=torch.int64),
            logits.new_empty(logits.shape[0], k))


def route_softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> Routing:
    """Qwen-style: softmax over all experts (fp32), top-k, optionally renormalize the k weights.

    logits: [T, E]. Weights come back in the logits' dtype (as transformers does). One op in
    the graph (`specdeploy::route_softmax_topk`): on the CPU in fp32 one C call instead of ~7
    torch ops a MoE layer, ids in descending order as torch's topk gives them.
    """
    return Routing(*_softmax_topk_op(logits, k, renormalize))


def _sigmoid_torch(logits: torch.Tensor, correction_bias: torch.Tensor | None, k: int,
                   n_group: int, topk_group: int, renormalize: bool, scaling_factor: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(t, e)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling_factor


def _sigmoid_kernel(logits: torch.Tensor, correction_bias: torch.Tensor | None, k: int,
                    n_group: int, topk_group: int, renormalize: bool, scaling_factor: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    if not torch.is_grad_enabled():  # CPU fp32: one C call a step (row_kernels.c)
        out = row_kernels.moe_route(logits, correction_bias, k, True, n_group, topk_group,
                                    renormalize, scaling_factor)
        if out is not None:
            return out
    return _sigmoid_torch(logits, correction_bias, k, n_group, topk_group, renormalize,
                          scaling_factor)


_sigmoid_op = torch.library.custom_op("specdeploy::route_sigmoid", _sigmoid_kernel,
                                      mutates_args=())
register_recompute_autograd(_sigmoid_op, _sigmoid_torch)


@_sigmoid_op.register_fake
def _sigmoid_fake(logits, correction_bias, k, n_group, topk_group, renormalize, scaling_factor):
    return (logits.new_empty(logits.shape[0], k, dtype=torch.int64),
            logits.new_empty(logits.shape[0], k, dtype=torch.float32))


def route_sigmoid(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    k: int,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
) -> Routing:
    """DeepSeek-V3 / NemotronH-style sigmoid routing; logits: [T, E] -> fp32 weights.

    The correction bias only steers *selection* (groups ranked by the sum of their top-2 biased
    scores, then top-k among the kept groups); weights are the unbiased sigmoid scores. One op
    in the graph (`specdeploy::route_sigmoid`; on the CPU in fp32 one C call instead of ~11
    torch ops a MoE layer, ids in descending order of the biased score).
    """
    return Routing(*_sigmoid_op(logits, correction_bias, k, n_group, topk_group, renormalize,
                                float(scaling_factor)))


def _expert_mlp(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, activation: str):
    return expert_activation(x @ w_up.t(), activation) @ w_down.t()


def moe_experts_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """Dense per-token loop (the oracle).

    Args:
        x: [T, H]; topk_ids: [T, k] int64; topk_weights: [T, k];
        w_up: [E, I, H] (relu2) or fused gate_up [E, 2I, H] (swiglu: gate rows first);
        w_down: [E, H, I].
    Returns:
        [T, H] in x's dtype: ``sum_j weight_j * expert_{id_j}(x)``.
    """
    xf = x.float()
    out = xf.new_zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            y = _expert_mlp(xf[t : t + 1], w_up[e].float(), w_down[e].float(), activation)
            out[t] += topk_weights[t, j].float() * y[0]
    return out.to(x.dtype)


def moe_experts_fast(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """Tokens grouped per expert: one GEMM pair per expert that received tokens."""
    mats = {"up": w_up, "down": w_down}
    return moe_experts_loop(x, topk_ids, topk_weights, w_up.shape[0],
                            lambda e, which, h: h @ mats[which][e].float().t(), activation)


# linear(expert, "up" | "down", x [n, K]) -> [n, N]
ExpertLinear = Callable[[int, str, torch.Tensor], torch.Tensor]


def moe_experts_loop(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     num_experts: int, linear: ExpertLinear, activation) -> torch.Tensor:
    """x [T, H], topk_ids / topk_weights [T, k] -> [T, H] (x's dtype): the tokens grouped per
    expert, and each expert that received some runs its up and down matrices through
    `linear(e, which, rows)` (fp32 GEMMs here; GGUF blocks in deploy/passes/ggml_experts.py);
    `activation`: a name (`expert_activation`) or a callable on the up projection's rows.
    NOTE: one host sync for the per-expert counts; a CUDA grouped-GEMM kernel would avoid it."""
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    token_of = order // k
    weight_of = topk_weights.reshape(-1)[order].float()
    xs = x.float()[token_of]
    out = x.new_zeros(x.shape, dtype=torch.float32)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        up = linear(e, "up", xs[rows])
        h = activation(up) if callable(activation) else expert_activation(up, activation)
        out.index_add_(0, token_of[rows], linear(e, "down", h) * weight_of[rows, None])
        start += n
    return out.to(x.dtype)


# Up to this many tokens the CPU's fp32 / bf16 experts run in one C call (linear_rows.c
# `moe_rows`: batch-invariant, no Python per expert); above, the per-expert loop of BLAS GEMMs.
# bench/moe_rows.py (bench/results/moe_rows_amx_1206.json; 2 threads, AVX-512): the call is
# 1.6-6x faster at 1-4 tokens, 1.2-2.1x at 64-128, 0.9-1.6x at 256, 0.6-0.7x the loop's speed
# at 1,024 (the BLAS's GEMMs win once each expert gets many rows).
ONE_CALL_MAX_TOKENS = 128


def _moe_experts_kernel(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    if (x.device.type == "cpu" and x.shape[0] <= ONE_CALL_MAX_TOKENS
            and w_up.dtype in linear_rows.WEIGHT_TYPES and linear_rows.moe_unavailable() is None):
        return linear_rows.moe_rows(x, topk_ids, topk_weights, w_up, w_down, activation)
    return _moe_experts_torch(x, topk_ids, topk_weights, w_up, w_down, activation)


def _moe_experts_torch(x, topk_ids, topk_weights, w_up, w_down, activation) -> torch.Tensor:
    """The torch form (what the backward differentiates): the CPU's per-expert loop (its one
    host sync costs nothing there); on a GPU the grouped path, a fixed set of kernels that
    never syncs (invariant 8)."""
    if x.device.type == "cpu":
        return moe_experts_fast(x, topk_ids, topk_weights, w_up, w_down, activation)
    return moe_experts_grouped(x, topk_ids, topk_weights, w_up, w_down, activation)


moe_experts = torch.library.custom_op(
    "specdeploy::moe_experts", _moe_experts_kernel, mutates_args=()
)
register_recompute_autograd(moe_experts, _moe_experts_torch)


@moe_experts.register_fake
def _moe_experts_fake(x, topk_ids, topk_weights, w_up, w_down, activation):
    return torch.empty_like(x)
