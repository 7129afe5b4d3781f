"""Routed experts over GGUF Q4_0 / Q4_1 / Q8_0 blocks: `moe_experts` (ops/moe.py) with each
expert's two matrices read from its stacked blocks ([E, N, K / 32 * size], ops/ggml_linear.py)
instead of fp32 copies.

A MoE checkpoint is mostly its experts: as fp32 they are 8x their Q4_0 bytes, and a CPU decode
step reads the chosen experts' weights once each. As `moe_experts_fast`, tokens are grouped per
expert after one host sync for the counts (free on the CPU), and each expert that received
tokens runs its up (gate_up) and down matrices through `linear(e, which, x)`: the exact fp32
kernel, or the integer-dot one, over that expert's blocks (deploy/passes/ggml_experts.py
chooses). The oracle is `moe_experts_ref` over the dequantized weights.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from specdeploy.ops.moe_grouped import expert_activation

# linear(expert, "up" | "down", x [n, K]) -> [n, N]
ExpertLinear = Callable[[int, str, torch.Tensor], torch.Tensor]


def ggml_moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     num_experts: int, linear: ExpertLinear, activation: str) -> torch.Tensor:
    """x [T, H] fp32, topk_ids [T, k], topk_weights [T, k] -> [T, H]:
    sum_j weight_j * down_e(act(up_e(x))) for e = id_j."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    token_of = order // k
    weight_of = topk_weights.reshape(-1)[order].float()
    xs = x.float()[token_of]
    out = torch.zeros(x.shape, dtype=torch.float32)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        h = expert_activation(linear(e, "up", xs[rows]), activation)
        out.index_add_(0, token_of[rows], linear(e, "down", h) * weight_of[rows, None])
        start += n
    return out.to(x.dtype)
