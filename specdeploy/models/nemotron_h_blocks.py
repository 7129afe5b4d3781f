"""NemotronH blocks: Mamba2 mixer, attention (no RoPE), relu² MLP, sigmoid-routed MoE, and the
pre-norm residual block around them. Full-sequence math on canonical ops; names as transformers."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

import specdeploy.ops  # noqa: F401  (registers torch.ops.specdeploy.*)
from specdeploy.models.layers import RMSNorm
from specdeploy.ops import route_sigmoid
from specdeploy.ops.shard import (
    Seg,
    heads,
    linear_col,
    linear_partial,
    linear_row,
    tp_param,
    tp_reduce,
    tp_split,
)

if TYPE_CHECKING:
    from specdeploy.models.nemotron_h_config import Config

_ops = torch.ops.specdeploy


class Mamba2Mixer(nn.Module):
    """in_proj -> (z, xBC, dt); depthwise causal conv + SiLU on xBC; SSD scan; per-group RMSNorm
    of y * silu(z) (`mixer.norm`, groups of intermediate / n_groups); out_proj."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg, inner = cfg, cfg.mamba_num_heads * cfg.mamba_head_dim
        self.sizes = (inner, inner + 2 * cfg.n_groups * cfg.ssm_state_size, cfg.mamba_num_heads)
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.use_bias)
        # An nn.Conv1d only for the checkpoint's [C, 1, W] weight; the math is the canonical op.
        c = self.sizes[1]
        self.conv1d = nn.Conv1d(c, c, cfg.conv_kernel, groups=c, bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(cfg.mamba_num_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.mamba_num_heads))
        self.D = nn.Parameter(torch.ones(cfg.mamba_num_heads))
        self.norm = RMSNorm(inner, cfg.eps)  # weight holder; applied as the gated norm
        self.out_proj = nn.Linear(inner, cfg.hidden_size, bias=cfg.use_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, (b, t, _), inner = self.cfg, x.shape, self.sizes[0]
        # sharding hints: heads and groups split together (the gated norm's groups follow)
        hs, gs, n1 = heads(c.mamba_num_heads, c.mamba_head_dim), heads(c.n_groups,
                                                                      c.ssm_state_size), heads(
            c.mamba_num_heads, 1)
        z, xbc, dt = tp_split(linear_col(self.in_proj, x, "ssm", [hs, hs, gs, gs, n1]), "ssm",
                              [[hs], [hs, gs, gs], [n1]])
        conv_w, conv_b = (None if p is None else tp_param(p, "ssm", "colwise", 0, [hs, gs, gs])
                          for p in (self.conv1d.weight, self.conv1d.bias))
        xbc, _ = _ops.causal_conv1d(xbc, conv_w.squeeze(1), conv_b, None, "silu")
        xs, B, C = tp_split(xbc, "ssm", [[hs], [gs], [gs]])
        A_log, D, dt_bias = (tp_param(p, "ssm", "colwise", 0, [n1])
                             for p in (self.A_log, self.D, self.dt_bias))
        y, _ = _ops.ssm_scan(
            xs.reshape(b, t, -1, c.mamba_head_dim), dt, -torch.exp(A_log.float()),
            B.reshape(b, t, -1, c.ssm_state_size), C.reshape(b, t, -1, c.ssm_state_size), D,
            dt_bias, c.dt_min, c.dt_max, c.chunk_size, None)
        y = _ops.gated_rms_norm(y.reshape(b, t, -1), z, tp_param(self.norm.weight, "ssm",
                                                                 "colwise", 0, [hs]),
                                c.eps, inner // c.n_groups, False)
        return tp_reduce(linear_row(self.out_proj, y, "ssm", [hs]), "ssm")


class Attention(nn.Module):
    """Causal GQA, no RoPE."""

    def __init__(self, cfg: Config):
        super().__init__()
        h, d, hq, hkv, bias = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                               cfg.num_key_value_heads, cfg.attention_bias)
        self.head_dim, self.window, self.heads = d, cfg.sliding_window, (hq, hkv)
        self.q_proj = nn.Linear(h, hq * d, bias=bias)
        self.k_proj = nn.Linear(h, hkv * d, bias=bias)
        self.v_proj = nn.Linear(h, hkv * d, bias=bias)
        self.o_proj = nn.Linear(hq * d, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, (hq, hkv), d = (*x.shape[:2], -1, self.head_dim), self.heads, self.head_dim
        q, k, v = (linear_col(p, x, "mha", [s]).view(shape) for p, s in (
            (self.q_proj, heads(hq, d)), (self.k_proj, heads(hkv, d, hq)),
            (self.v_proj, heads(hkv, d, hq))))
        o = _ops.attention(q, k, v, self.head_dim**-0.5, self.window)
        return tp_reduce(linear_row(self.o_proj, o.flatten(2), "mha", [heads(hq, d)]), "mha")


class MLP(nn.Module):
    """Non-gated relu² MLP: down(relu(up(x))²)."""

    def __init__(self, hidden: int, inter: int, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(linear_col(self.up_proj, x, "mlp")).square()
        return tp_reduce(linear_row(self.down_proj, h, "mlp"), "mlp")


class MoE(nn.Module):
    """Sigmoid routing with `gate.e_score_correction_bias` steering selection; relu² experts held
    fused ([E, I, H'] / [E, H', I], H' = moe_latent_size or hidden, with latent projections around
    them); plus a shared relu² expert on the block input."""

    def __init__(self, cfg: Config):
        super().__init__()
        e, i, lat = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_latent_size
        self.cfg = cfg
        self.gate, self.experts = nn.Module(), nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(e, cfg.hidden_size))
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.experts.up_proj = nn.Parameter(torch.zeros(e, i, lat or cfg.hidden_size))
        self.experts.down_proj = nn.Parameter(torch.zeros(e, lat or cfg.hidden_size, i))
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size,
                                  cfg.mlp_bias)
        if lat:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, lat, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(lat, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, flat = self.cfg, x.reshape(-1, x.shape[-1])
        # NOTE: routing in fp32 whatever the model dtype (released checkpoints keep it in fp32).
        logits = F.linear(flat.float(), self.gate.weight.float())
        r = route_sigmoid(logits, self.gate.e_score_correction_bias, c.num_experts_per_tok,
                          c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
        h = self.fc1_latent_proj(flat) if c.moe_latent_size else flat
        # sharding hints: experts over EP ranks, each expert's width over TP ranks
        width = [Seg(c.moe_intermediate_size)]
        w_up = tp_param(self.experts.up_proj, "moe", "expert_colwise", 1, width)
        w_down = tp_param(self.experts.down_proj, "moe", "expert_rowwise", 2, width)
        y = _ops.moe_experts(h, r.ids, r.weights.to(h.dtype), w_up, w_down, "relu2")
        # the latent projection is linear: applied to each rank's partial sum (bias once)
        y = linear_partial(self.fc2_latent_proj, y, "moe") if c.moe_latent_size else y
        return tp_reduce(y, "moe").view(x.shape) + self.shared_experts(x)


class Block(nn.Module):
    def __init__(self, cfg: Config, kind: str):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.mixer = (MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias) if kind == "mlp"
                      else {"mamba": Mamba2Mixer, "attention": Attention, "moe": MoE}[kind](cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))
