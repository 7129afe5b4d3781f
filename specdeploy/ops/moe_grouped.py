"""Routed experts without a loop over experts and without a host sync (the GPU path of
`specdeploy::moe_experts`; ops/moe.py dispatches to it off the CPU).

Three ways, each a fixed sequence of kernels whose shapes depend only on T, k, E (so a CUDA graph
can capture them), chosen on the host from shapes and dtypes alone:

- "grouped_mm": `torch._grouped_mm` over the (token, expert) pairs sorted by expert, with
  per-expert end offsets computed on the device. Needs 16-byte aligned rows (H and I).
- "gather": each pair multiplies its own expert's gathered weights (`bmm` over [T*k, I, H]):
  cheapest when T*k <= E (decode), as it copies at most the experts' weights once.
- "padded": pairs scattered into an [E, T, H] buffer (an expert takes at most T pairs: top-k
  ids of a token are distinct; repeated ids would index past the buffer, an index error, not a
  wrong result), one `bmm` per projection over every expert.

Every way returns `sum_j w_j * expert_{id_j}(x)` summed over j in order, per token (no atomics,
so the result is deterministic). NOTE: only "gather" is batch-invariant (each pair is its own
matrix-vector product); the GEMM ways' kernels (and so the last bits) may vary with how many rows
an expert gets, as the CPU's per-expert loop's do. Greedy speculation on a MoE GPU target
therefore equals plain greedy only where the verify rows take the same kernels.
On the CPU (tests/ops/test_moe_grouped.py) all three match `moe_experts_ref`; on an H200
(bench/gpu_check.sh, 2026-12-04: bench/results/gpu_h200_1204_final_cuda_tests.log)
tests/cuda/test_cuda_moe.py checked each (grouped_mm in bf16) with sync debug mode "error".
Per-expert counts use `scatter_add_`, not `bincount` (CUDA's bincount syncs to size its output).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

IMPLS = ("auto", "grouped_mm", "gather", "padded")


def moe_experts_grouped(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        w_up: torch.Tensor, w_down: torch.Tensor, activation: str,
                        impl: str = "auto") -> torch.Tensor:
    """Same contract as `moe_experts_ref` (x [T, H], ids / weights [T, k], w_up [E, I or 2I, H],
    w_down [E, H, I] -> [T, H] in x's dtype); computes in the weights' dtype, combines in fp32."""
    if impl not in IMPLS:
        raise ValueError(f"impl: one of {', '.join(IMPLS)}, got {impl!r}")
    t, k = topk_ids.shape
    e = w_up.shape[0]
    if impl == "auto":
        impl = _auto(x.device, w_up, w_down, t * k, e)
    dtype = w_up.dtype
    xc = x.to(dtype)
    flat = topk_ids.reshape(-1)
    if impl == "gather":
        pair_x = xc[:, None].expand(t, k, xc.shape[1]).reshape(t * k, -1)  # p -> token p // k
        h = torch.bmm(w_up[flat], pair_x[:, :, None])[:, :, 0]
        h = expert_activation(h.float(), activation).to(w_down.dtype)
        y = torch.bmm(w_down[flat], h[:, :, None])[:, :, 0]
    else:
        order = flat.argsort(stable=True)
        sorted_ids = flat[order]
        pairs_x = xc[order // k]
        if impl == "grouped_mm":
            counts = torch.zeros(e, dtype=torch.int64, device=x.device)
            counts.scatter_add_(0, flat, torch.ones_like(flat))
            offs = counts.cumsum(0).to(torch.int32)
            h = torch._grouped_mm(pairs_x, w_up.transpose(1, 2), offs=offs)
            h = expert_activation(h.float(), activation).to(w_down.dtype)
            y_sorted = torch._grouped_mm(h, w_down.transpose(1, 2), offs=offs)
        else:
            starts = torch.searchsorted(sorted_ids, torch.arange(e, device=x.device))
            pos = torch.arange(t * k, device=x.device) - starts[sorted_ids]
            buf = xc.new_zeros(e, t, xc.shape[1])
            buf[sorted_ids, pos] = pairs_x
            h = torch.bmm(buf, w_up.transpose(1, 2))
            h = expert_activation(h.float(), activation).to(w_down.dtype)
            y_sorted = torch.bmm(h, w_down.transpose(1, 2))[sorted_ids, pos]
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted
    out = (y.float().view(t, k, -1) * topk_weights.float()[:, :, None]).sum(1)
    return out.to(x.dtype)


def expert_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """[..., 2I] (swiglu: gate first) or [..., I] (relu2) -> [..., I]."""
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    if activation == "relu2":
        return F.relu(h).square()
    raise ValueError(f"unknown expert activation {activation!r}")


def _auto(device: torch.device, w_up: torch.Tensor, w_down: torch.Tensor, pairs: int,
          experts: int) -> str:
    if _grouped_mm_ok(device, w_up, w_down):
        return "grouped_mm"
    return "gather" if pairs <= experts else "padded"


def _grouped_mm_ok(device: torch.device, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """`torch._grouped_mm` where this torch runs it well: bf16 on sm90+ CUDA (its CUTLASS
    kernel; other dtypes and GPUs may take a fallback we have not checked is sync-free), rows
    a multiple of 16 bytes (its stride rule), weights of one dtype."""
    if device.type != "cuda" or w_up.dtype != torch.bfloat16 or w_down.dtype != w_up.dtype:
        return False
    if not hasattr(torch, "_grouped_mm") or _capability(device) < (9, 0):
        return False
    return aligned(w_up, w_down)


def aligned(w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """H, I and the up rows a multiple of 16 bytes (the stride rule of `torch._grouped_mm`)."""
    size = w_up.element_size()
    return all(n * size % 16 == 0 for n in (w_up.shape[1], w_up.shape[2], w_down.shape[2]))


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)
