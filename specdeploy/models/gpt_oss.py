"""OpenAI gpt-oss (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b): Llama-style GQA attention with
biases on q/k/v/o, YaRN RoPE, a learned attention sink per query head (a logit that joins each
softmax's denominator only), sliding-window (`layer_types`) and full layers alternating; every
MLP is a MoE: a router with a bias, top-k then a softmax over the chosen logits, experts with
biases and a clamped SwiGLU (ops/moe_bias.py).

Names follow transformers' `modeling_gpt_oss.py`. Checkpoints: full precision
(`mlp.experts.gate_up_proj` [E, H, 2I] with gate / up interleaved as even / odd columns,
`down_proj` [E, I, H], their biases) or MXFP4 as released (checkpoint/mxfp4.py reads those
tensors dequantized, exactly, and hands the CPU's block kernels the MXFP4 blocks themselves:
deploy/passes/ggml_experts.py). Here the experts are stored as every other family's fused
experts: `gate_up_proj` [E, 2I, H] with the gate rows first, `down_proj` [E, H, I].
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdeploy.checkpoint import CheckpointError, CheckpointReader
from specdeploy.models import llama
from specdeploy.models.layers import RMSNorm
from specdeploy.models.rope_yarn import Yarn, YarnRotaryEmbedding
from specdeploy.ops import route_softmax_topk
from specdeploy.ops.shard import heads, linear_col, linear_row, tp_param, tp_reduce

ARCHITECTURES = ("GptOssForCausalLM",)
_ops = torch.ops.specdeploy
_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


@dataclass(frozen=True)
class Config(llama.Config):
    num_experts: int = 0  # (num_local_experts)
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    yarn: Yarn = Yarn(theta=150000.0)

    @classmethod
    def from_hf(cls, hf: dict) -> Config:
        hf = hf.get("text_config") or hf
        n = int(hf["num_hidden_layers"])
        # transformers' defaults: sliding layers first, then alternating; YaRN x32 over 4,096
        types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else
                                          "full_attention" for i in range(n)]
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096})
        theta = float(params.get("rope_theta", hf.get("rope_theta", 150000.0)))
        positions = int(hf.get("max_position_embeddings", 131072))
        plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
        base = llama.Config.from_hf({**plain, "model_type": "gpt_oss", "layer_types": types,
                                     "sliding_window": hf.get("sliding_window", 128),
                                     "attention_bias": hf.get("attention_bias", True),
                                     "rope_theta": theta, "max_position_embeddings": positions})
        return cls(**base.__dict__,
                   num_experts=int(hf.get("num_local_experts") or hf.get("num_experts") or 0),
                   num_experts_per_tok=int(hf.get("num_experts_per_tok")
                                           or hf.get("experts_per_token") or 4),
                   swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                   swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                   yarn=Yarn.from_params(params, theta, positions))


class Attention(llama.Attention):
    """llama's attention (biases on q/k/v/o via the config) plus `sinks` [Hq]."""

    def __init__(self, cfg: Config, window: int = 0):
        super().__init__(cfg, window=window)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_attention_heads))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        (b, t, _), d, hq = x.shape, self.head_dim, self.num_heads
        q = linear_col(self.q_proj, x, "mha", [heads(hq, d)]).view(b, t, -1, d)
        k = linear_col(self.k_proj, x, "mha", [heads(self.num_kv_heads, d, hq)]).view(b, t, -1, d)
        v = linear_col(self.v_proj, x, "mha", [heads(self.num_kv_heads, d, hq)]).view(b, t, -1, d)
        q = _ops.rope(q, cos, sin)
        k = _ops.rope(k, cos, sin)
        sinks = tp_param(self.sinks, "mha", "colwise", 0, [heads(hq, 1)])  # one per q head
        o = _ops.attention(q, k, v, self.scale, self.window, sinks)
        return tp_reduce(linear_row(self.o_proj, o.reshape(b, t, -1), "mha", [heads(hq, d)]),
                         "mha")


class Experts(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h))


