"""Routed experts with biases and gpt-oss's clamped SwiGLU (`specdeploy::moe_experts_bias`).

A separate op rather than optional biases on `moe_experts`: every pass that rewrites
`moe_experts` (row kernels, GGUF blocks, pre-quantized weights, expert parallelism) would drop
biases it does not know of; no pass matches this op, so nothing can lose them.

Expert e on a row x: `h = w_up[e] @ x + b_up[e]` ([2I]: gate rows first, then up; the loader
de-interleaves gpt-oss's even/odd columns), `gate = min(h_gate, limit)`, `up = clamp(h_up,
±limit)`, `a = (up + 1) * gate * sigmoid(alpha * gate)`, `y = w_down[e] @ a + b_down[e]`;
the output is `sum_j weight_j * y_{id_j}` (transformers' `GptOssExperts`).

On the CPU, fp32 / bf16 experts for up to `ONE_CALL_MAX_TOKENS` rows run in one C call
(linear_rows.c `moe_rows`, biases and this activation included): batch-invariant like the
pairwise loop below, no Python per expert and no host read of the ids, so a CPU graph can
record the step (the loop's `tolist` refused every capture).
"""
from __future__ import annotations

import torch

from specdeploy.ops import linear_rows
from specdeploy.ops.autograd import register_recompute_autograd

__all__ = ["ACTIVATIONS", "clamped_swiglu", "moe_experts_bias_ref"]

ACTIVATIONS = ("swiglu_oai",)
# Up to this many rows each (row, expert) pair is its own matrix-vector product: a verify row
# gets the bits of the same row decoded alone (batch-invariant, lossless greedy speculation);
# longer steps (prefill) group the rows per expert into GEMMs. (Where the C call runs, it
# takes up to ONE_CALL_MAX_TOKENS rows: ops/moe.py's measured bound for the same kernel.)
PAIRWISE_MAX_ROWS = 16
ONE_CALL_MAX_TOKENS = 128


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[..., 2I] (gate | up) -> [..., I]."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _check(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe_experts_bias: activation {activation!r} not in {ACTIVATIONS}")


def moe_experts_bias_ref(x, topk_ids, topk_weights, w_up, b_up, w_down, b_down, activation,
                         alpha, limit):
    """Dense per-token loop (the oracle). x [T, H]; topk_ids / topk_weights [T, k];
    w_up [E, 2I, H]; b_up [E, 2I]; w_down [E, H, I]; b_down [E, H] -> [T, H] in x's dtype."""
    _check(activation)
    xf = x.float()
    out = xf.new_zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w_up[e].float() @ xf[t] + b_up[e].float()
            y = w_down[e].float() @ clamped_swiglu(h, alpha, limit) + b_down[e].float()
            out[t] += topk_weights[t, j].float() * y
    return out.to(x.dtype)


def _pairwise(x, topk_ids, topk_weights, w_up, b_up, w_down, b_down, alpha, limit):
    """Each (row, expert) pair on its own, in a fixed order per row (see PAIRWISE_MAX_ROWS)."""
    xf = x.float()
    out = xf.new_zeros(x.shape)
    ids = topk_ids.tolist()
    for t, row in enumerate(ids):
        for j, e in enumerate(row):
            h = torch.mv(w_up[e].float(), xf[t]) + b_up[e].float()
            y = torch.mv(w_down[e].float(), clamped_swiglu(h, alpha, limit)) + b_down[e].float()
            out[t] += topk_weights[t, j].float() * y
    return out.to(x.dtype)


def _grouped(x, topk_ids, topk_weights, w_up, b_up, w_down, b_down, alpha, limit):
    """The rows grouped per expert: one GEMM pair per expert that received rows."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w_up.shape[0]).tolist()
    token_of = order // k
    weight_of = topk_weights.reshape(-1)[order].float()
    xs = x.float()[token_of]
    out = x.new_zeros(x.shape, dtype=torch.float32)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        h = torch.addmm(b_up[e].float(), xs[rows], w_up[e].float().t())
        y = torch.addmm(b_down[e].float(), clamped_swiglu(h, alpha, limit), w_down[e].float().t())
        out.index_add_(0, token_of[rows], y * weight_of[rows, None])
        start += n
    return out.to(x.dtype)


def _gather(x, topk_ids, topk_weights, w_up, b_up, w_down, b_down, alpha, limit):
    """Off the CPU for few pairs (decode): each pair's expert gathered, one `bmm` per
    projection; no host sync (CUDA graphs)."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    px = x.float()[:, None].expand(t, k, x.shape[1]).reshape(t * k, -1)
    h = torch.bmm(w_up[flat].float(), px[:, :, None])[:, :, 0] + b_up[flat].float()
    a = clamped_swiglu(h, alpha, limit)
    y = torch.bmm(w_down[flat].float(), a[:, :, None])[:, :, 0] + b_down[flat].float()
    y = y.view(t, k, -1) * topk_weights.float()[:, :, None]
    return y.sum(1).to(x.dtype)


def _kernel(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            w_up: torch.Tensor, b_up: torch.Tensor, w_down: torch.Tensor, b_down: torch.Tensor,
            activation: str, alpha: float, limit: float) -> torch.Tensor:
    _check(activation)
    if (x.device.type == "cpu" and x.shape[0] <= ONE_CALL_MAX_TOKENS
            and w_up.dtype in linear_rows.WEIGHT_TYPES and w_down.dtype == w_up.dtype
            and linear_rows.moe_unavailable() is None):
        return linear_rows.moe_rows(x, topk_ids, topk_weights, w_up, w_down, activation,
                                    b_up, b_down, alpha, limit)
    return _torch(x, topk_ids, topk_weights, w_up, b_up, w_down, b_down, activation, alpha,
                  limit)


def _torch(x, topk_ids, topk_weights, w_up, b_up, w_down, b_down, activation, alpha, limit):
    """The torch form (what the backward differentiates)."""
    _check(activation)
    args = (x, topk_ids, topk_weights, w_up, b_up, w_down, b_down, alpha, limit)
    if x.device.type == "cpu":
        return (_pairwise if x.shape[0] <= PAIRWISE_MAX_ROWS else _grouped)(*args)
    # NOTE: a GPU prefill takes the per-expert loop (one host sync for the counts)
    return (_gather if topk_ids.numel() <= w_up.shape[0] else _grouped)(*args)


moe_experts_bias = torch.library.custom_op("specdeploy::moe_experts_bias", _kernel,
                                           mutates_args=())
register_recompute_autograd(moe_experts_bias, _torch)


@moe_experts_bias.register_fake
def _fake(x, topk_ids, topk_weights, w_up, b_up, w_down, b_down, activation, alpha, limit):
    return torch.empty_like(x)
