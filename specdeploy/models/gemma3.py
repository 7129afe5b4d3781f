"""Google Gemma 3 text models (`Gemma3ForCausalLM`: gemma-3-270m / 1b; the language model of
`Gemma3ForConditionalGeneration`: 4b / 12b / 27b, whose tower is models/gemma3_vision.py and
whose image features enter as `inputs_embeds`). Llama's attention with per-head q/k
RMSNorms and the score scale `query_pre_attn_scalar ** -0.5`; four RMSNorms a layer (input,
post-attention, pre- and post-feedforward: the sublayers' outputs are normed before the
residual add); a GeGLU MLP (`hidden_activation`, tanh GELU); embeddings times sqrt(hidden),
that factor rounded to the embedding's dtype first (as transformers does); tied head; optional
final logit softcapping. Sliding-window layers (`layer_types`, else every `sliding_window_pattern`
-th layer full) rotate with their own RoPE base (`rope_local_base_freq`, no scaling); full layers
with `rope_theta` and its scaling (the 4b+ releases: linear x8).

Every Gemma RMSNorm computes `x / rms(x) * (1 + w)` in fp32 from the stored `w`; here the weight
is `1 + w` (added in float64, so it is fp32's `1 + w` exactly), so the shared `rms_norm` op and
its fused kernels serve unchanged. NOTE: a bf16 deployment holds `1 + w` rounded to bf16 (the
loader casts every weight), where transformers multiplies by the fp32 sum: its logits sit as far
from the fp32 ones as transformers' bf16 logits do (0.6% vs 0.56% of the largest on the tiny
model), not bit for bit. Names follow transformers' `modeling_gemma3.py`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from specdeploy.checkpoint import CheckpointError, CheckpointReader
from specdeploy.models import llama
from specdeploy.models.layers import MLP, RMSNorm, RopeConfig, RotaryEmbedding

ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")

# transformers' Gemma3TextConfig defaults: the larger releases' `text_config` leaves most keys out
_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
}


@dataclass(frozen=True)
class Config(llama.Config):
    query_pre_attn_scalar: float = 256.0
    local_rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=10_000.0))
    final_logit_softcapping: float = 0.0  # 0: none

    @classmethod
    def from_hf(cls, hf: dict) -> Config:
        hf = {**_DEFAULTS, **(hf.get("text_config") or hf)}
        for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if hf.get(key):  # (transformers' Gemma 3 does not apply the first; no release sets it)
                raise ValueError(f"gemma3: {key}={hf[key]!r} is not supported (Gemma 3 "
                                 "releases set it null / false)")
        n = int(hf["num_hidden_layers"])
        types = hf.get("layer_types")
        if not types:  # transformers: every pattern-th layer full, the others sliding
            pattern = int(hf["sliding_window_pattern"])
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(n)]
        full, local = _rope_params(hf)
        positions = {"max_position_embeddings": hf["max_position_embeddings"]}
        plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
        base = llama.Config.from_hf({
            **plain, "model_type": "gemma3", "layer_types": types,
            "hidden_act": hf["hidden_activation"], "rope_parameters": full})
        return cls(**{**base.__dict__, "qk_norm": True, "mlp_bias": False},
                   query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
                   local_rope=RopeConfig.from_hf({"rope_parameters": local, **positions}),
                   final_logit_softcapping=float(hf.get("final_logit_softcapping") or 0.0))


def _rope_params(hf: dict) -> tuple[dict, dict]:
    """(full layers', sliding layers') RoPE parameters: transformers v5's `rope_parameters` keyed
    by layer type, or the released v4 keys (`rope_scaling` scales the full layers only)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    elif params:
        raise ValueError(f"gemma3: rope_parameters must be keyed by layer type "
                         f"(full_attention / sliding_attention), got {sorted(params)}")
    else:
        full, local = dict(hf.get("rope_scaling") or {}), {}
    full.setdefault("rope_theta", hf["rope_theta"])
    local.setdefault("rope_theta", hf["rope_local_base_freq"])
    return full, local