class MoE(nn.Module):
    """Router (weight and bias) → top-k → softmax over the k logits → biased experts.
    (Replicated over TP ranks: no sharding hints.)"""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, ex, flat = self.cfg, self.experts, x.reshape(-1, x.shape[-1])
        # NOTE: routing in fp32 whatever the model dtype. A softmax over all experts, top-k and
        # renormalized is the softmax over the top-k logits (exp(l_i) / sum over the k), which
        # is transformers' order of operations; the shared op runs it as one C call here.
        logits = F.linear(flat.float(), self.router.weight.float(), self.router.bias.float())
        r = route_softmax_topk(logits, c.num_experts_per_tok, True)
        y = _ops.moe_experts_bias(flat, r.ids, r.weights.to(flat.dtype), ex.gate_up_proj,
                                  ex.gate_up_proj_bias, ex.down_proj, ex.down_proj_bias,
                                  "swiglu_oai", c.swiglu_alpha, c.swiglu_limit)
        return y.view(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window=cfg.window(index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(llama.Model):
    """`forward(input_ids[B,T], position_ids?) -> logits` (no MTP head in gpt-oss)."""

    def __init__(self, cfg: Config, with_mtp: bool = False):
        super().__init__(cfg, with_mtp)
        self.model.rotary_emb = YarnRotaryEmbedding(cfg.yarn, cfg.head_dim)

    @staticmethod
    def layer_factory(cfg: Config):
        return lambda i: DecoderLayer(cfg, i)


def _expert_loader(reader, key: str, leaf: str, cfg: Config) -> Callable[[], torch.Tensor]:
    """Checkpoint expert tensor (transformers' layout) → ours, shape-checked first."""
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    want = {"gate_up_proj": (e, h, 2 * i), "gate_up_proj_bias": (e, 2 * i),
            "down_proj": (e, i, h), "down_proj_bias": (e, h)}[leaf]

    def load() -> torch.Tensor:
        t = reader.get(key)
        if tuple(t.shape) != want:
            raise CheckpointError(f"{reader.path}: {key} must be {list(want)} (gpt-oss "
                                  f"experts), got {list(t.shape)}")
        if leaf == "gate_up_proj":  # [E, H, 2I] interleaved → [E, 2I, H], gate rows first
            t = t.transpose(1, 2)
        if leaf.startswith("gate_up_proj"):
            return torch.cat((t[:, 0::2], t[:, 1::2]), 1).contiguous()
        return t.transpose(1, 2).contiguous() if leaf == "down_proj" else t
    return load


def checkpoint_to_params(reader: CheckpointReader, cfg: Config, with_mtp: bool = False
                         ) -> dict[str, Callable[[], torch.Tensor]]:
    """Our parameter name → lazy tensor; raises `CheckpointError` naming every missing key."""
    if with_mtp:
        raise CheckpointError("gpt-oss checkpoints have no MTP weights")
    with torch.device("meta"):
        names = [n for n, _ in Model(cfg).named_parameters()]
    params: dict[str, Callable[[], torch.Tensor]] = {}
    missing: list[str] = []
    for name in names:
        leaf = name.rsplit(".", 1)[-1]
        if name not in reader:
            missing.append(name)
        elif ".mlp.experts." in name and leaf in _EXPERTS:
            params[name] = _expert_loader(reader, name, leaf, cfg)
        else:
            params[name] = lambda s=name: reader.get(s)
    if missing:
        packed = [m for m in missing if m + "_blocks" in reader]
        hint = (f" ({packed[0]}_blocks is there: MXFP4 tensors, but config.json has no "
                "quantization_config with quant_method 'mxfp4')") if packed else ""
        more = f" (+{len(missing) - 12} more)" if len(missing) > 12 else ""
        raise CheckpointError(f"{reader.path}: gpt-oss tensors are missing: "
                              f"{', '.join(missing[:12])}{more}{hint}")
    return params


def params_to_checkpoint(state_dict: dict[str, torch.Tensor], cfg: Config
                         ) -> dict[str, torch.Tensor]:
    """Our state dict → transformers' full-precision layout (experts [E, H, 2I] interleaved,
    [E, I, H])."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("inv_freq"):
            continue
        if ".mlp.experts." in name and leaf.startswith("gate_up_proj"):
            half = t.shape[1] // 2  # gate rows first → interleaved (gate even, up odd)
            t = torch.stack((t[:, :half], t[:, half:]), 2).flatten(1, 2)
            t = t.transpose(1, 2) if leaf == "gate_up_proj" else t
        elif ".mlp.experts." in name and leaf == "down_proj":
            t = t.transpose(1, 2)
        out[name] = t.contiguous()
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def tiny_hf_config(mtp_layers: int = 0) -> dict:
    """A tiny `GptOssForCausalLM` config.json: 4 layers (sliding window 8, full, ...), 8 experts
    (top 2), GQA 4:2 of 16-wide heads, YaRN x4 over 128 positions (its ramp crosses the
    dims)."""
    if mtp_layers:
        raise ValueError("gpt-oss has no MTP layers")
    cfg = llama.tiny_hf_config()
    cfg.update(architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_hidden_layers=4,
               intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
               attention_bias=True, sliding_window=8, swiglu_limit=7.0,
               layer_types=["sliding_attention", "full_attention"] * 2,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                "original_max_position_embeddings": 128},
               router_aux_loss_coef=0.9, output_router_logits=False)
    del cfg["rope_theta"]
    return cfg


def make_tiny(out: str | Path, seed: int = 0, mtp_layers: int = 0, hf_config: dict | None = None
              ) -> Path:
    """A tiny random full-precision checkpoint (config, safetensors, tokenizer) in `out`."""
    from specdeploy.checkpoint.tiny import write_checkpoint, write_tiny_tokenizer

    hf = hf_config or tiny_hf_config(mtp_layers)
    cfg = Config.from_hf(hf)
    gen = torch.Generator().manual_seed(seed)
    model = Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):  # around the scores' size, so they matter
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    write_checkpoint(out, hf, params_to_checkpoint(model.state_dict(), cfg))
    write_tiny_tokenizer(out, cfg.vocab_size)
    return Path(out)


__all__ = ["ARCHITECTURES", "Config", "Model", "checkpoint_to_params", "make_tiny",
           "params_to_checkpoint", "tiny_hf_config"]
