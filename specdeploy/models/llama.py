"""Llama family (Llama 2/3, SmolLM2, Mistral; Qwen2 and Qwen3, which differ only in q/k/v biases
and per-head q/k RMSNorms; SmolLM3, whose every 4th layer has no RoPE): plain full-sequence
model on canonical ops. Sliding-window attention
(Mistral's `sliding_window`, Qwen2 / Qwen3's `use_sliding_window` from `max_window_layers` on, or
transformers' `layer_types`) is a per-layer window on the attention op (ops/attention.py).

Submodule names follow HF `LlamaForCausalLM` (`model.layers.N.self_attn.q_proj`, ...;
`self_attn.q_norm` / `k_norm` for Qwen3), so a released checkpoint maps onto the parameters one
to one.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from specdeploy.checkpoint import CheckpointError
from specdeploy.models.layers import MLP, RMSNorm, RotaryEmbedding
from specdeploy.models.llama_config import Config
from specdeploy.ops.shard import heads, linear_col, linear_row, tp_reduce

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "SmolLM3ForCausalLM")


class Attention(nn.Module):
    """Causal GQA self-attention with rotate-half RoPE. `in_features` lets an EAGLE-3 midlayer
    (input 2H) reuse it."""

    def __init__(self, cfg: Config, in_features: int | None = None, window: int = 0,
                 rope: bool = True):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.window, self.rope = window, rope
        in_features = in_features or h
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, d)
        self.scale = d**-0.5
        bias = cfg.attention_bias
        qkv = bias or cfg.qkv_bias
        self.q_proj = nn.Linear(in_features, self.num_heads * d, bias=qkv)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * d, bias=qkv)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * d, bias=qkv)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        if cfg.qk_norm:  # (replicated over TP ranks: one weight per head dimension)
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        (b, t, _), d, hq = x.shape, self.head_dim, self.num_heads
        # sharding hints: heads split over ranks (-1 views follow), KV heads serve the q heads
        q = linear_col(self.q_proj, x, "mha", [heads(hq, d)]).view(b, t, -1, d)
        k = linear_col(self.k_proj, x, "mha", [heads(self.num_kv_heads, d, hq)]).view(b, t, -1, d)
        v = linear_col(self.v_proj, x, "mha", [heads(self.num_kv_heads, d, hq)]).view(b, t, -1, d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q = torch.ops.specdeploy.rope(q, cos, sin)
            k = torch.ops.specdeploy.rope(k, cos, sin)
        o = torch.ops.specdeploy.attention(q, k, v, self.scale, self.window)
        return tp_reduce(linear_row(self.o_proj, o.reshape(b, t, -1), "mha", [heads(hq, d)]),
                         "mha")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window=cfg.window(index), rope=cfg.rope_at(index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: Config, layer=None):
        """`layer(i)`: decoder layer i (default: this module's; Qwen3-MoE's routed ones)."""
        super().__init__()
        # NOTE: `_weight` skips normal_() init, which on the meta device imports torch._dynamo
        # (seconds); every weight comes from the checkpoint anyway.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        layer = layer or (lambda i: DecoderLayer(cfg, i))
        self.layers = nn.ModuleList(layer(i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # (partial RoPE: GLM-4.5 rotates the first half of each head; the rope op passes the rest)
        self.rotary_emb = RotaryEmbedding(cfg.rope, getattr(cfg, "rotary_dim", cfg.head_dim))


class Model(nn.Module):
    """`LlamaForCausalLM` without caches: `forward(input_ids[B,T], position_ids?) -> logits`."""

    def __init__(self, cfg: Config, with_mtp: bool = False):
        super().__init__()
        if with_mtp:
            raise ValueError(f"{type(self).__module__.rsplit('.', 1)[-1]} checkpoints have no "
                             "MTP head; use an EAGLE-3 drafter instead")
        self.cfg = cfg
        self.model = Backbone(cfg, self.layer_factory(cfg))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._tie()

    @staticmethod
    def layer_factory(cfg: Config):
        """`i -> decoder layer i` for `Backbone`; None: Llama's (subclasses override)."""
        return None

    def _tie(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_buffers(self) -> None:
        """Called by the loader after the parameters are assigned: rebuild rotary inv_freq and
        re-tie the head (assignment replaces the embedding Parameter)."""
        self.model.rotary_emb.init_buffers()
        self._tie()

    def forward_hidden(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final-normed hidden states [B, T, H]."""
        if position_ids is None:
            t = input_ids.shape[1]
            position_ids = torch.arange(t, device=input_ids.device).expand(input_ids.shape[0], t)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(position_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.lm_head(self.forward_hidden(input_ids, position_ids))


def _backbone_prefix(reader) -> str:
    for prefix in ("model.", "model.language_model.", ""):
        if f"{prefix}embed_tokens.weight" in reader:
            return prefix
    return "model."


def checkpoint_to_params(reader, cfg: Config, with_mtp: bool = False
                         ) -> dict[str, Callable[[], torch.Tensor]]:
    """Our parameter name → lazy loader. Names absent from the checkpoint are left out so the
    loader can list every missing tensor at once."""
    if with_mtp:
        raise CheckpointError("Llama checkpoints have no MTP weights")
    prefix = _backbone_prefix(reader)
    with torch.device("meta"):
        names = [n for n, _ in Model(cfg).named_parameters()]  # tied head appears once
    params: dict[str, Callable[[], torch.Tensor]] = {}
    for name in names:
        src = prefix + name[len("model."):] if name.startswith("model.") else name
        if src in reader:
            params[name] = lambda src=src: reader.get(src)
    return params


def params_to_checkpoint(state_dict: dict[str, torch.Tensor], cfg: Config
                         ) -> dict[str, torch.Tensor]:
    """HF layout: identical names; the tied head is not stored (transformers re-ties it)."""
    out = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def tiny_hf_config(mtp_layers: int = 0, **overrides) -> dict:
    """config.json of a tiny Llama (GQA 4:2, head_dim 16) that transformers loads;
    `model_type="qwen2"` / `"qwen3"` (with the matching `architectures`) in `overrides`: a tiny
    Qwen2 / Qwen3 (see `tiny_qwen_config`)."""
    if mtp_layers:
        raise ValueError("Llama has no MTP layers")
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
        "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": None, "eos_token_id": 2,
        "pad_token_id": 0, "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def tiny_qwen_config(kind: str) -> dict:
    """`tiny_hf_config` overrides of a tiny Qwen2 ("qwen2") or Qwen3 ("qwen3")."""
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[kind]
    return {"architectures": [arch], "model_type": kind, "rope_theta": 1e6,
            "use_sliding_window": False, "max_window_layers": 2}


def make_tiny(out: str | Path, seed: int = 0, mtp_layers: int = 0, *,
              config_overrides: dict | None = None, max_shard_bytes: int = 0) -> Path:
    """Write a random tiny Llama checkpoint (config, safetensors, tokenizer) to `out`."""
    from specdeploy.checkpoint.tiny import write_checkpoint, write_tiny_tokenizer

    hf = tiny_hf_config(mtp_layers, **(config_overrides or {}))
    cfg = Config.from_hf(hf)
    gen = torch.Generator().manual_seed(seed)
    model = Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not all-ones, so a mis-mapped norm shows up
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    tensors = params_to_checkpoint(model.state_dict(), cfg)
    path = write_checkpoint(out, hf, tensors, max_shard_bytes=max_shard_bytes)
    write_tiny_tokenizer(path, cfg.vocab_size)
    return path
