"""GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`, e.g. GLM-4.5-Air): Llama-style attention with q/k/v
biases, optional per-head q/k norms and RoPE on the first `partial_rotary_factor` of each head;
`first_k_dense_replace` dense SwiGLU layers, then MoE layers: DeepSeek-V3-style sigmoid routing
(`e_score_correction_bias` steers selection, group-limited, renormalized, scaled) over SwiGLU
experts plus a shared expert; and the checkpoint's MTP layer(s) (models/drafters/glm4_moe_mtp.py),
stored as the trailing decoder layers `model.layers.{num_hidden_layers + j}`.

Names follow transformers' `modeling_glm4_moe.py`; experts load from per-expert keys (what the
releases store) or transformers' fused tensors.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdeploy.checkpoint import CheckpointError, CheckpointReader, from_keys
from specdeploy.models import llama
from specdeploy.models.layers import MLP
from specdeploy.models.qwen3_5_blocks import Experts
from specdeploy.ops import Routing, route_sigmoid
from specdeploy.ops.shard import Seg, tp_param, tp_reduce

ARCHITECTURES = ("Glm4MoeForCausalLM",)
_ops = torch.ops.specdeploy


@dataclass(frozen=True)
class Config(llama.Config):
    partial_rotary_factor: float = 0.5
    num_experts: int = 0  # (n_routed_experts)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0

    @classmethod
    def from_hf(cls, hf: dict) -> Config:
        hf = hf.get("text_config") or hf
        base = llama.Config.from_hf({**hf, "model_type": "glm4_moe", "attention_bias": False})
        rope = hf.get("rope_parameters") or {}
        fields = {**base.__dict__, "qkv_bias": bool(hf.get("attention_bias", False)),
                  "qk_norm": bool(hf.get("use_qk_norm", False))}
        mtp = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))
        return cls(**fields, partial_rotary_factor=float(rope.get(
                       "partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))),
                   num_experts=int(hf.get("n_routed_experts") or hf.get("num_local_experts")
                                   or 0),
                   num_experts_per_tok=int(hf["num_experts_per_tok"]),
                   moe_intermediate_size=int(hf["moe_intermediate_size"]),
                   n_shared_experts=int(hf.get("n_shared_experts", 1) or 0),
                   first_k_dense_replace=int(hf.get("first_k_dense_replace", 1)),
                   n_group=int(hf.get("n_group", 1) or 1),
                   topk_group=int(hf.get("topk_group", 1) or 1),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                   routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                   num_nextn_predict_layers=int(mtp or 0))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def sparse(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_k_dense_replace


class MoE(nn.Module):
    """Sigmoid-routed SwiGLU experts (fused [E, 2I, H] / [E, H, I]) plus the shared expert."""

    correction_bias = True  # (DeepSeek-V2's softmax routing has none)

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        if self.correction_bias:
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size,
                                  cfg.moe_intermediate_size * cfg.n_shared_experts)

    def route(self, logits: torch.Tensor) -> Routing:
        """Router logits [N, E] (fp32) → the experts and weights of each row."""
        c = self.cfg
        return route_sigmoid(logits, self.gate.e_score_correction_bias, c.num_experts_per_tok,
                             c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        # NOTE: routing in fp32 whatever the model dtype (as transformers and the releases)
        r = self.route(F.linear(flat.float(), self.gate.weight.float()))
        # sharding hints: experts over EP ranks, each expert's width ([gate | up]) over TP ranks
        i = self.experts.down_proj.shape[-1]
        w_up = tp_param(self.experts.gate_up_proj, "moe", "expert_colwise", 1, [Seg(i), Seg(i)])
        w_down = tp_param(self.experts.down_proj, "moe", "expert_rowwise", 2, [Seg(i)])
        y = _ops.moe_experts(flat, r.ids, r.weights.to(flat.dtype), w_up, w_down, "swiglu")
        return tp_reduce(y, "moe").view(x.shape) + self.shared_experts(x)


class DecoderLayer(llama.DecoderLayer):
    """Llama's layer (GLM's attention via the config) with the MoE past the dense layers."""

    def __init__(self, cfg: Config, index: int):
        super().__init__(cfg, index)
        if cfg.sparse(index):
            self.mlp = MoE(cfg)


class Model(llama.Model):
    """`forward(input_ids[B,T], position_ids?) -> logits`; `with_mtp`: the checkpoint's MTP
    layers as `self.mtp` (a drafter)."""

    decoder_layer = DecoderLayer  # (DeepSeek-V3's module swaps in its MLA layer)

    def __init__(self, cfg: Config, with_mtp: bool = False):
        super().__init__(cfg)
        if with_mtp:
            from specdeploy.models.drafters.glm4_moe_mtp import MTP

            self.mtp = MTP(cfg, self.model.embed_tokens, self.lm_head, self.decoder_layer)

    @classmethod
    def layer_factory(cls, cfg: Config):
        return lambda i: cls.decoder_layer(cfg, i)

    def init_buffers(self) -> None:
        super().init_buffers()
        if hasattr(self, "mtp"):
            self.mtp.init_buffers()


def _source(name: str, n_layers: int) -> str:
    """Our parameter name → the checkpoint key (MTP layer j is decoder layer n + j there)."""
    if name.startswith("mtp.layers."):
        j, rest = name[len("mtp.layers."):].split(".", 1)
        return f"model.layers.{n_layers + int(j)}.{rest}"
    return name


def checkpoint_to_params(reader: CheckpointReader, cfg: Config, with_mtp: bool = False, *,
                         model_cls: type[Model] | None = None, family: str = "GLM-4.5"
                         ) -> dict[str, Callable[[], torch.Tensor]]:
    """Our parameter name → lazy tensor; raises `CheckpointError` naming missing keys.
    `model_cls` / `family`: a family with this layout (DeepSeek-V3) reading its own model."""
    from specdeploy.models.qwen3_5_moe import _per_expert

    with torch.device("meta"):
        model = (model_cls or Model)(cfg, with_mtp=with_mtp)
        names = [n for n, _ in model.named_parameters()]
        buffers = [n for n, _ in model.named_buffers() if n.endswith("e_score_correction_bias")]
    params: dict[str, Callable[[], torch.Tensor]] = {}
    missing: list[str] = []
    for name in names + buffers:
        src = _source(name, cfg.num_hidden_layers)
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) \
                and src not in reader:
            params[name], lacking = _per_expert(reader, src, cfg.num_experts)
            missing += lacking
        elif src in reader:
            params[name] = from_keys(lambda s=src: reader.get(s), src)
        else:
            missing.append(src)
    if missing:
        mtp = all(int(m.split(".")[2]) >= cfg.num_hidden_layers for m in missing
                  if m.startswith("model.layers."))
        what = (f"MTP layer tensors are missing (config num_nextn_predict_layers="
                f"{cfg.num_nextn_predict_layers})" if with_mtp and mtp else "tensors are missing")
        more = f" (+{len(missing) - 12} more)" if len(missing) > 12 else ""
        raise CheckpointError(f"{reader.path}: {family} {what}: {', '.join(missing[:12])}{more}")
    return params


def params_to_checkpoint(state_dict: dict[str, torch.Tensor], cfg: Config
                         ) -> dict[str, torch.Tensor]:
    """Our state dict → the released layout (per-expert keys, MTP layers as trailing decoder
    layers; the tied head not stored)."""
    from specdeploy.models.qwen3_5_moe import per_expert_keys

    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if not name.endswith("inv_freq"):
            out.update(per_expert_keys(_source(name, cfg.num_hidden_layers), t))
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def tiny_hf_config(mtp_layers: int = 0) -> dict:
    """A tiny `Glm4MoeForCausalLM` config.json: 3 layers (the first dense), 8 experts in 2
    groups, q/k/v biases, q/k norms, RoPE on half of each 16-wide head."""
    cfg = llama.tiny_hf_config()
    cfg.update(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", num_hidden_layers=3,
               intermediate_size=96, attention_bias=True, use_qk_norm=True,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                "partial_rotary_factor": 0.5},
               n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
               norm_topk_prob=True, routed_scaling_factor=2.5,
               num_nextn_predict_layers=mtp_layers)
    del cfg["rope_theta"]
    return cfg


def make_tiny(out: str | Path, seed: int = 0, mtp_layers: int = 0, hf_config: dict | None = None
              ) -> Path:
    """A tiny random checkpoint in the released layout (+ MTP layers when asked); `hf_config`
    replaces `tiny_hf_config(mtp_layers)`."""
    from specdeploy.checkpoint.tiny import write_checkpoint, write_tiny_tokenizer

    hf = hf_config or tiny_hf_config(mtp_layers)
    cfg = Config.from_hf(hf)
    model = Model(cfg, with_mtp=cfg.num_nextn_predict_layers > 0)
    write_checkpoint(out, hf, params_to_checkpoint(random_state(model, seed), cfg))
    # GLM's own special tokens (llama.cpp's converter looks them up by text)
    write_tiny_tokenizer(out, cfg.vocab_size, {120: "[gMASK]", 121: "<|user|>",
                                               122: "<|observation|>"})
    return Path(out)


def random_state(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A tiny model's random weights (norms near 1, a correction bias that moves the routing)
    as its state dict."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():  # a bias that moves the selection
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return {**model.state_dict()}


__all__ = ["ARCHITECTURES", "Config", "Model", "checkpoint_to_params", "make_tiny",
           "params_to_checkpoint", "random_state", "tiny_hf_config"]
