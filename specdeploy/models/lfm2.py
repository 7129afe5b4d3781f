"""Liquid AI LFM2 (`Lfm2ForCausalLM`: LFM2-350M / 700M / 1.2B / 2.6B): each layer is a gated
short convolution (`conv`, "LIV": in_proj -> B, C, x; C * conv(B * x); out_proj, the conv a
depthwise causal one of `conv_L_cache` taps without activation) or GQA attention with per-head
q / k RMSNorms and RoPE (`full_attention`), then a SwiGLU feed-forward (w1 / w3 / w2); pre-norm
residual blocks (`operator_norm`, `ffn_norm`), the final norm named `embedding_norm`, tied
embeddings. Math and names as transformers' modeling_lfm2.py.

The short convolution is the canonical `causal_conv1d` op (activation "none"), so the cache
stage gives it the hybrids' conv state slot, spec states and rollback, unchanged.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdeploy.checkpoint import CheckpointError, CheckpointReader, from_keys
from specdeploy.models.layers import RMSNorm, RopeConfig, RotaryEmbedding
from specdeploy.ops.shard import Seg, heads, linear_col, linear_row, tp_param, tp_reduce, tp_split

ARCHITECTURES = ("Lfm2ForCausalLM",)
LAYER_TYPES = ("conv", "full_attention")
_ops = torch.ops.specdeploy


def ffn_width(hf: dict) -> int:
    """The SwiGLU width as transformers' Lfm2MLP computes it: `block_ff_dim` (released configs'
    name; it overrides `intermediate_size`), times 2/3 and the multiplier, rounded up to
    `block_multiple_of`, when `block_auto_adjust_ff_dim` (LFM2-350M: 6656 -> 4608)."""
    width = int(hf.get("block_ff_dim") or hf.get("intermediate_size") or 12288)
    if not hf.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    mult = hf.get("block_ffn_dim_multiplier", 1.0)
    if mult is not None:  # (None: transformers skips the multiplier and the rounding too)
        of = int(hf.get("block_multiple_of", 256))
        width = int(mult * width)
        width = of * ((width + of - 1) // of)
    return width


def _layer_types(hf: dict, n: int) -> tuple[str, ...]:
    """`layer_types`, else `full_attn_idxs` (absent: all attention, as transformers)."""
    types = hf.get("layer_types")
    if types is None:
        idxs = hf.get("full_attn_idxs")
        idxs = range(n) if idxs is None else idxs
        types = ["full_attention" if i in idxs else "conv" for i in range(n)]
    if len(types) < n:
        raise ValueError(f"LFM2: layer_types has {len(types)} entries for {n} layers")
    unknown = sorted(set(types[:n]) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"LFM2: layer types {unknown} are not supported; known: {LAYER_TYPES}")
    return tuple(types[:n])


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the effective SwiGLU width (`ffn_width`)
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "conv" | "full_attention" per layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    norm_eps: float
    rope: RopeConfig
    conv_L_cache: int = 3
    conv_bias: bool = False
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 128000

    @classmethod
    def from_hf(cls, hf: dict) -> Config:
        hf = hf.get("text_config") or hf
        n, h = int(hf["num_hidden_layers"]), int(hf["hidden_size"])
        heads_ = int(hf["num_attention_heads"])
        # transformers pops `tie_embedding` (released configs' name) over tie_word_embeddings
        tie = hf.get("tie_embedding", hf.get("tie_word_embeddings", True))
        return cls(
            vocab_size=int(hf["vocab_size"]), hidden_size=h, intermediate_size=ffn_width(hf),
            num_hidden_layers=n, layer_types=_layer_types(hf, n), num_attention_heads=heads_,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads_),
            head_dim=int(hf.get("head_dim") or h // heads_),
            norm_eps=float(hf.get("norm_eps", 1e-5)),
            rope=RopeConfig.from_hf(hf, default_theta=1e6),
            conv_L_cache=int(hf.get("conv_L_cache", 3)),
            conv_bias=bool(hf.get("conv_bias", False)), tie_word_embeddings=bool(tie),
            max_position_embeddings=int(hf.get("max_position_embeddings", 128000)))


class ShortConv(nn.Module):
    """`out_proj(C * conv(B * x))`, (B, C, x) = in_proj(h) split in thirds; the conv is
    depthwise and causal, so the three thirds shard by the same channels."""

    def __init__(self, cfg: Config):
        super().__init__()
        h, bias = cfg.hidden_size, cfg.conv_bias
        # an nn.Conv1d only for the checkpoint's [H, 1, L] weight; the math is the canonical op
        self.conv = nn.Conv1d(h, h, cfg.conv_L_cache, groups=h, bias=bias)
        self.in_proj = nn.Linear(h, 3 * h, bias=bias)
        self.out_proj = nn.Linear(h, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = [Seg(self.out_proj.in_features)]
        b, c, xs = tp_split(linear_col(self.in_proj, x, "ssm", s * 3), "ssm", [s, s, s])
        w, bias = (None if p is None else tp_param(p, "ssm", "colwise", 0, s)
                   for p in (self.conv.weight, self.conv.bias))
        y, _ = _ops.causal_conv1d(b * xs, w.squeeze(1), bias, None, "none")
        return tp_reduce(linear_row(self.out_proj, c * y, "ssm", s), "ssm")


class Attention(nn.Module):
    """Causal GQA; RMSNorm over each q / k head (`q_layernorm`, `k_layernorm`) before RoPE."""

    def __init__(self, cfg: Config):
        super().__init__()
        h, d, hq, hkv = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                         cfg.num_key_value_heads)
        self.head_dim, self.heads = d, (hq, hkv)
        self.q_proj = nn.Linear(h, hq * d, bias=False)
        self.k_proj = nn.Linear(h, hkv * d, bias=False)
        self.v_proj = nn.Linear(h, hkv * d, bias=False)
        self.out_proj = nn.Linear(hq * d, h, bias=False)
        self.q_layernorm = RMSNorm(d, cfg.norm_eps)  # (one weight per head dim: replicated)
        self.k_layernorm = RMSNorm(d, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape, (hq, hkv), d = (*x.shape[:2], -1, self.head_dim), self.heads, self.head_dim
        q, k, v = (linear_col(p, x, "mha", [s]).view(shape) for p, s in (
            (self.q_proj, heads(hq, d)), (self.k_proj, heads(hkv, d, hq)),
            (self.v_proj, heads(hkv, d, hq))))
        q = _ops.rope(self.q_layernorm(q), cos, sin)
        k = _ops.rope(self.k_layernorm(k), cos, sin)
        o = _ops.attention(q, k, v, d**-0.5, 0)
        return tp_reduce(linear_row(self.out_proj, o.flatten(2), "mha", [heads(hq, d)]), "mha")


class FeedForward(nn.Module):
    """SwiGLU `w2(silu(w1(x)) * w3(x))` (Llama's MLP under LFM2's names)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(linear_col(self.w1, x, "mlp")) * linear_col(self.w3, x, "mlp")
        return tp_reduce(linear_row(self.w2, h, "mlp"), "mlp")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, kind: str):
        super().__init__()
        self.kind = kind
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if kind == "conv":
            self.conv = ShortConv(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.operator_norm(x)
        x = x + (self.conv(h) if self.kind == "conv" else self.self_attn(h, cos, sin))
        return x + self.feed_forward(self.ffn_norm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        # (`_weight` skips the meta-device init; every weight comes from the checkpoint)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, k) for k in cfg.layer_types)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.head_dim)
        self.embedding_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)  # the *final* norm


class Model(nn.Module):
    """`forward(input_ids[B,T], position_ids?) -> logits[B,T,V]`."""

    def __init__(self, cfg: Config, with_mtp: bool = False):
        super().__init__()
        if with_mtp:
            raise ValueError("LFM2 checkpoints have no MTP head; use an EAGLE-3 drafter or "
                             "n-gram lookup")
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._tie()

    def _tie(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_buffers(self) -> None:
        self.model.rotary_emb.init_buffers()
        self._tie()

    def forward_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
                       ) -> torch.Tensor:
        if position_ids is None:
            t = input_ids.shape[1]
            position_ids = torch.arange(t, device=input_ids.device).expand(input_ids.shape[0], t)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(position_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.embedding_norm(x)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        return self.lm_head(self.forward_hidden(input_ids, position_ids))


def checkpoint_to_params(reader: CheckpointReader, cfg: Config, with_mtp: bool = False
                         ) -> dict[str, Callable[[], torch.Tensor]]:
    """Our names are the checkpoint's (transformers' `Lfm2ForCausalLM`); raises
    `CheckpointError` naming every missing tensor."""
    if with_mtp:
        raise CheckpointError("LFM2 checkpoints have no MTP weights")
    with torch.device("meta"):
        names = [n for n, _ in Model(cfg).named_parameters()]  # (a tied head appears once)
    params = {n: from_keys(lambda n=n: reader.get(n), n) for n in names if n in reader}
    missing = [n for n in names if n not in params]
    if missing:
        more = f" (+{len(missing) - 12} more)" if len(missing) > 12 else ""
        raise CheckpointError(f"{reader.path}: LFM2 tensors are missing: "
                              f"{', '.join(missing[:12])}{more}")
    return params


def params_to_checkpoint(state_dict: dict[str, torch.Tensor], cfg: Config
                         ) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in state_dict.items() if not k.endswith("inv_freq")}
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def tiny_hf_config(mtp_layers: int = 0) -> dict:
    """A tiny `Lfm2ForCausalLM` config.json: 6 layers (conv, conv, attention, conv, attention,
    conv), GQA 4:2 of head_dim 16, conv kernel 3; `block_ff_dim` 96 auto-adjusted to
    int(2 * 96 / 3) = 64 times 1.5 = 96, rounded up to 80's multiple: 160 (so a model that
    skipped the adjustment would not load its own w1)."""
    if mtp_layers:
        raise ValueError("LFM2 has no MTP layers")
    return {
        "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": 128,
        "hidden_size": 64, "intermediate_size": 96, "block_ff_dim": 96,
        "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.5,
        "block_multiple_of": 80, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "layer_types": ["conv", "conv", "full_attention", "conv",
                                                  "full_attention", "conv"],
        "conv_L_cache": 3, "conv_bias": False, "norm_eps": 1e-5, "rope_theta": 1e6,
        "max_position_embeddings": 512, "tie_embedding": True, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
    }


def make_tiny(out: str | Path, seed: int = 0, mtp_layers: int = 0,
              hf_config: dict | None = None) -> Path:
    from specdeploy.checkpoint.tiny import write_checkpoint, write_tiny_tokenizer

    hf = hf_config or tiny_hf_config(mtp_layers)
    cfg = Config.from_hf(hf)
    gen = torch.Generator().manual_seed(seed)
    model = Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not all-ones, so a mis-mapped norm shows up
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            else:  # (the conv's [H, 1, L]: fan-in L)
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    write_checkpoint(out, hf, params_to_checkpoint(model.state_dict(), cfg))
    write_tiny_tokenizer(out, cfg.vocab_size)
    return Path(out)


__all__ = ["ARCHITECTURES", "Config", "Model", "checkpoint_to_params", "ffn_width", "make_tiny",
           "params_to_checkpoint", "tiny_hf_config"]
