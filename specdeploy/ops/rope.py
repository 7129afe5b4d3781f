"""Rotary position embedding: cos/sin construction (plain torch) and the rotate-half op."""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdeploy.ops import row_kernels
from specdeploy.ops.autograd import register_recompute_autograd

__all__ = ["RopeCosSin", "rope_cos_sin", "rope_cos_sin_ref", "rope_ref", "rotate_half"]


class RopeCosSin(NamedTuple):
    cos: torch.Tensor  # [B, T, R] fp32
    sin: torch.Tensor  # [B, T, R] fp32


def rope_cos_sin(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: list[int] | tuple[int, ...] | None = None,
    mrope_interleaved: bool = False,
    attention_scaling: float = 1.0,
) -> RopeCosSin:
    """Build cos/sin [B, T, R] (R = 2 * len(inv_freq)) for rotate-half RoPE.

    Args:
        position_ids: [B, T], or [3, B, T] (temporal, height, width) for multimodal RoPE; a [B, T]
            input with an mrope_section is broadcast to all three axes (pure text).
        inv_freq: [R/2] inverse frequencies (partial rotary: R < head dim, the rest passes).
        mrope_section: per-axis counts of frequency slots (sum = R/2).
        mrope_interleaved: Qwen3-VL / Qwen3.5 layout (slot i takes axis i % 3 while that axis has
            slots left) instead of Qwen2-VL's contiguous blocks.
        attention_scaling: multiplies cos and sin (YaRN-style rope types; 1.0 otherwise).

    One op in the graph (`specdeploy::rope_cos_sin`): on the CPU one C call (row_kernels.c), so
    a replayed step computes its cos / sin without ~7-11 torch ops (their dispatch was ~0.2 ms
    of a Qwen3.5-MoE GGUF's 2.2 ms replayed decode step); elsewhere `rope_cos_sin_ref`.
    """
    sections = [] if mrope_section is None else [int(v) for v in mrope_section]
    cos, sin = torch.ops.specdeploy.rope_cos_sin(position_ids, inv_freq, sections,
                                                 bool(mrope_interleaved), float(attention_scaling))
    return RopeCosSin(cos, sin)


def rope_cos_sin_ref(position_ids: torch.Tensor, inv_freq: torch.Tensor,
                     mrope_section: list[int] | tuple[int, ...] | None = None,
                     mrope_interleaved: bool = False, attention_scaling: float = 1.0
                     ) -> RopeCosSin:
    """`rope_cos_sin` in torch ops (the oracle, and the path off the CPU)."""
    inv = inv_freq.float().to(position_ids.device)
    if mrope_section is None:
        freqs = position_ids.float()[..., None] * inv
    else:
        if position_ids.dim() == 2:
            position_ids = position_ids.expand(3, *position_ids.shape)
        freqs_axes = position_ids.float()[..., None] * inv  # [3, B, T, R/2]
        freqs = _merge_mrope(freqs_axes, list(mrope_section), mrope_interleaved)
    emb = torch.cat((freqs, freqs), dim=-1)
    return RopeCosSin(emb.cos() * attention_scaling, emb.sin() * attention_scaling)


def _merge_mrope(freqs: torch.Tensor, section: list[int], interleaved: bool) -> torch.Tensor:
    half = freqs.shape[-1]
    # built where the positions are: a host constant copied in would break CUDA-graph capture
    axis = torch.zeros(half, dtype=torch.long, device=freqs.device)
    if interleaved:
        # slot j with j % 3 == a < 3 and j < 3 * section[a] is axis a (1, 2); the rest temporal
        for a in (1, 2):
            axis[a : section[a] * 3 : 3] = a
    else:
        start = 0
        for a, n in enumerate(section):
            axis[start : start + n] = a
            start += n
    index = axis[None, None, None, :].expand(1, *freqs.shape[1:])
    return freqs.gather(0, index)[0]


def _cos_sin_kernel(position_ids: torch.Tensor, inv_freq: torch.Tensor, sections: list[int],
                    interleaved: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    out = row_kernels.rope_cos_sin(position_ids, inv_freq, sections, interleaved, scaling)
    if out is not None:
        return out
    ref = rope_cos_sin_ref(position_ids, inv_freq, sections or None, interleaved, scaling)
    return ref.cos, ref.sin


_cos_sin = torch.library.custom_op("specdeploy::rope_cos_sin", _cos_sin_kernel, mutates_args=())


@_cos_sin.register_fake
def _cos_sin_fake(position_ids, inv_freq, sections, interleaved, scaling):
    shape = (*position_ids.shape[-2:], 2 * inv_freq.shape[0])
    return (position_ids.new_empty(shape, dtype=torch.float32),
            position_ids.new_empty(shape, dtype=torch.float32))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first R dims.

    x: [B, T, H, D]; cos, sin: [B, T, R] -> [B, T, H, D] in x's dtype.
    """
    r = cos.shape[-1]
    xf = x.float()
    x_rot, x_pass = xf[..., :r], xf[..., r:]
    c, s = cos.float()[:, :, None, :], sin.float()[:, :, None, :]
    out = torch.cat((x_rot * c + rotate_half(x_rot) * s, x_pass), dim=-1)
    return out.to(x.dtype)


def _rope_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    out = row_kernels.rope(x, cos, sin)  # CPU fp32: one C call, bit-identical (row_kernels.c)
    if out is not None:
        return out
    if cos.shape[-1] == x.shape[-1] and x.dtype == torch.float32 == cos.dtype:
        # full rotary in fp32: no split / concat of a pass-through part, no casts
        c, s = cos[:, :, None, :], sin[:, :, None, :]
        return x * c + rotate_half(x) * s
    return rope_ref(x, cos, sin)


rope = torch.library.custom_op("specdeploy::rope", _rope_kernel, mutates_args=())
register_recompute_autograd(rope, _rope_kernel)


@rope.register_fake
def _rope_fake(x, cos, sin):
    return torch.empty_like(x)
