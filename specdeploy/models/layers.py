"""Blocks shared by model families: RMSNorm, gated MLP, rotary embedding (inv_freq + cos/sin).

Every block expresses its math with canonical ops (`torch.ops.specdeploy.*`) so graph transforms can
find them. Parameter names follow HF (`weight`, `gate_proj`, `up_proj`, `down_proj`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import specdeploy.ops  # noqa: F401  (registers torch.ops.specdeploy.*)
from specdeploy.models.rope_yarn import Yarn
from specdeploy.ops.rope import RopeCosSin, rope_cos_sin
from specdeploy.ops.shard import linear_col, linear_row, tp_reduce

__all__ = ["MLP", "RMSNorm", "RopeConfig", "RotaryEmbedding", "ACTIVATIONS"]

ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    """`x / rms(x) * weight` over the last dim (checkpoints storing `1 + w` convert at load)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.specdeploy.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class MLP(nn.Module):
    """Gated MLP: `down_proj(act(gate_proj(x)) * up_proj(x))` (SwiGLU for act="silu")."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 act: str = "silu", layer_type: str = "mlp"):
        super().__init__()
        self.layer_type = layer_type  # sharding hint: column → row, one all-reduce
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}; supported: {sorted(ACTIVATIONS)}")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.layer_type
        h = self.act(linear_col(self.gate_proj, x, t)) * linear_col(self.up_proj, x, t)
        return tp_reduce(linear_row(self.down_proj, h, t), t)


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE frequencies, normalized from HF's `rope_parameters` (v5) or `rope_theta` +
    `rope_scaling` (v4 configs, still what most released checkpoints carry)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # llama.cpp stores llama3-style scaling as per-frequency divisors (`rope_freqs.weight`)
    freq_factors: tuple[float, ...] | None = None
    # rope_type "yarn" (Qwen2.5 / Qwen3's long-context setting, gpt-oss's EAGLE-3 heads): its
    # blended frequencies and cos / sin scale, as transformers' `_compute_yarn_parameters`
    yarn: Yarn | None = None

    @classmethod
    def from_hf(cls, hf: dict, default_theta: float = 10000.0) -> RopeConfig:
        params = dict(hf.get("rope_parameters") or {})
        if hf.get("rope_scaling"):
            params = {**hf["rope_scaling"], **params}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: {ROPE_TYPES}")
        theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
        ff = params.get("freq_factors")
        yarn = None
        if rope_type == "yarn":
            yarn = Yarn.from_params(params, float(theta), int(hf.get(
                "max_position_embeddings", 8192)), family="rope_scaling", mscale=True)
        return cls(
            theta=float(theta), rope_type=rope_type, factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get(
                "original_max_position_embeddings", hf.get("max_position_embeddings", 8192))),
            freq_factors=tuple(float(f) for f in ff) if ff is not None else None, yarn=yarn,
        )

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by (YaRN's magnitude correction; 1 otherwise)."""
        return 1.0 if self.yarn is None else self.yarn.scaling

    def inv_freq(self, rotary_dim: int) -> torch.Tensor:
        """[rotary_dim // 2] fp32 inverse frequencies (same float steps as transformers).

        Always computed on the CPU: under a meta-device context, the division would route through
        torch._refs and import torch._dynamo (seconds of load time)."""
        if self.yarn is not None:
            return self.yarn.inv_freq(rotary_dim)
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
        exponent = exponent / rotary_dim
        inv = 1.0 / (self.theta ** exponent)
        if self.rope_type == "linear":
            inv = inv / self.factor
        elif self.rope_type == "llama3":
            inv = self._llama3(inv)
        if self.freq_factors is not None:
            inv = inv / torch.tensor(self.freq_factors, dtype=torch.float32, device="cpu")
        return inv

    def _llama3(self, inv: torch.Tensor) -> torch.Tensor:
        old = self.original_max_position_embeddings
        low_wavelen = old / self.low_freq_factor
        high_wavelen = old / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (old / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds `inv_freq` (a computed, non-persistent buffer) and builds cos/sin once per forward;
    every layer shares them, so no per-layer tables are allocated."""

    def __init__(self, rope: RopeConfig, rotary_dim: int):
        super().__init__()
        self.rope = rope
        self.rotary_dim = rotary_dim
        self.register_buffer("inv_freq", rope.inv_freq(rotary_dim), persistent=False)

    def init_buffers(self) -> None:
        """Rebuild `inv_freq` (on the CPU; `.to(device)` moves it with the model)."""
        self.inv_freq = self.rope.inv_freq(self.rotary_dim)

    def forward(self, position_ids: torch.Tensor) -> RopeCosSin:
        return rope_cos_sin(position_ids, self.inv_freq,
                            attention_scaling=self.rope.attention_scaling)
