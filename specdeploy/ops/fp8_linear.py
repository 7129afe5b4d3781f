"""FP8 (float8_e4m3fn) weight linears: ModelOpt per-tensor FP8 and HF fine-grained block FP8.

One op serves both layouts. A weight W [N, K] is held as float8_e4m3fn Q [N, K] (1 byte per
weight) and fp32 scales S [N, G], one per row and group of `block_k` input columns
(G = ceil(K / block_k)): W[n, k] = Q[n, k] * S[n, k // block_k].
- ModelOpt FP8 (per-tensor `weight_scale`): block_k = K, S = weight_scale repeated over rows;
  rows of differing scales (q/k/v or gate/up stacked) keep their own.
- HF block FP8 (`weight_scale_inv` [ceil(N/bn), ceil(K/bk)]): S = scale_inv repeated over the bn
  rows of its row block (the row-expanded form lets blocks of sizes other than bn be stacked:
  gate and up of I = 32 rows each; 1/(4 * block_k) bytes per weight).

Activations: with `input_scale` s (ModelOpt static FP8), x is quantized as the FP8 GEMM does:
x_q = fp8(clamp(x / s, ±448)) * s; without it (HF `activation_scheme: dynamic` on hardware
without FP8 units, or weight-only) x stays as is. Refs dequantize, then compute in fp32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["FP8_MAX", "Fp8Weight", "dequantize_fp8", "fp8_linear_ref", "quantize_fp8_block",
           "quantize_fp8_tensor", "quantize_activation_fp8", "row_scales_from_blocks"]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# output rows dequantized per step of the CPU kernel: bounds the fp32 scratch to
# _ROWS * K * 4 bytes (1 MiB at K = 1024) instead of the whole N * K * 4
_ROWS = 256


class Fp8Weight(NamedTuple):
    weight: torch.Tensor  # [N, K] (or [E, N, K]) float8_e4m3fn
    scale: torch.Tensor  # [N, G] (or [E, N, G]) fp32
    block_k: int  # input columns per scale group


def quantize_fp8_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt per-tensor FP8: (float8 [N, K], fp32 scalar weight_scale = amax / 448)."""
    w = w.detach().float()
    amax = w.abs().max()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.reshape(())


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF fine-grained FP8: (float8 [N, K], fp32 weight_scale_inv [ceil(N/bn), ceil(K/bk)]),
    each block scaled by its own amax / 448 (partial edge blocks included)."""
    w = w.detach().float()
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    padded = F.pad(w, (0, gk * bk - k, 0, gn * bn - n))
    amax = padded.view(gn, bn, gk, bk).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def row_scales_from_blocks(scale_inv: torch.Tensor, n: int, block_n: int) -> torch.Tensor:
    """[ceil(N/bn), G] block scales → [N, G] row scales (each row gets its row block's)."""
    return scale_inv.float().repeat_interleave(block_n, 0)[:n].contiguous()


def _expand(scale: torch.Tensor, k: int, block_k: int) -> torch.Tensor:
    """[..., G] group scales → [..., K] per-column scales."""
    return scale.float().repeat_interleave(block_k, -1)[..., :k]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block_k: int) -> torch.Tensor:
    """float8 [..., N, K] and scales [..., N, G] → fp32 [..., N, K]."""
    return weight.float() * _expand(scale, weight.shape[-1], block_k)


def quantize_activation_fp8(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor FP8 activation quantization (ModelOpt `input_scale`), back in fp32."""
    s = input_scale.float()
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
                   input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Oracle. x [..., K]; weight float8 [N, K]; scale [N, G]; input_scale scalar or None;
    bias [N]. Returns [..., N] in x's dtype."""
    xf = x.float() if input_scale is None else quantize_activation_fp8(x, input_scale)
    b = None if bias is None else bias.float()
    return F.linear(xf, dequantize_fp8(weight, scale, block_k), b).to(x.dtype)


# every float8_e4m3fn byte's fp32 value (exactly what `.float()` gives)
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8).float()


def _tile_fp32(weight: torch.Tensor, scale: torch.Tensor, block_k: int) -> torch.Tensor:
    # NOTE: measured at 1 thread, 1536 x 576: `.float()` on float8 is a scalar loop (18 ms);
    # a gather from the 256-entry table gives the same values in 8 ms
    vals = torch.take(_FP8_VALUES.to(weight.device), weight.view(torch.uint8).long())
    return vals * _expand(scale, weight.shape[-1], block_k)


def fp8_matmul(xf: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int
               ) -> torch.Tensor:
    """fp32 x [M, K] @ dequant(W)^T, dequantizing _ROWS output rows at a time (the full fp32
    weight is never materialized)."""
    n, k = weight.shape
    out = xf.new_empty(xf.shape[0], n)
    for r in range(0, n, _ROWS):
        tile = _tile_fp32(weight[r:r + _ROWS], scale[r:r + _ROWS], block_k)
        torch.matmul(xf, tile.t(), out=out[:, r:r + _ROWS])
    return out


def _scaled_mm_ok(x, weight, scale, block_k, input_scale) -> bool:
    # NOTE: the FP8 tensor-core GEMM takes one scale per tensor (row-wise scales need newer
    # hardware paths); used only for ModelOpt per-tensor weights with static activation scales.
    return (x.is_cuda and hasattr(torch, "_scaled_mm") and input_scale is not None
            and block_k >= weight.shape[1] and weight.shape[0] % 16 == 0
            and weight.shape[1] % 16 == 0 and bool((scale == scale.flatten()[0]).all())
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def _fp8_linear_kernel(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
                       input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None
                       ) -> torch.Tensor:
    k = weight.shape[1]
    x2 = x.reshape(-1, k)
    if _scaled_mm_ok(x, weight, scale, block_k, input_scale):
        s = input_scale.float().reshape(())
        xq = (x2.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        y = torch._scaled_mm(xq, weight.t(), scale_a=s, scale_b=scale.flatten()[0].reshape(()),
                             out_dtype=torch.float32)
    else:
        xf = x2.float() if input_scale is None else quantize_activation_fp8(x2, input_scale)
        y = fp8_matmul(xf, weight, scale, block_k)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


fp8_linear = torch.library.custom_op(
    "specdeploy::fp8_linear", _fp8_linear_kernel, mutates_args=()
)


@fp8_linear.register_fake
def _fp8_linear_fake(x, weight, scale, block_k, input_scale=None, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
