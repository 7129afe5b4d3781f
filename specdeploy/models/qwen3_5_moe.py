"""Qwen3.5-MoE text model: gated full attention + gated delta net layers, sparse MoE, MTP head;
and the dense Qwen3.5 models (the same, with a SwiGLU MLP in place of the MoE block).

Serves the released vision-language layout (`model.language_model.*`, `model.visual.*` ignored,
`lm_head.*`, top-level `mtp.*`) and transformers' text-only layout (`model.*`). Experts load from
per-expert keys (`mlp.experts.{e}.{gate,up,down}_proj.weight`, what releases and
`save_pretrained` write) or fused 3-D tensors (`mlp.experts.gate_up_proj` [E,2I,H],
`mlp.experts.down_proj` [E,H,I], transformers' in-memory layout). The vision tower is
`models/qwen3_5_vision.py`; its features enter here as `inputs_embeds`, with [3,B,T] positions.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdeploy.checkpoint import CheckpointError, CheckpointReader, from_keys
from specdeploy.checkpoint.tiny import write_checkpoint
from specdeploy.models.drafters.qwen3_5_mtp import MTP
from specdeploy.models.layers import RMSNorm
from specdeploy.models.qwen3_5_blocks import Config, DecoderLayer
from specdeploy.models.qwen3_5_vision_tiny import tiny_visual, write_tiny_processor
from specdeploy.ops import rope_cos_sin

ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                 "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
__all__ = ["ARCHITECTURES", "MTP", "Config", "Model", "checkpoint_to_params", "make_tiny",
           "params_to_checkpoint", "tiny_hf_config"]

_VLM_PREFIX = "model.language_model."


class TextModel(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Model(nn.Module):
    """`forward(input_ids[B,T], position_ids[B,T] | [3,B,T] | None) -> logits[B,T,V]`."""

    def __init__(self, cfg: Config, with_mtp: bool = False):
        super().__init__()
        self.cfg = cfg
        self.model = TextModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", cfg.rope_inv_freq(), persistent=False)
        if with_mtp:
            self.mtp = MTP(cfg, self.model.embed_tokens, self.head)

    @property
    def head(self) -> nn.Module:
        """The LM head's weight holder (the embedding when tied)."""
        return self.model.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head

    def init_buffers(self) -> None:
        self.inv_freq = self.cfg.rope_inv_freq()
        if hasattr(self, "mtp"):
            self.mtp.init_buffers()

    def forward_hidden(
        self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [B,T,H] (the LM head's input and the MTP head's feature).
        `inputs_embeds` [B,T,H] (image features merged in) replaces the embedding of ids."""
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, t = x.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(t, device=x.device).expand(b, t)
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, self.cfg.mrope_section,
                                self.cfg.mrope_interleaved)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def forward(
        self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.forward_hidden(input_ids, position_ids, inputs_embeds)
        return F.linear(hidden, self.head.weight)


def _zero_centred(name: str) -> bool:
    """Every RMSNorm is stored as `1 + w` except the GDN gated output norm (plain weight)."""
    parts = name.split(".")
    return len(parts) > 1 and "norm" in parts[-2] and not name.endswith("linear_attn.norm.weight")


def _source_key(name: str, prefix: str) -> str:
    return prefix + name[len("model."):] if name.startswith("model.") else name


def checkpoint_to_params(
    reader: CheckpointReader, cfg: Config, with_mtp: bool = False
) -> dict[str, Callable[[], torch.Tensor]]:
    """Our parameter name → lazy tensor; raises `CheckpointError` naming missing checkpoint keys."""
    prefix = _VLM_PREFIX if reader.has_prefix(_VLM_PREFIX) else "model."
    with torch.device("meta"):
        names = list(Model(cfg, with_mtp=with_mtp).state_dict())
    params: dict[str, Callable[[], torch.Tensor]] = {}
    missing: list[str] = []
    fused = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    for name in names:
        src = _source_key(name, prefix)
        if name.endswith(fused) and src not in reader:
            params[name], lacking = _per_expert(reader, src, cfg.num_experts)
            missing += lacking
        elif src not in reader:
            missing.append(src)
        elif _zero_centred(name):
            params[name] = lambda s=src: reader.get(s).float() + 1.0
        else:
            params[name] = from_keys(lambda s=src: reader.get(s), src)
    if missing:
        only_mtp = all(m.startswith("mtp.") for m in missing)
        what = (f"MTP weights are missing (config mtp_num_hidden_layers="
                f"{cfg.mtp_num_hidden_layers})" if only_mtp else "tensors are missing")
        more = f" (+{len(missing) - 12} more)" if len(missing) > 12 else ""
        shown = ", ".join(missing[:12]) + more
        family = "Qwen3.5-MoE" if cfg.num_experts else "Qwen3.5"
        raise CheckpointError(f"{reader.path}: {family} {what}: {shown}")
    return params


def _per_expert(
    reader: CheckpointReader, fused_key: str, n_experts: int
) -> tuple[Callable[[], torch.Tensor], list[str]]:
    """Stack per-expert 2-D weights into the fused [E, 2I, H] (gate rows first) / [E, H, I]."""
    base, kind = fused_key.rsplit(".", 1)
    projs = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    keys = [[f"{base}.{e}.{p}.weight" for p in projs] for e in range(n_experts)]
    lacking = [k for row in keys for k in row if k not in reader]
    if lacking == [k for row in keys for k in row]:
        lacking = [f"{fused_key} (or per-expert {keys[0][0]} ...)"]

    def thunk() -> torch.Tensor:
        return torch.stack([torch.cat([reader.get(k) for k in row], dim=0) for row in keys])

    return from_keys(thunk, keys), lacking


def params_to_checkpoint(
    state_dict: dict[str, torch.Tensor], cfg: Config
) -> dict[str, torch.Tensor]:
    """Our state dict → the released VLM layout (per-expert keys, zero-centred norms)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        key = _source_key(name, _VLM_PREFIX)
        if _zero_centred(name):
            t = t.float().sub(1.0).to(t.dtype)
        out.update(per_expert_keys(key, t))
    return out


def per_expert_keys(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A fused expert tensor as the released per-expert keys (gate_up_proj [E, 2I, H]: gate
    rows first; down_proj [E, H, I]); any other tensor as it is."""
    if key.endswith("mlp.experts.gate_up_proj"):
        base, inter = key[: -len("gate_up_proj")], t.shape[1] // 2
        return {k: v for e in range(t.shape[0]) for k, v in (
            (f"{base}{e}.gate_proj.weight", t[e, :inter]), (f"{base}{e}.up_proj.weight",
                                                            t[e, inter:]))}
    if key.endswith("mlp.experts.down_proj"):
        base = key[: -len("down_proj")]
        return {f"{base}{e}.down_proj.weight": t[e] for e in range(t.shape[0])}
    return {key: t}


def tiny_hf_config(mtp_layers: int = 0, dense: bool = False) -> dict:
    """A tiny `Qwen3_5MoeForConditionalGeneration` config.json (text: 4 layers, 3 GDN + 1 full);
    `dense`: a `Qwen3_5ForConditionalGeneration` (a SwiGLU MLP of width 96 per layer)."""
    text = {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        # rotary dim = 32 * 0.25 = 8 → 4 frequency slots split 2/1/1 over (t, h, w)
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                            "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                            "mrope_interleaved": True},
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if mtp_layers:
        text.update(mtp_num_hidden_layers=mtp_layers, mtp_use_dedicated_embeddings=False)
    if dense:
        for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size"):
            del text[k]
        text.update(model_type="qwen3_5_text", intermediate_size=96)
    vision = {
        "model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 32, "intermediate_size": 64,
        "num_heads": 2, "in_channels": 3, "patch_size": 4, "temporal_patch_size": 2,
        "spatial_merge_size": 2, "out_hidden_size": 64, "num_position_embeddings": 16,
        "hidden_act": "gelu_pytorch_tanh",
    }
    if dense:
        vision["model_type"] = "qwen3_5_vision"
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration" if dense
                          else "Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5" if dense else "qwen3_5_moe",
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": False,
        "image_token_id": 126, "video_token_id": 127,
        "vision_start_token_id": 124, "vision_end_token_id": 125,
        "torch_dtype": "float32",
    }


def _random_init(model: nn.Module, gen: torch.Generator) -> None:
    """O(1) activations (fan-in scaled weights) and non-trivial norms, so tests compare real
    numbers rather than near-zero logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and "norm" in name.split(".")[-2]:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 8.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def make_tiny(out: str | Path, seed: int = 0, mtp_layers: int = 0, hf_config: dict | None = None
              ) -> Path:
    """Write a tiny random checkpoint in the released VLM layout (+ `mtp.*` when asked);
    `hf_config` replaces `tiny_hf_config(mtp_layers)`."""
    hf = hf_config or tiny_hf_config(mtp_layers)
    cfg = Config.from_hf(hf)
    gen = torch.Generator().manual_seed(seed)
    model = Model(cfg, with_mtp=mtp_layers > 0)
    _random_init(model, gen)
    tensors = params_to_checkpoint(model.state_dict(), cfg)
    tensors.update(tiny_visual(hf, gen))
    write_checkpoint(out, hf, tensors)
    write_tiny_processor(out, hf)
    return Path(out)
