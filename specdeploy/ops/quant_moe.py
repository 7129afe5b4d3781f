"""Routed experts over FP8 / NVFP4 weights (`specdeploy::fp8_moe_experts`, `nvfp4_moe_experts`).

Same contract as `moe.moe_experts` (x [T, H], top-k ids / weights, w_up [E, I or 2I, H], w_down
[E, H, I]) with each weight in its quantized layout (ops/fp8_linear.py, ops/nvfp4_linear.py):
per-expert tensors in a checkpoint are stacked into these fused 3-D ones at load, so both
checkpoint layouts arrive here alike. Only experts that received tokens are expanded, one at a
time, in tiles of rows.

FP8 activations: one static scale per projection for all experts, the largest of the experts'
`input_scale`s, as the vLLM and TensorRT-LLM fused-MoE kernels use (a grouped FP8 GEMM takes
one activation scale).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdeploy.ops.fp8_linear import dequantize_fp8, fp8_matmul, quantize_activation_fp8
from specdeploy.ops.nvfp4_linear import dequantize_nvfp4, nvfp4_matmul

__all__ = ["fp8_moe_experts_ref", "nvfp4_moe_experts_ref"]


def _act(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    if activation == "relu2":
        return F.relu(h).square()
    raise ValueError(f"unknown expert activation {activation!r}")


def _maybe_q(x: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    return x if s is None else quantize_activation_fp8(x, s)


def _ref_loop(x, topk_ids, topk_weights, up, down, activation, sin_up=None, sin_down=None):
    xf = x.float()
    out = xf.new_zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = _act(_maybe_q(xf[t:t + 1], sin_up) @ up[e].t(), activation)
            out[t] += topk_weights[t, j].float() * (_maybe_q(h, sin_down) @ down[e].t())[0]
    return out.to(x.dtype)


def fp8_moe_experts_ref(x, topk_ids, topk_weights, up_q, up_s, up_block_k, down_q, down_s,
                        down_block_k, activation, up_input_scale=None, down_input_scale=None):
    """Oracle: dequantize every expert, then the per-token loop of `moe_experts_ref` (fp32)."""
    up = dequantize_fp8(up_q, up_s, up_block_k)
    down = dequantize_fp8(down_q, down_s, down_block_k)
    return _ref_loop(x, topk_ids, topk_weights, up, down, activation, up_input_scale,
                     down_input_scale)


def nvfp4_moe_experts_ref(x, topk_ids, topk_weights, up_q, up_s, up_s2, down_q, down_s,
                          down_s2, activation):
    """Oracle: dequantize every expert, then the per-token loop (fp32)."""
    up = dequantize_nvfp4(up_q, up_s, up_s2)
    down = dequantize_nvfp4(down_q, down_s, down_s2)
    return _ref_loop(x, topk_ids, topk_weights, up, down, activation)


def _grouped(x, topk_ids, topk_weights, n_experts, expert_mlp) -> torch.Tensor:
    """Tokens grouped per expert (as moe.moe_experts_fast): one MLP call per used expert."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()  # NOTE: one host sync
    token_of = order // k
    weight_of = topk_weights.reshape(-1)[order].float()
    xs = x.float()[token_of]
    out = x.new_zeros(x.shape, dtype=torch.float32)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            out.index_add_(0, token_of[rows], expert_mlp(e, xs[rows]) * weight_of[rows, None])
            start += n
    return out.to(x.dtype)


def _fp8_moe_kernel(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    up_q: torch.Tensor, up_s: torch.Tensor, up_block_k: int,
                    down_q: torch.Tensor, down_s: torch.Tensor, down_block_k: int,
                    activation: str, up_input_scale: torch.Tensor | None = None,
                    down_input_scale: torch.Tensor | None = None) -> torch.Tensor:
    def mlp(e: int, xs: torch.Tensor) -> torch.Tensor:
        h = _act(fp8_matmul(_maybe_q(xs, up_input_scale), up_q[e], up_s[e], up_block_k),
                 activation)
        return fp8_matmul(_maybe_q(h, down_input_scale), down_q[e], down_s[e], down_block_k)

    return _grouped(x, topk_ids, topk_weights, up_q.shape[0], mlp)


def _nvfp4_moe_kernel(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      up_q: torch.Tensor, up_s: torch.Tensor, up_s2: torch.Tensor,
                      down_q: torch.Tensor, down_s: torch.Tensor, down_s2: torch.Tensor,
                      activation: str) -> torch.Tensor:
    def mlp(e: int, xs: torch.Tensor) -> torch.Tensor:
        h = _act(nvfp4_matmul(xs, up_q[e], up_s[e], up_s2[e]), activation)
        return nvfp4_matmul(h, down_q[e], down_s[e], down_s2[e])

    return _grouped(x, topk_ids, topk_weights, up_q.shape[0], mlp)


fp8_moe_experts = torch.library.custom_op(
    "specdeploy::fp8_moe_experts", _fp8_moe_kernel, mutates_args=()
)
nvfp4_moe_experts = torch.library.custom_op(
    "specdeploy::nvfp4_moe_experts", _nvfp4_moe_kernel, mutates_args=()
)


@fp8_moe_experts.register_fake
def _fp8_moe_fake(x, topk_ids, topk_weights, up_q, up_s, up_block_k, down_q, down_s,
                  down_block_k, activation, up_input_scale=None, down_input_scale=None):
    return torch.empty_like(x)


@nvfp4_moe_experts.register_fake
def _nvfp4_moe_fake(x, topk_ids, topk_weights, up_q, up_s, up_s2, down_q, down_s, down_s2,
                    activation):
    return torch.empty_like(x)
