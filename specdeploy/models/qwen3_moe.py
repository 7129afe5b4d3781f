"""Qwen3-MoE (`Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B): Qwen3's attention (the Llama module's,
with per-head q/k norms) and a softmax top-k routed SwiGLU MoE without a shared expert (dense
MLPs on `mlp_only_layers` and off the `decoder_sparse_step`). Qwen2-MoE (`Qwen2MoeForCausalLM`,
Qwen1.5-MoE / Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) and the same MoE with a
sigmoid-gated shared expert (`mlp.shared_expert`, `mlp.shared_expert_gate`), top-k weights not
renormalized unless `norm_topk_prob`.

Names follow transformers' `modeling_qwen3_moe.py`; the MoE block is Qwen3.5-MoE's
(models/qwen3_5_blocks.py) without its shared expert. Experts load from per-expert keys
(`mlp.experts.{e}.{gate,up,down}_proj.weight`, what releases write) or transformers' fused 3-D
tensors (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdeploy.checkpoint import CheckpointError, CheckpointReader, from_keys
from specdeploy.models import llama
from specdeploy.models.qwen3_5_blocks import SparseMoeBlock

ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")


@dataclass(frozen=True)
class Config(llama.Config):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's (qwen3_5_blocks.SparseMoeBlock)

    @classmethod
    def from_hf(cls, hf: dict) -> Config:
        hf = hf.get("text_config") or hf
        # Qwen3: q/k norms, no biases; Qwen2-MoE: q/k/v biases (`qkv_bias`), no norms
        qwen2 = hf.get("model_type") == "qwen2_moe"
        base = llama.Config.from_hf({**hf, "model_type": "qwen2" if qwen2 else "qwen3"})
        fields = {**base.__dict__, "qkv_bias": bool(hf.get("qkv_bias", True))} if qwen2 else \
            base.__dict__
        return cls(**fields, num_experts=int(hf["num_experts"]),
                   num_experts_per_tok=int(hf["num_experts_per_tok"]),
                   moe_intermediate_size=int(hf["moe_intermediate_size"]),
                   # (transformers' Qwen2-MoE default: not renormalized)
                   norm_topk_prob=bool(hf.get("norm_topk_prob", not qwen2)),
                   shared_expert_intermediate_size=int(
                       hf.get("shared_expert_intermediate_size") or 0) if qwen2 else 0,
                   decoder_sparse_step=int(hf.get("decoder_sparse_step", 1) or 1),
                   mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    def sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


class DecoderLayer(llama.DecoderLayer):
    """Llama's layer (Qwen3's attention) with the routed experts where the layer is sparse."""

    def __init__(self, cfg: Config, index: int):
        super().__init__(cfg, index)
        if cfg.sparse(index):
            self.mlp = SparseMoeBlock(cfg)


class Model(llama.Model):
    """`forward(input_ids[B,T], position_ids?) -> logits[B,T,V]` (llama.Model's, other layers)."""

    @staticmethod
    def layer_factory(cfg: Config):
        return lambda i: DecoderLayer(cfg, i)


def checkpoint_to_params(reader: CheckpointReader, cfg: Config, with_mtp: bool = False
                         ) -> dict[str, Callable[[], torch.Tensor]]:
    """Our parameter name → lazy tensor; raises `CheckpointError` naming missing keys."""
    from specdeploy.models.qwen3_5_moe import _per_expert

    if with_mtp:
        raise CheckpointError("Qwen3-MoE checkpoints have no MTP weights")
    with torch.device("meta"):
        names = [n for n, _ in Model(cfg).named_parameters()]
    params: dict[str, Callable[[], torch.Tensor]] = {}
    missing: list[str] = []
    for name in names:
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) \
                and name not in reader:
            params[name], lacking = _per_expert(reader, name, cfg.num_experts)
            missing += lacking
        elif name in reader:
            params[name] = from_keys(lambda s=name: reader.get(s), name)
        else:
            missing.append(name)
    if missing:
        more = f" (+{len(missing) - 12} more)" if len(missing) > 12 else ""
        family = "Qwen2-MoE" if cfg.qkv_bias else "Qwen3-MoE"
        raise CheckpointError(f"{reader.path}: {family} tensors are missing: "
                              f"{', '.join(missing[:12])}{more}")
    return params


def params_to_checkpoint(state_dict: dict[str, torch.Tensor], cfg: Config
                         ) -> dict[str, torch.Tensor]:
    """Our state dict → the released layout (per-expert keys; the tied head not stored)."""
    from specdeploy.models.qwen3_5_moe import per_expert_keys

    out: dict[str, torch.Tensor] = {}
    for key, t in state_dict.items():
        if not key.endswith("rotary_emb.inv_freq"):
            out.update(per_expert_keys(key, t))
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def tiny_hf_config(mtp_layers: int = 0, **overrides) -> dict:
    """A tiny `Qwen3MoeForCausalLM` config.json (3 layers: the middle one a dense MLP)."""
    if mtp_layers:
        raise ValueError("Qwen3-MoE has no MTP layers")
    cfg = llama.tiny_hf_config(**llama.tiny_qwen_config("qwen3"))
    cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
               num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
               mlp_only_layers=[1], intermediate_size=96)
    cfg.update(overrides)
    return cfg


def make_tiny(out: str | Path, seed: int = 0, mtp_layers: int = 0, *,
              config_overrides: dict | None = None) -> Path:
    from specdeploy.checkpoint.tiny import write_checkpoint, write_tiny_tokenizer

    hf = tiny_hf_config(mtp_layers, **(config_overrides or {}))
    cfg = Config.from_hf(hf)
    gen = torch.Generator().manual_seed(seed)
    model = Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    path = write_checkpoint(out, hf, params_to_checkpoint(model.state_dict(), cfg))
    write_tiny_tokenizer(path, cfg.vocab_size)
    return path


__all__ = ["ARCHITECTURES", "Config", "Model", "checkpoint_to_params", "make_tiny",
           "params_to_checkpoint", "tiny_hf_config"]
