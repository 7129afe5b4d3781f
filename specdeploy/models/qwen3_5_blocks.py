"""Qwen3.5(-MoE) config and decoder blocks: gated attention, gated delta net, sparse MoE (or
the dense models' SwiGLU MLP).

Full-sequence math on canonical ops (`torch.ops.specdeploy.*`); no caches. Submodule and parameter
names follow transformers' `modeling_qwen3_5_moe.py` so checkpoint keys map one to one.

NOTE: every `RMSNorm` (the shared one from `layers.py`) holds a plain multiplicative weight. The
checkpoint stores the zero-centred form (`1 + w`) for all of them except the GDN output norm
(`linear_attn.norm`, a plain-weight gated norm); `qwen3_5_moe.checkpoint_to_params` converts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import specdeploy.ops  # noqa: F401  (registers torch.ops.specdeploy.*)
from specdeploy.models.layers import MLP, RMSNorm
from specdeploy.ops import route_softmax_topk
from specdeploy.ops.shard import Seg, heads, linear_col, linear_row, tp_param, tp_reduce, tp_split

_ops = torch.ops.specdeploy


@dataclass(frozen=True)
class Config:
    """Qwen3.5-MoE text config, normalized once from config.json (top level or `text_config`)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int = 0  # 0: dense Qwen3.5 (a SwiGLU MLP of `intermediate_size` per layer)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    intermediate_size: int = 0  # the dense MLP's width
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] | None = (11, 11, 10)
    mrope_interleaved: bool = True
    attention_bias: bool = False
    mtp_num_hidden_layers: int = 0
    tie_word_embeddings: bool = False

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def rope_inv_freq(self) -> torch.Tensor:
        """[rotary_dim / 2] fp32 on the CPU (explicit device: also right under a meta context)."""
        r = self.rotary_dim
        exps = torch.arange(0, r, 2, dtype=torch.float32, device="cpu") / r
        return 1.0 / (self.rope_theta**exps)

    @classmethod
    def from_hf(cls, hf: dict) -> Config:
        text = hf.get("text_config") or hf
        # transformers >= 5 nests rope fields in rope_parameters; older configs use rope_scaling
        # plus top-level rope_theta / partial_rotary_factor.
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):  # "mrope": Qwen2-VL-era name, default freqs
            raise ValueError(f"Qwen3.5-MoE: rope_type {rope_type!r} is not supported")
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Qwen3.5-MoE: hidden_act {text['hidden_act']!r} is not supported")
        n_layers = text["num_hidden_layers"]
        interval = text.get("full_attention_interval", 4)
        layer_types = text.get("layer_types") or [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(n_layers)
        ]
        section = rope.get("mrope_section", [11, 11, 10])  # transformers' default
        tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=text["num_attention_heads"],
            num_key_value_heads=text["num_key_value_heads"],
            head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
            layer_types=tuple(layer_types[:n_layers]),
            linear_num_key_heads=text["linear_num_key_heads"],
            linear_num_value_heads=text["linear_num_value_heads"],
            linear_key_head_dim=text["linear_key_head_dim"],
            linear_value_head_dim=text["linear_value_head_dim"],
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            **_ffn_fields(text),
            # transformers' 3.5 router always renormalizes; Qwen3-Next configs carry the flag.
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1e7))),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
            ),
            mrope_section=tuple(section) if section else None,
            # transformers' 3.5 rotary always interleaves; the flag is honoured when present.
            mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
            attention_bias=bool(text.get("attention_bias", False)),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
            tie_word_embeddings=bool(tie),
        )


def _ffn_fields(text: dict) -> dict:
    """MoE fields (Qwen3.5-MoE), or the dense MLP's width (Qwen3.5: no `num_experts`)."""
    if not text.get("num_experts"):
        if not text.get("intermediate_size"):
            raise ValueError("Qwen3.5: config has neither num_experts (MoE) nor "
                             "intermediate_size (dense)")
        return {"intermediate_size": int(text["intermediate_size"])}
    return {k: int(text[k]) for k in ("num_experts", "num_experts_per_tok",
                                      "moe_intermediate_size",
                                      "shared_expert_intermediate_size")}


