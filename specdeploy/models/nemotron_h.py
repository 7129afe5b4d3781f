"""NemotronH (Nemotron-H, Nano v2, Nemotron 3): Mamba2 / attention / relu² MLP / MoE blocks, each
`x + mixer(norm(x))`, ordered by `hybrid_override_pattern` ("M" Mamba2, "*" attention, "-" MLP,
"E" MoE). Attention has no positional encoding. Names follow transformers (`model.embeddings`,
`model.layers.N.{norm,mixer.*}`, `model.norm_f`, `lm_head`); released checkpoints say `backbone.*`.
NOTE: dt is clamped to `time_step_limit` (NVIDIA's code, vLLM); transformers 5 clamps at
`time_step_min`, which differs only where softplus(dt + dt_bias) < time_step_min.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import specdeploy.ops  # noqa: F401  (registers torch.ops.specdeploy.*)
from specdeploy.checkpoint import CheckpointError
from specdeploy.models.layers import RMSNorm
from specdeploy.ops import route_sigmoid

ARCHITECTURES = ("NemotronHForCausalLM",)
_ops = torch.ops.specdeploy
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_HF_TYPES = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
             "attention": "attention", "mlp": "mlp", "moe": "moe"}
_LEGACY = {"n_groups": "mamba_n_groups", "chunk_size": "mamba_chunk_size",
           "conv_kernel": "mamba_d_conv", "use_conv_bias": "mamba_conv_bias"}


def _types(hf: dict, list_key: str, pattern_key: str, default: str) -> tuple[str, ...]:
    if hf.get(list_key):
        return tuple(_HF_TYPES[t] for t in hf[list_key])
    return tuple(_PATTERN[c] for c in (hf.get(pattern_key) or default))


def _float(v) -> float:
    """transformers' save_pretrained writes inf as {"__float__": "Infinity"}."""
    return float(v["__float__"] if isinstance(v, dict) else v)


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    block_types: tuple[str, ...]  # "mamba" | "attention" | "mlp" | "moe" per layer
    mtp_block_types: tuple[str, ...]  # one MTP group, e.g. ("attention", "moe")
    eps: float
    dt_min: float
    dt_max: float
    num_key_value_heads: int
    head_dim: int
    sliding_window: int
    # The rest keep their HF names; the defaults are transformers'.
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    chunk_size: int = 128
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    num_attention_heads: int = 32
    attention_bias: bool = False
    intermediate_size: int = 0
    mlp_bias: bool = False
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, hf: dict) -> Config:
        hf = {**hf, **hf.get("text_config", {})}
        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if hf.get(key, want) != want:
                raise ValueError(f"NemotronH: {key}={hf[key]!r} is not supported (only {want!r})")
        f = {x.name: hf.get(x.name, hf.get(_LEGACY.get(x.name, ""), x.default))
             for x in fields(cls) if x.default is not MISSING}
        lo, hi = hf.get("time_step_limit", hf.get("mamba_dt_limit", (0.0, math.inf)))
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            block_types=_types(hf, "layers_block_type", "hybrid_override_pattern", "M*E-"),
            mtp_block_types=_types(hf, "mtp_layers_block_type", "mtp_hybrid_override_pattern",
                                   "*E"),
            eps=hf.get("layer_norm_epsilon", hf.get("rms_norm_eps", 1e-5)),
            dt_min=_float(lo), dt_max=_float(hi),
            num_key_value_heads=hf.get("num_key_value_heads") or f["num_attention_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // f["num_attention_heads"],
            sliding_window=hf.get("sliding_window") or 0, **f)


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
        z, xbc, dt = self.in_proj(x).split(self.sizes, dim=-1)
        xbc, _ = _ops.causal_conv1d(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, None,
                                    "silu")
        gn = (self.sizes[1] - inner) // 2
        xs, B, C = xbc.split([inner, gn, gn], dim=-1)
        y, _ = _ops.ssm_scan(
            xs.reshape(b, t, c.mamba_num_heads, -1), dt, -torch.exp(self.A_log.float()),
            B.reshape(b, t, c.n_groups, -1), C.reshape(b, t, c.n_groups, -1), self.D, self.dt_bias,
            c.dt_min, c.dt_max, c.chunk_size, None)
        y = _ops.gated_rms_norm(y.reshape(b, t, inner), z, self.norm.weight, c.eps,
                                inner // c.n_groups, False)
        return self.out_proj(y)


class Attention(nn.Module):
    """Causal GQA, no RoPE."""

    def __init__(self, cfg: Config):
        super().__init__()
        h, d, hq, hkv, bias = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                               cfg.num_key_value_heads, cfg.attention_bias)
        self.head_dim, self.window = d, cfg.sliding_window
        self.q_proj = nn.Linear(h, hq * d, bias=bias)
        self.k_proj = nn.Linear(h, hkv * d, bias=bias)
        self.v_proj = nn.Linear(h, hkv * d, bias=bias)
        self.o_proj = nn.Linear(hq * d, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:2], -1, self.head_dim)
        q, k, v = (p(x).view(shape) for p in (self.q_proj, self.k_proj, self.v_proj))
        o = _ops.attention(q, k, v, self.head_dim**-0.5, self.window)
        return self.o_proj(o.flatten(2))


