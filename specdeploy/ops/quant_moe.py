"""Routed experts over FP8 / NVFP4 weights (`specdeploy::fp8_moe_experts`, `nvfp4_moe_experts`).

Same contract as `moe.moe_experts` (x [T, H], top-k ids / weights, w_up [E, I or 2I, H], w_down
[E, H, I]) with each weight in its quantized layout (ops/fp8_linear.py, ops/nvfp4_linear.py):
per-expert tensors in a checkpoint are stacked into these fused 3-D ones at load, so both
checkpoint layouts arrive here alike.

Two ways, as `moe.moe_experts` / `moe_grouped`:
- CPU ("loop"): only experts that received tokens are expanded, one at a time, in tiles of
  rows, after one host sync for the per-expert counts (it costs nothing there).
- off the CPU ("gather" / "chunked", `quantized_experts_sync_free`): a fixed sequence of kernels
  whose shapes depend only on T, k, E and the weights' shapes (no host sync; a CUDA graph can
  capture it). "gather" (T * k <= E: decode, verify) dequantizes the experts of each (token,
  expert) pair and multiplies pair by pair (`bmm`), so a row is batch-invariant; "chunked"
  dequantizes the experts in chunks sized to `CHUNK_BYTES` and runs every chunk over an
  [experts, T, H] buffer the pairs are scattered into (pairs of other chunks go to a dump row).
  NOTE: "chunked" multiplies zero rows for experts a token did not choose (E / k times the
  useful work): correct and sync-free, but a grouped FP8 / FP4 GEMM kernel (Triton, CUTLASS)
  is what a large prefill wants. Neither way has run on a GPU yet.

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


IMPLS = ("auto", "loop", "gather", "chunked")
CHUNK_BYTES = 256 << 20  # dequantized fp32 weights + activation buffers of one chunk


def quantized_experts_sync_free(x, topk_ids, topk_weights, sizes: tuple[int, int], up_rows,
                                down_rows, activation: str, up_input_scale=None,
                                down_input_scale=None, impl: str = "auto",
                                chunk: int | None = None) -> torch.Tensor:
    """Routed experts without a host sync. `sizes`: (E, up rows N, down's inputs I);
    `up_rows(idx)` / `down_rows(idx)`: the fp32 weights [len(idx), N, H] / [len(idx), H, I] of
    experts `idx` (a device tensor). fp32 math, combined over the top-k in order; returns x's
    dtype. `chunk`: experts per chunk of "chunked" (None: from CHUNK_BYTES and the shapes)."""
    n_experts, sizes = sizes[0], sizes[1:]
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    pairs = t * k
    if impl == "auto":
        impl = "gather" if pairs <= n_experts else "chunked"
    xq = _maybe_q(x.float(), up_input_scale)
    if impl == "gather":
        h = torch.bmm(up_rows(flat), xq.repeat_interleave(k, 0)[:, :, None])[:, :, 0]
        h = _maybe_q(_act(h, activation), down_input_scale)
        y = torch.bmm(down_rows(flat), h[:, :, None])[:, :, 0]
    elif impl == "chunked":
        y = _chunked(xq, flat, k, n_experts, up_rows, down_rows, activation, down_input_scale,
                     chunk, sizes)
    else:
        raise ValueError(f"impl: one of {', '.join(IMPLS)}, got {impl!r}")
    out = (y.view(t, k, -1) * topk_weights.float()[:, :, None]).sum(1)
    return out.to(x.dtype)


def _chunked(xq, flat, k, n_experts, up_rows, down_rows, activation, down_input_scale, chunk,
             sizes):
    t, hdim = xq.shape[0], xq.shape[1]
    dev = xq.device
    order = flat.argsort(stable=True)
    sorted_ids = flat[order]
    starts = torch.searchsorted(sorted_ids, torch.arange(n_experts, device=dev))
    pos = torch.arange(flat.numel(), device=dev) - starts[sorted_ids]  # < t: ids of a token differ
    pairs_x = xq[order // k]
    y_sorted = None
    if chunk is None:  # fp32 bytes per expert: both weights, its buffer rows, h and y
        n_up, inter = sizes
        per = 4 * (n_up * hdim + hdim * inter + t * (2 * hdim + n_up + inter))
        chunk = max(1, min(n_experts, CHUNK_BYTES // per))
    for c0 in range(0, n_experts, chunk):  # shapes only: the same kernels every call
        c = min(chunk, n_experts - c0)
        local = sorted_ids - c0
        valid = (local >= 0) & (local < c)
        row = torch.where(valid, local, c)  # pairs of other chunks: the dump row c
        buf = xq.new_zeros(c + 1, t, hdim)
        buf[row, pos] = pairs_x
        idx = torch.arange(c0, c0 + c, device=dev)
        h = torch.bmm(buf[:c], up_rows(idx).transpose(1, 2))
        h = _maybe_q(_act(h, activation), down_input_scale)
        yc = torch.bmm(h, down_rows(idx).transpose(1, 2))  # [c, t, H]
        got = torch.where(valid[:, None], yc[row.clamp(max=c - 1), pos], 0.0)
        y_sorted = got if y_sorted is None else y_sorted + got
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    return y


def _fp8_moe_kernel(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    up_q: torch.Tensor, up_s: torch.Tensor, up_block_k: int,
                    down_q: torch.Tensor, down_s: torch.Tensor, down_block_k: int,
                    activation: str, up_input_scale: torch.Tensor | None = None,
                    down_input_scale: torch.Tensor | None = None, impl: str = "auto"
                    ) -> torch.Tensor:
    if _sync_free(x, impl):
        return quantized_experts_sync_free(
            x, topk_ids, topk_weights, (up_q.shape[0], up_q.shape[1], down_q.shape[2]),
            lambda i: dequantize_fp8(_take(up_q, i), up_s[i], up_block_k),
            lambda i: dequantize_fp8(_take(down_q, i), down_s[i], down_block_k),
            activation, up_input_scale, down_input_scale, impl)

    def mlp(e: int, xs: torch.Tensor) -> torch.Tensor:
        h = _act(fp8_matmul(_maybe_q(xs, up_input_scale), up_q[e], up_s[e], up_block_k),
                 activation)
        return fp8_matmul(_maybe_q(h, down_input_scale), down_q[e], down_s[e], down_block_k)

    return _grouped(x, topk_ids, topk_weights, up_q.shape[0], mlp)


def _nvfp4_moe_kernel(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      up_q: torch.Tensor, up_s: torch.Tensor, up_s2: torch.Tensor,
                      down_q: torch.Tensor, down_s: torch.Tensor, down_s2: torch.Tensor,
                      activation: str, impl: str = "auto") -> torch.Tensor:
    if _sync_free(x, impl):
        return quantized_experts_sync_free(
            x, topk_ids, topk_weights, (up_q.shape[0], up_q.shape[1], 2 * down_q.shape[2]),
            lambda i: dequantize_nvfp4(up_q[i], _take(up_s, i), up_s2[i]),
            lambda i: dequantize_nvfp4(down_q[i], _take(down_s, i), down_s2[i]), activation,
            impl=impl)

    def mlp(e: int, xs: torch.Tensor) -> torch.Tensor:
        h = _act(nvfp4_matmul(xs, up_q[e], up_s[e], up_s2[e]), activation)
        return nvfp4_matmul(h, down_q[e], down_s[e], down_s2[e])

    return _grouped(x, topk_ids, topk_weights, up_q.shape[0], mlp)


def _take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t[idx] for float8 tensors too: gathered as bytes (indexing kernels do not cover the
    float8 dtypes on every device)."""
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return t.view(torch.uint8)[idx].view(t.dtype)
    return t[idx]


def _sync_free(x: torch.Tensor, impl: str) -> bool:
    """The CPU keeps its per-expert loop (its one host sync costs nothing there); a GPU takes
    the sync-free ways (invariant 8); `impl` forces one (tests run them on the CPU)."""
    if impl not in IMPLS:
        raise ValueError(f"impl: one of {', '.join(IMPLS)}, got {impl!r}")
    return impl != "loop" and (impl != "auto" or x.device.type != "cpu")


fp8_moe_experts = torch.library.custom_op(
    "specdeploy::fp8_moe_experts", _fp8_moe_kernel, mutates_args=()
)
nvfp4_moe_experts = torch.library.custom_op(
    "specdeploy::nvfp4_moe_experts", _nvfp4_moe_kernel, mutates_args=()
)


@fp8_moe_experts.register_fake
def _fp8_moe_fake(x, topk_ids, topk_weights, up_q, up_s, up_block_k, down_q, down_s,
                  down_block_k, activation, up_input_scale=None, down_input_scale=None,
                  impl="auto"):
    return torch.empty_like(x)


@nvfp4_moe_experts.register_fake
def _nvfp4_moe_fake(x, topk_ids, topk_weights, up_q, up_s, up_s2, down_q, down_s, down_s2,
                    activation, impl="auto"):
    return torch.empty_like(x)