class GatedRMSNorm(nn.Module):
    """Weight holder of the GDN output norm; the math is `gated_rms_norm` in the caller."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Attention(nn.Module):
    """Full attention with a sigmoid output gate: q_proj yields [query | gate] per head."""

    def __init__(self, cfg: Config):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * d * 2, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        (b, t, _), d, hq = x.shape, self.head_dim, self.n_heads
        # sharding hints: heads split (q_proj rows are [query | gate] per head), KV serve q heads
        q, gate = linear_col(self.q_proj, x, "mha", [heads(hq, 2 * d)]).view(
            b, t, -1, 2 * d).chunk(2, dim=-1)
        q = _ops.rope(self.q_norm(q), cos, sin)
        kv = [heads(self.n_kv, d, hq)]
        k = _ops.rope(self.k_norm(linear_col(self.k_proj, x, "mha", kv).view(b, t, -1, d)), cos,
                      sin)
        v = linear_col(self.v_proj, x, "mha", kv).view(b, t, -1, d)
        o = _ops.attention(q, k, v, self.head_dim**-0.5)
        o = o.reshape(b, t, -1) * torch.sigmoid(gate.reshape(b, t, -1))
        return tp_reduce(linear_row(self.o_proj, o, "mha", [heads(hq, d)]), "mha")


class GatedDeltaNet(nn.Module):
    """Gated delta net ("linear_attn"). Qwen3.5 splits Qwen3-Next's in_proj_qkvz/in_proj_ba into
    in_proj_qkv (conv channels q | k | v, contiguous), in_proj_z, in_proj_b, in_proj_a."""

    def __init__(self, cfg: Config):
        super().__init__()
        h = cfg.hidden_size
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.eps = cfg.rms_norm_eps
        conv_dim = 2 * self.nk * self.dk + self.nv * self.dv
        self.in_proj_qkv = nn.Linear(h, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.nv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(h, self.nv, bias=False)
        self.in_proj_a = nn.Linear(h, self.nv, bias=False)
        # Only its weight [C, 1, W] is used (by the causal_conv1d op), with the checkpoint's shape.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel_dim, groups=conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv)  # plain weight in the checkpoint (not zero-centred)
        self.out_proj = nn.Linear(self.nv * self.dv, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # sharding hints: key heads and value heads split together (nk, nv divisible by TP)
        qs, vs, n1 = heads(self.nk, self.dk), heads(self.nv, self.dv), [heads(self.nv, 1)]
        conv_w = tp_param(self.conv1d.weight, "delta", "colwise", 0, [qs, qs, vs])
        qkv, _ = _ops.causal_conv1d(linear_col(self.in_proj_qkv, x, "delta", [qs, qs, vs]),
                                    conv_w[:, 0], None, None, "silu")
        q, k, v = tp_split(qkv, "delta", [[qs], [qs], [vs]])
        q, k = q.reshape(b, t, -1, self.dk), k.reshape(b, t, -1, self.dk)
        v = v.reshape(b, t, -1, self.dv)
        if self.nv != self.nk:  # each key head serves nv/nk consecutive value heads
            q = q.repeat_interleave(self.nv // self.nk, dim=2)
            k = k.repeat_interleave(self.nv // self.nk, dim=2)
        beta = torch.sigmoid(linear_col(self.in_proj_b, x, "delta", n1))
        A_log, dt_bias = (tp_param(p, "delta", "colwise", 0, n1) for p in (self.A_log,
                                                                            self.dt_bias))
        # fp32 so that exp(A_log) cannot overflow in half precision
        g = -A_log.float().exp() * F.softplus(linear_col(self.in_proj_a, x, "delta", n1).float()
                                              + dt_bias.float())
        o, _ = _ops.gated_delta_rule(q, k, v, g, beta, None, True, self.dk**-0.5)
        z = linear_col(self.in_proj_z, x, "delta", [vs]).view(b, t, -1, self.dv)
        o = _ops.gated_rms_norm(o, z, self.norm.weight, self.eps, self.dv, True)  # norm, then gate
        return tp_reduce(linear_row(self.out_proj, o.reshape(b, t, -1), "delta", [vs]), "delta")


class Experts(nn.Module):
    """Routed experts as fused 3-D tensors (transformers' in-memory layout)."""

    def __init__(self, cfg: Config):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class SparseMoeBlock(nn.Module):
    """Softmax top-k routed SwiGLU experts plus a sigmoid-gated shared expert (where the config
    has one: Qwen3-MoE has none, models/qwen3_moe.py)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        route = route_softmax_topk(self.gate(x), self.top_k, self.renormalize)  # replicated
        # sharding hints: experts over EP ranks, each expert's width ([gate | up]) over TP ranks
        i = self.experts.down_proj.shape[-1]
        w_up = tp_param(self.experts.gate_up_proj, "moe", "expert_colwise", 1, [Seg(i), Seg(i)])
        w_down = tp_param(self.experts.down_proj, "moe", "expert_rowwise", 2, [Seg(i)])
        out = tp_reduce(_ops.moe_experts(x, route.ids, route.weights, w_up, w_down, "swiglu"),
                        "moe")
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        elif layer_type == "full_attention":
            self.self_attn = Attention(cfg)
        else:
            raise ValueError(f"unknown Qwen3.5 layer type {layer_type!r}")
        self.mlp = (SparseMoeBlock(cfg) if cfg.num_experts
                    else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h)
        else:
            h = self.self_attn(h, cos, sin)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))