class MLP(nn.Module):
    """Non-gated relu² MLP: down(relu(up(x))²)."""

    def __init__(self, hidden: int, inter: int, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


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
        y = _ops.moe_experts(h, r.ids, r.weights.to(h.dtype), self.experts.up_proj,
                             self.experts.down_proj, "relu2")
        y = self.fc2_latent_proj(y) if c.moe_latent_size else y
        return y.view(x.shape) + self.shared_experts(x)


class Block(nn.Module):
    def __init__(self, cfg: Config, kind: str):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.mixer = (MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias) if kind == "mlp"
                      else {"mamba": Mamba2Mixer, "attention": Attention, "moe": MoE}[kind](cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


class Model(nn.Module):
    def __init__(self, cfg: Config, with_mtp: bool = False):
        super().__init__()
        self.cfg, self.model = cfg, nn.Module()
        self.model.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(Block(cfg, kind) for kind in cfg.block_types)
        self.model.norm_f = RMSNorm(cfg.hidden_size, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if with_mtp:
            from specdeploy.models.drafters.nemotron_h_mtp import MTP

            self.mtp = MTP(cfg, self.model.embeddings, self.lm_head)

    def forward_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
        """[B, T] -> final-normed hidden [B, T, H]; positions are unused (no RoPE)."""
        x = self.model.embeddings(input_ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.model.norm_f(x)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
        return self.lm_head(self.forward_hidden(input_ids, position_ids))


_FUSED = ("experts.up_proj", "experts.down_proj")


def checkpoint_to_params(reader, cfg: Config, with_mtp: bool = False
                         ) -> dict[str, Callable[[], torch.Tensor]]:
    """Accepts `backbone.*` / `model.*` / `model.language_model.*` and per-expert
    (`experts.{e}.up_proj.weight`) or fused (`experts.up_proj` [E, I, H]) expert tensors."""
    pre = next((p for p in ("backbone.", "model.language_model.", "model.")
                if reader.has_prefix(p + "layers.") or p + "embeddings.weight" in reader), "model.")
    with torch.device("meta"):
        model = Model(cfg, with_mtp)
    names = [n for n, _ in [*model.named_parameters(), *model.named_buffers()]]
    out, missing = {}, []
    for name in names:
        key = pre + name[len("model."):] if name.startswith("model.") else name
        if key == "lm_head.weight" and key not in reader and cfg.tie_word_embeddings:
            key = pre + "embeddings.weight"
        if name.endswith(_FUSED) and key not in reader:
            head, _, proj = key.rpartition(".")
            keys = [f"{head}.{e}.{proj}.weight" for e in range(cfg.n_routed_experts)]
            if all(k in reader for k in keys):
                out[name] = lambda keys=keys: torch.stack([reader.get(k) for k in keys])
                continue
            key = keys[0]
        if key in reader:
            out[name] = lambda key=key: reader.get(key)
        elif name.startswith("mtp."):
            missing.append(key)
    if missing:
        raise CheckpointError(f"{reader.path}: MTP requested but {len(missing)} MTP tensors are "
                              f"missing: {', '.join(missing[:12])}")
    return out


def params_to_checkpoint(state_dict: dict[str, torch.Tensor], cfg: Config
                         ) -> dict[str, torch.Tensor]:
    """Released layout: `backbone.*`, one tensor per expert, `mtp.*` unprefixed."""
    out = {}
    for name, t in state_dict.items():
        key = "backbone." + name[len("model."):] if name.startswith("model.") else name
        if name.endswith(_FUSED):
            head, _, proj = key.rpartition(".")
            out.update({f"{head}.{e}.{proj}.weight": t[e] for e in range(t.shape[0])})
        else:
            out[key] = t
    return out


def tiny_hf_config(mtp_layers: int = 0) -> dict:
    """Every block kind, two SSM groups, chunk 16 (33 tokens span chunks), grouped latent MoE."""
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 128,
        "hidden_size": 64, "hybrid_override_pattern": "M*M-E*ME", "num_hidden_layers": 8,
        "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False, "mamba_num_heads": 8,
        "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16,
        "conv_kernel": 4, "use_conv_bias": True, "use_bias": False, "mamba_hidden_act": "silu",
        "time_step_limit": [0.0, math.inf], "time_step_min": 0.001, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
        "mlp_hidden_act": "relu2", "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48,
        "moe_latent_size": 32, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": mtp_layers, "mtp_hybrid_override_pattern": "*E",
        "bos_token_id": None, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
    }


def random_params(cfg: Config, seed: int = 0, with_mtp: bool = False) -> dict[str, torch.Tensor]:
    """Non-degenerate random weights: norms near 1, A in [-16, -1], softplus(dt_bias) in [0.02, 0.1]
    (above transformers' dt floor of time_step_min, so its clamp never bites)."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = Model(cfg, with_mtp)
    out = {}
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        leaf, u, n = name.rsplit(".", 1)[-1], torch.rand(p.shape, generator=g), torch.randn(
            p.shape, generator=g)
        dt = 0.02 * 5**u
        out[name] = (torch.log(1 + 15 * u) if leaf == "A_log" else
                     dt + torch.log(-torch.expm1(-dt)) if leaf == "dt_bias" else  # inverse softplus
                     1 + 0.1 * n if leaf == "D" or (leaf == "weight" and p.dim() == 1) else
                     n * (1.0 if "embeddings" in name else 0.3 if "conv1d" in name else
                          0.05 if leaf.endswith("bias") else 0.08))
    return out


def make_tiny(out: str | Path, seed: int = 0, mtp_layers: int = 0, hf_config: dict | None = None
              ) -> Path:
    """Write a tiny random checkpoint (released layout) + tokenizer; `hf_config` overrides."""
    from specdeploy.checkpoint.tiny import write_checkpoint, write_tiny_tokenizer

    hf = hf_config or tiny_hf_config(mtp_layers)
    cfg = Config.from_hf(hf)
    params = random_params(cfg, seed, with_mtp=cfg.num_nextn_predict_layers > 0)
    path = write_checkpoint(out, hf, params_to_checkpoint(params, cfg))
    write_tiny_tokenizer(path, cfg.vocab_size)
    return path
