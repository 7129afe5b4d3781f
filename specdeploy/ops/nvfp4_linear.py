"""NVFP4 weight linears (ModelOpt `quant_algo: NVFP4`), weight-only dequantized on this hardware.

Layout (as ModelOpt exports it and the vLLM / TensorRT-LLM loaders read it): a weight W [N, K] is
uint8 P [N, K/2], two E2M1 codes per byte, the low nibble holding the even element; code bit 3 is
the sign, bits 0-2 index the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}. `weight_scale` is
float8_e4m3fn [N, K/16] (one per 16 inputs), `weight_scale_2` an fp32 scalar:
W[n, k] = E2M1[code] * weight_scale[n, k // 16] * weight_scale_2 (0.5625 bytes per weight).
Rows stacked from tensors of different `weight_scale_2` keep theirs: scale_2 is held per row.

NOTE: no FP4 units on a CPU (or on CUDA before Blackwell): activations are not quantized (the
checkpoint's `input_scale` is only used by FP4 GEMMs), weights are expanded in tiles of rows.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["E2M1_VALUES", "GROUP", "Nvfp4Weight", "dequantize_nvfp4", "nvfp4_linear_ref",
           "pack_e2m1", "quantize_nvfp4", "unpack_e2m1"]

GROUP = 16
E2M1_MAX = 6.0
FP8_MAX = 448.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# byte → its two values (low nibble first): one gather expands a byte
_BYTE_VALUES = torch.stack([E2M1_VALUES[torch.arange(256) & 15],
                            E2M1_VALUES[torch.arange(256) >> 4]], dim=1)
_ROWS = 256  # output rows expanded per step of the CPU kernel


class Nvfp4Weight(NamedTuple):
    weight: torch.Tensor  # [N, K/2] (or [E, N, K/2]) uint8
    scale: torch.Tensor  # [N, K/16] (or [E, N, K/16]) float8_e4m3fn
    scale_2: torch.Tensor  # [N] (or [E, N]) fp32


@functools.cache
def _byte_values(device: torch.device) -> torch.Tensor:
    # NOTE: one copy per device: a copy from host memory on every call would be a host sync
    # on a GPU (and not capturable in a CUDA graph)
    return _BYTE_VALUES.to(device)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] → fp32 [..., K] E2M1 values (low nibble = even element)."""
    vals = _byte_values(packed.device)[packed.long()]
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _nearest_code(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already scaled into [-6, 6]) → nearest E2M1 codes (ties to the even code,
    as round-to-nearest-even on the 3-bit mantissa grid does)."""
    mags = E2M1_VALUES[:8].to(x.device)
    a = x.abs().clamp(max=E2M1_MAX)
    # midpoints between neighbours; at a tie the lower index wins only if it is even
    mid = (mags[1:] + mags[:-1]) / 2
    idx = torch.bucketize(a, mid, right=False)
    tie = (idx < 7) & (a == mid[idx.clamp(max=6)])  # a equals a midpoint below idx + 1
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)
    return (idx | ((x < 0).to(idx.dtype) << 3)).to(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) → packed [..., K/2] (even element in the low nibble)."""
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt NVFP4 of [N, K] (K % 16 == 0): (packed uint8 [N, K/2], float8 weight_scale
    [N, K/16], fp32 scalar weight_scale_2 = amax / (6 * 448))."""
    w = w.detach().float()
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"nvfp4: input size {k} is not a multiple of {GROUP}")
    amax = w.abs().max()
    scale_2 = torch.where(amax > 0, amax / (E2M1_MAX * FP8_MAX), torch.ones_like(amax))
    groups = w.view(n, k // GROUP, GROUP)
    block = (groups.abs().amax(-1) / E2M1_MAX / scale_2).clamp(max=FP8_MAX)
    block8 = block.to(torch.float8_e4m3fn)
    denom = block8.float() * scale_2
    scaled = torch.where(denom[..., None] > 0, groups / denom[..., None], torch.zeros_like(groups))
    codes = _nearest_code(scaled.reshape(n, k))
    return pack_e2m1(codes), block8, scale_2.reshape(())


def dequantize_nvfp4(weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor
                     ) -> torch.Tensor:
    """uint8 [..., N, K/2], float8 [..., N, K/16], fp32 [..., N] (or scalar) → fp32 [..., N, K]."""
    vals = unpack_e2m1(weight)
    s = scale.float().repeat_interleave(GROUP, -1)
    s2 = scale_2.float()
    s2 = s2[..., None] if s2.dim() else s2
    return vals * s * s2


def nvfp4_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     scale_2: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Oracle. x [..., K]; weight uint8 [N, K/2]; scale float8 [N, K/16]; scale_2 [N]; bias [N].
    Returns [..., N] in x's dtype."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), dequantize_nvfp4(weight, scale, scale_2), b).to(x.dtype)


def nvfp4_matmul(xf: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 scale_2: torch.Tensor) -> torch.Tensor:
    """fp32 x [M, K] @ dequant(W)^T, expanding _ROWS output rows at a time."""
    n = weight.shape[0]
    out = xf.new_empty(xf.shape[0], n)
    for r in range(0, n, _ROWS):
        rows = slice(r, r + _ROWS)
        tile = dequantize_nvfp4(weight[rows], scale[rows], scale_2[rows])
        torch.matmul(xf, tile.t(), out=out[:, rows])
    return out


def _nvfp4_linear_kernel(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         scale_2: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    k = weight.shape[1] * 2
    y = nvfp4_matmul(x.reshape(-1, k).float(), weight, scale, scale_2)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


nvfp4_linear = torch.library.custom_op(
    "specdeploy::nvfp4_linear", _nvfp4_linear_kernel, mutates_args=()
)


@nvfp4_linear.register_fake
def _nvfp4_linear_fake(x, weight, scale, scale_2, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