class Attention(llama.Attention):
    """llama's (its q/k norms on: `qk_norm`), scores scaled by `query_pre_attn_scalar ** -0.5`."""

    def __init__(self, cfg: Config, window: int = 0):
        super().__init__(cfg, window=window)
        self.scale = cfg.query_pre_attn_scalar ** -0.5


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, index: int = 0):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, window=cfg.window(index))
        self.mlp = MLP(h, cfg.intermediate_size, False, cfg.hidden_act)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Model(llama.Model):
    """`Gemma3ForCausalLM` without caches: `forward(input_ids[B,T], position_ids?) -> logits`."""

    def __init__(self, cfg: Config, with_mtp: bool = False):
        super().__init__(cfg, with_mtp)
        # `model.rotary_emb` (llama's) serves the full layers; the sliding ones have their own
        self.model.rotary_emb_local = RotaryEmbedding(cfg.local_rope, cfg.head_dim)
        # sqrt(H) as transformers applies it: an fp32 scalar rounded to the embedding's dtype
        # (bf16: sqrt(1152) = 33.94 -> 34.0); built on the CPU whatever device context is on
        root = torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32, device="cpu")
        self.embed_scale = {dt: root.to(dt).item()
                            for dt in (torch.float32, torch.bfloat16, torch.float16)}

    @staticmethod
    def layer_factory(cfg: Config):
        return lambda i: DecoderLayer(cfg, i)

    def init_buffers(self) -> None:
        super().init_buffers()
        self.model.rotary_emb_local.init_buffers()

    def forward_hidden(
        self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [B, T, H]. `inputs_embeds` (a VLM's, deploy/vlm.py):
        already scaled, image features in place of the image tokens."""
        if position_ids is None:
            b, t = input_ids.shape
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        if inputs_embeds is None:
            x = self.model.embed_tokens(input_ids)
            x = x * self.embed_scale[x.dtype]
        else:
            x = inputs_embeds
        full = self.model.rotary_emb(position_ids)
        local = self.model.rotary_emb_local(position_ids)
        for layer in self.model.layers:
            cos, sin = local if layer.self_attn.window else full
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def forward(
        self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        logits = self.lm_head(self.forward_hidden(input_ids, position_ids, inputs_embeds))
        cap = self.cfg.final_logit_softcapping
        # elementwise after the head: `gather_logits` still finds the head behind them
        return torch.tanh(logits / cap) * cap if cap else logits


def _prefix(reader) -> str:
    """Where the language model's tensors live: `model.` (Gemma3ForCausalLM), `model.
    language_model.` (transformers v5's Gemma3ForConditionalGeneration), `language_model.model.`
    (the multimodal releases as published)."""
    for prefix in ("model.", "model.language_model.", "language_model.model."):
        if f"{prefix}embed_tokens.weight" in reader:
            return prefix
    return "model."


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def checkpoint_to_params(reader: CheckpointReader, cfg: Config, with_mtp: bool = False
                         ) -> dict[str, Callable[[], torch.Tensor]]:
    """Our parameter name → lazy tensor (norms as `1 + w`); raises `CheckpointError` naming every
    missing key. A multimodal checkpoint's vision tower and projector are not read."""
    if with_mtp:
        raise CheckpointError("Gemma 3 checkpoints have no MTP weights")
    prefix = _prefix(reader)
    head = "language_model.lm_head.weight" if prefix == "language_model.model." else (
        "lm_head.weight")
    with torch.device("meta"):
        names = [n for n, _ in Model(cfg).named_parameters()]  # tied head appears once
    params: dict[str, Callable[[], torch.Tensor]] = {}
    missing: list[str] = []
    for name in names:
        src = prefix + name[len("model."):] if name.startswith("model.") else head
        if src not in reader:
            missing.append(src)
        elif _is_norm(name):
            params[name] = lambda s=src: (reader.get(s).double() + 1.0).float()
        else:
            params[name] = lambda s=src: reader.get(s)
    if missing:
        more = f" (+{len(missing) - 12} more)" if len(missing) > 12 else ""
        raise CheckpointError(f"{reader.path}: Gemma 3 tensors are missing: "
                              f"{', '.join(missing[:12])}{more}")
    return params


def params_to_checkpoint(state_dict: dict[str, torch.Tensor], cfg: Config
                         ) -> dict[str, torch.Tensor]:
    """transformers' `Gemma3ForCausalLM` layout: norms stored as `w` (ours hold `1 + w`); the
    tied head is not stored."""
    out = {k: (v.double() - 1.0).to(v.dtype) if _is_norm(k) else v
           for k, v in state_dict.items() if not k.endswith("inv_freq")}
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def tiny_hf_config(mtp_layers: int = 0) -> dict:
    """A tiny `Gemma3ForCausalLM` config.json in the released (v4) style: 4 layers, sliding
    window 8 on every other one (`sliding_window_pattern` 2), GQA 4:2 of 16-wide heads, score
    scale 24^-0.5, local RoPE base 10^4, full layers 10^6 with linear scaling x2."""
    if mtp_layers:
        raise ValueError("Gemma 3 has no MTP layers")
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 24, "sliding_window": 8, "sliding_window_pattern": 2,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "max_position_embeddings": 512, "tie_word_embeddings": True, "attention_bias": False,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": "float32",
    }


def make_tiny(out: str | Path, seed: int = 0, mtp_layers: int = 0, hf_config: dict | None = None
              ) -> Path:
    """A tiny random checkpoint (config, safetensors, tokenizer) in `out`."""
    from specdeploy.checkpoint.tiny import write_checkpoint, write_tiny_tokenizer

    hf = hf_config or tiny_hf_config(mtp_layers)
    cfg = Config.from_hf(hf)
    gen = torch.Generator().manual_seed(seed)
    model = Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _is_norm(name):  # 1 + w with w ~ 0.1: a norm read without its 1 shows up
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):  # (times sqrt(H) on the way in)
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    write_checkpoint(out, hf, params_to_checkpoint(model.state_dict(), cfg))
    write_tiny_tokenizer(out, cfg.vocab_size)
    return Path(out)


__all__ = ["ARCHITECTURES", "Config", "Model", "checkpoint_to_params", "make_tiny",
           "params_to_checkpoint", "tiny_hf_config"]
