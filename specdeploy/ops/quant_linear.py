"""Weight-only int8 linear, per-output-channel symmetric scales (`specdeploy::int8_linear`).

A weight W [N, K] is stored as int8 Q and fp32 scales s [N] with W ≈ Q * s[:, None], where
s = max|W[n, :]| / 127 (so no row clips). Activations stay in their dtype; only weights shrink
(4× against fp32, 2× against bf16). Decode on a CPU is bound by reading weights, so with bf16
activations the int8 kernel is also the fast one (see `_int8_linear_kernel`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["QuantizedWeight", "quantize_int8", "dequantize_int8", "int8_linear_ref"]


class QuantizedWeight(NamedTuple):
    weight: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] fp32


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8 of `weight` [N, K]; all-zero rows get scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q.contiguous(), scale.contiguous())


def dequantize_int8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] and scales [N] → fp32 [N, K]."""
    return weight.float() * scale.float()[:, None]


def int8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Oracle: dequantize, then an fp32 linear. x [..., K]; weight int8 [N, K]; scale [N];
    bias [N]. Returns [..., N] in x's dtype."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), dequantize_int8(weight, scale), b).to(x.dtype)


def _int8_linear_kernel(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    # NOTE: measured on the 2-core AVX2 CPU we target: `_weight_int8pack_mm` reads the int8
    # weights directly and is 4-6x faster than a bf16 linear for bf16 activations, but its fp32 /
    # fp16 paths are scalar fallbacks (10-40x slower than an fp32 linear). Those dtypes (and other
    # devices) convert the int8 weight and apply the scales to the output instead: the ref's
    # math, one pass over the weight fewer.
    if x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.shape[-1] > 0:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch._weight_int8pack_mm(x2, weight, scale.to(x.dtype))
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])
    y = F.linear(x.float(), weight.float()) * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


int8_linear = torch.library.custom_op(
    "specdeploy::int8_linear", _int8_linear_kernel, mutates_args=()
)


@int8_linear.register_fake
def _int8_linear_fake(x, weight, scale, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
