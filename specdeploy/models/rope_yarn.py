"""YaRN RoPE (gpt-oss's `rope_type: "yarn"`): inverse frequencies blended between the original
(extrapolated) and the `factor`-interpolated ones over a ramp of dimensions, and cos / sin both
multiplied by an attention factor (0.1 ln(factor) + 1 unless given).

Same float steps as transformers' `_compute_yarn_parameters` (modeling_rope_utils.py), so the
cos / sin tables match it; kept apart from layers.RopeConfig, whose rotary embedding does not
apply the attention factor (a YaRN config there would be silently wrong, so it is refused).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from specdeploy.ops.rope import RopeCosSin, rope_cos_sin

__all__ = ["Yarn", "YarnRotaryEmbedding", "yarn_mscale"]


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class Yarn:
    theta: float
    factor: float = 1.0  # 1.0 (or rope_type "default"): plain RoPE
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 4096
    truncate: bool = True
    attention_factor: float | None = None

    @classmethod
    def from_params(cls, params: dict, theta: float, max_positions: int,
                    family: str = "gpt-oss", mscale: bool = False) -> Yarn:
        """From a `rope_parameters` / `rope_scaling` dict (rope_type "default" or "yarn").
        `mscale`: the family reads DeepSeek's `mscale` / `mscale_all_dim` (the attention factor
        mscale(factor, mscale) / mscale(factor, mscale_all_dim), as transformers); otherwise
        they are refused."""
        kind = params.get("rope_type", params.get("type", "default"))
        if kind == "default":
            return cls(theta=theta)
        if kind != "yarn":
            raise ValueError(f"{family}: unsupported rope type {kind!r}; supported: default, "
                             "yarn")
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        if not mscale and (m or m_all):
            raise ValueError(f"{family}: YaRN mscale / mscale_all_dim are not supported")
        factor = params.get("factor")
        orig = int(params.get("original_max_position_embeddings") or max_positions)
        factor = float(factor if factor is not None else max_positions / orig)
        att = params.get("attention_factor")
        if att is None and m and m_all:
            att = yarn_mscale(factor, float(m)) / yarn_mscale(factor, float(m_all))
        return cls(theta=theta, factor=factor,
                   beta_fast=float(params.get("beta_fast") or 32),
                   beta_slow=float(params.get("beta_slow") or 1),
                   original_max_position_embeddings=orig,
                   truncate=bool(params.get("truncate", True)),
                   attention_factor=None if att is None else float(att))

    @property
    def scaling(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        return yarn_mscale(self.factor)

    def inv_freq(self, dim: int) -> torch.Tensor:
        """[dim // 2] fp32, computed on the CPU (see layers.RopeConfig.inv_freq)."""
        pos = self.theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
        if self.factor == 1.0 and self.attention_factor is None:
            return 1.0 / pos
        extrapolation, interpolation = 1.0 / pos, 1.0 / (self.factor * pos)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings
                                   / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # (a zero-width ramp)
        ramp = ((torch.arange(dim // 2, device="cpu", dtype=torch.float32) - low)
                / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # the share of the extrapolated (original) frequency
        return interpolation * (1 - keep) + extrapolation * keep


class YarnRotaryEmbedding(nn.Module):
    """`inv_freq` (computed, non-persistent) and the cos / sin of every layer, scaled."""

    def __init__(self, yarn: Yarn, rotary_dim: int):
        super().__init__()
        self.yarn, self.rotary_dim = yarn, rotary_dim
        self.register_buffer("inv_freq", yarn.inv_freq(rotary_dim), persistent=False)

    def init_buffers(self) -> None:
        self.inv_freq = self.yarn.inv_freq(self.rotary_dim)

    def forward(self, position_ids: torch.Tensor) -> RopeCosSin:
        return rope_cos_sin(position_ids, self.inv_freq, attention_scaling=self.yarn.scaling)
