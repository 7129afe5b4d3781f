"""Qwen3-VL (`Qwen3VLForConditionalGeneration`, 2B-32B) and Qwen3-VL-MoE
(`Qwen3VLMoeForConditionalGeneration`, 30B-A3B / 235B-A22B): the language model.

Text: Qwen3's layers (the Llama module's attention with per-head q/k norms; Qwen3-MoE's routed
experts in the MoE models, always renormalized) under interleaved multimodal RoPE over the whole
head. DeepStack: the vision tower's features taken after a few of its blocks
(`deepstack_visual_indexes`) are added to the outputs of the first as many decoder layers at the
vision tokens. They arrive with the input embeddings: a VLM's graph takes `inputs_embeds` of
width (1 + levels) * H (deploy/vlm.py writes the token embedding, then each level's feature, zero
off the vision tokens), as llama.cpp's qwen3vl graph does, so the exported program keeps its
three inputs and every runner (CPU / CUDA graphs, tensor-parallel ranks) passes it unchanged.

Names follow the released layout (`model.language_model.*`, `model.visual.*`, `lm_head.*`);
Qwen3-VL-MoE releases store experts fused and transposed (`mlp.experts.gate_up_proj`
[E, H, 2I], `mlp.experts.down_proj` [E, I, H], what transformers' loader transposes); per-expert
keys load too.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdeploy.checkpoint import CheckpointError, CheckpointReader, from_keys
from specdeploy.models import llama, qwen3_moe
from specdeploy.ops import rope_cos_sin

ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
_PREFIX = "model.language_model."


@dataclass(frozen=True)
class Config(qwen3_moe.Config):
    mrope_section: tuple[int, ...] = (24, 20, 20)
    mrope_interleaved: bool = True
    deepstack_layers: int = 0  # decoder layers 0..n-1 take a DeepStack level each

    @classmethod
    def from_hf(cls, hf: dict) -> Config:
        text = hf.get("text_config") or hf
        rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
        section = tuple(int(s) for s in rope.get("mrope_section") or ())
        if len(section) != 3:
            raise ValueError(f"Qwen3-VL: rope mrope_section {list(section)} is not 3 sections")
        base = llama.Config.from_hf({**text, "model_type": "qwen3"})
        if 2 * sum(section) != base.head_dim:
            raise ValueError(f"Qwen3-VL: mrope_section {list(section)} does not cover head_dim "
                             f"{base.head_dim}")
        moe = int(text.get("num_experts") or 0)
        tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        fields = {**base.__dict__, "tie_word_embeddings": bool(tie)}
        vision = hf.get("vision_config")
        # a text GGUF (checkpoint/gguf_qwen.py) says how many levels without its tower
        levels = len(vision.get("deepstack_visual_indexes") or ()) if vision is not None else \
            int(text.get("num_deepstack_layers", 0))
        return cls(**fields, num_experts=moe,
                   num_experts_per_tok=int(text.get("num_experts_per_tok") or 0) if moe else 0,
                   moe_intermediate_size=int(text.get("moe_intermediate_size") or 0) if moe else 0,
                   norm_topk_prob=True, decoder_sparse_step=int(text.get("decoder_sparse_step")
                                                                or 1),
                   mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
                   mrope_section=section,
                   mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
                   deepstack_layers=levels)


class Model(qwen3_moe.Model):
    """`forward(input_ids[B,T] | None, position_ids[B,T] | [3,B,T] | None,
    inputs_embeds[B,T,(1+levels)*H] | None) -> logits[B,T,V]`."""

    @property
    def embeds_width(self) -> int:
        """The width of a VLM graph's embeddings input (the token's, then each level's)."""
        return self.cfg.hidden_size * (1 + self.cfg.deepstack_layers)

    def forward_hidden(self, input_ids: torch.Tensor | None,
                       position_ids: torch.Tensor | None = None,
                       inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.cfg.hidden_size
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds[..., :h]
        deep = None if inputs_embeds is None or inputs_embeds.shape[-1] == h else \
            inputs_embeds[..., h:]
        b, t = x.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(t, device=x.device).expand(b, t)
        cos, sin = rope_cos_sin(position_ids, self.model.rotary_emb.inv_freq,
                                self.cfg.mrope_section, self.cfg.mrope_interleaved)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin)
            if deep is not None and i < self.cfg.deepstack_layers:
                x = x + deep[..., i * h:(i + 1) * h]
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.forward_hidden(input_ids, position_ids, inputs_embeds))


