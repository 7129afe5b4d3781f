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
from pathlib import Path

import torch
from torch import nn

from specdeploy.checkpoint import CheckpointError, from_keys
from specdeploy.models.layers import RMSNorm
from specdeploy.models.nemotron_h_blocks import Block
from specdeploy.models.nemotron_h_config import Config

ARCHITECTURES = ("NemotronHForCausalLM",)
__all__ = ["ARCHITECTURES", "Config", "Model"]


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
    """Accepts `backbone.*` / `model.*` / `model.language_model.*` (and all of it under the VLM
    root `language_model.`), per-expert (`experts.{e}.up_proj.weight`) or fused
    (`experts.up_proj` [E, I, H']) expert tensors."""
    root = "language_model." if reader.has_prefix("language_model.") else ""
    pre = next((p for p in (root + "backbone.", "model.language_model.", root + "model.")
                if reader.has_prefix(p + "layers.") or p + "embeddings.weight" in reader), "model.")
    with torch.device("meta"):
        model = Model(cfg, with_mtp)
    names = [n for n, _ in [*model.named_parameters(), *model.named_buffers()]]
    out, missing = {}, []
    for name in names:
        key = pre + name[len("model."):] if name.startswith("model.") else root + name
        if key == root + "lm_head.weight" and key not in reader and cfg.tie_word_embeddings:
            key = pre + "embeddings.weight"
        if name.endswith(_FUSED) and key not in reader:
            head, _, proj = key.rpartition(".")
            keys = [f"{head}.{e}.{proj}.weight" for e in range(cfg.n_routed_experts)]
            if all(k in reader for k in keys):
                out[name] = from_keys(lambda keys=keys: torch.stack([reader.get(k) for k in keys]),
                                      [[k] for k in keys])
                continue
            key = keys[0]
        if key in reader:
            out[name] = from_keys(lambda key=key: reader.get(key), key)
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