def checkpoint_to_params(reader: CheckpointReader, cfg: Config, with_mtp: bool = False
                         ) -> dict[str, Callable[[], torch.Tensor]]:
    """Our parameter name → lazy tensor; raises `CheckpointError` naming missing keys."""
    from specdeploy.models.qwen3_5_moe import _per_expert

    if with_mtp:
        raise CheckpointError("Qwen3-VL checkpoints have no MTP weights")
    prefix = _PREFIX if reader.has_prefix(_PREFIX) else "model."
    gguf = getattr(reader, "tensor_infos", None) is not None
    with torch.device("meta"):
        names = [n for n, _ in Model(cfg).named_parameters()]
    params: dict[str, Callable[[], torch.Tensor]] = {}
    missing: list[str] = []
    for name in names:
        src = prefix + name[len("model."):] if name.startswith("model.") else name
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            if src in reader and gguf:  # the GGUF reader joins them in our layout (blocks too)
                params[name] = from_keys(lambda s=src: reader.get(s), src)
            elif src in reader and any(k.startswith(f"{src}_") for k in reader.keys()):
                raise CheckpointError(f"{reader.path}: {src} is quantized in the fused, "
                                      "transposed layout, which is not supported (per-expert "
                                      "quantized keys are)")
            elif src in reader:  # released: [E, H, 2I] / [E, I, H]
                params[name] = lambda s=src: reader.get(s).transpose(1, 2).contiguous()
            else:
                params[name], lacking = _per_expert(reader, src, cfg.num_experts)
                missing += lacking
        elif src in reader:
            params[name] = from_keys(lambda s=src: reader.get(s), src)
        else:
            missing.append(src)
    if missing:
        more = f" (+{len(missing) - 12} more)" if len(missing) > 12 else ""
        raise CheckpointError(f"{reader.path}: Qwen3-VL tensors are missing: "
                              f"{', '.join(missing[:12])}{more}")
    return params


def params_to_checkpoint(state_dict: dict[str, torch.Tensor], cfg: Config,
                         per_expert: bool = False) -> dict[str, torch.Tensor]:
    """Our state dict → the released layout (fused experts transposed, or `per_expert` keys as
    FP8 releases write them; the tied head not stored)."""
    from specdeploy.models.qwen3_5_moe import per_expert_keys

    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        key = _PREFIX + name[len("model."):] if name.startswith("model.") else name
        if per_expert:
            out.update(per_expert_keys(key, t))
            continue
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            t = t.transpose(1, 2).contiguous()
        out[key] = t
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def tiny_hf_config(mtp_layers: int = 0, moe: bool = False) -> dict:
    """A tiny Qwen3-VL config.json (3 text layers, 2 DeepStack levels from a 3-block tower);
    `moe`: Qwen3-VL-MoE (the middle layer a dense MLP)."""
    if mtp_layers:
        raise ValueError("Qwen3-VL has no MTP layers")
    text = {
        "model_type": "qwen3_vl_moe_text" if moe else "qwen3_vl_text", "vocab_size": 128,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "attention_bias": False, "tie_word_embeddings": False,
        # 8 frequency slots: 4 / 2 / 2 over (t, h, w), interleaved
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                            "mrope_section": [4, 2, 2], "mrope_interleaved": True},
        "eos_token_id": 2, "pad_token_id": 0,
    }
    if moe:
        # 2I != H: the stored [E, H, 2I] is told from [E, 2I, H] by its shape
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                    decoder_sparse_step=1, mlp_only_layers=[1])
    vision = {
        "model_type": "qwen3_vl_moe_vision" if moe else "qwen3_vl_vision", "depth": 3,
        "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_channels": 3,
        "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2,
        "out_hidden_size": 64, "num_position_embeddings": 16,
        "hidden_act": "gelu_pytorch_tanh", "deepstack_visual_indexes": [0, 1],
    }
    return {
        "architectures": ["Qwen3VLMoeForConditionalGeneration" if moe
                          else "Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl_moe" if moe else "qwen3_vl", "text_config": text,
        "vision_config": vision, "tie_word_embeddings": False,
        "image_token_id": 126, "video_token_id": 127,
        "vision_start_token_id": 124, "vision_end_token_id": 125, "torch_dtype": "float32",
    }


def make_tiny(out: str | Path, seed: int = 0, mtp_layers: int = 0, moe: bool = False,
              text_overrides: dict | None = None, per_expert: bool = False) -> Path:
    """A tiny random checkpoint in the released layout (tower, processor and tokenizer too);
    `text_overrides` update its text config; `per_expert`: experts under per-expert keys."""
    hf = tiny_hf_config(mtp_layers, moe=moe)
    hf["text_config"].update(text_overrides or {})
    return make_tiny_from(out, hf, seed, per_expert)


def make_tiny_from(out: str | Path, hf: dict, seed: int = 0, per_expert: bool = False) -> Path:
    """`make_tiny` of a given config.json (benches size it up)."""
    from specdeploy.checkpoint.tiny import write_checkpoint
    from specdeploy.models.qwen3_5_vision_tiny import tiny_visual, write_tiny_processor

    cfg = Config.from_hf(hf)
    gen = torch.Generator().manual_seed(seed)
    model = Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    tensors = params_to_checkpoint(model.state_dict(), cfg, per_expert)
    tensors.update(tiny_visual(hf, gen))
    write_checkpoint(out, hf, tensors)
    write_tiny_processor(out, hf)
    return Path(out)


__all__ = ["ARCHITECTURES", "Config", "Model", "checkpoint_to_params", "make_tiny",
           "make_tiny_from", "params_to_checkpoint", "tiny_hf_config"]
