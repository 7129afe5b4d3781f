"""IBM Granite 4.0 (`GraniteMoeHybridForCausalLM`: Granite-4.0-H Micro / Tiny / Small, hybrid
Mamba2 + attention with MoE; and the dense all-attention Granite-4.0 Micro): each layer is a
Mamba2 mixer or an attention mixer (RoPE, or none: `position_embedding_type`), then routed SwiGLU
experts (softmax over the top-k logits) plus a shared SwiGLU MLP, or the shared MLP alone; the
embedding, residual branches, attention scores and logits carry Granite's scalar multipliers.

The Mamba2 mixer is NemotronH's (models/nemotron_h_blocks.py, the same math as transformers'
Bamba mixer), so its cached ops, spec states and rollback are the hybrids'. Names follow the
released checkpoints (`model.layers.N.{mamba, self_attn, block_sparse_moe.{router.layer,
input_linear, output_linear}, shared_mlp.{input_linear, output_linear}}`: what transformers'
save_pretrained writes back).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from specdeploy.checkpoint import CheckpointError, CheckpointReader, from_keys
from specdeploy.models.granite_hybrid_config import Config
from specdeploy.models.layers import MLP, RMSNorm, RotaryEmbedding
from specdeploy.models.nemotron_h_blocks import Mamba2Mixer
from specdeploy.ops import route_softmax_topk
from specdeploy.ops.shard import Seg, heads, linear_col, linear_row, tp_param, tp_reduce

ARCHITECTURES = ("GraniteMoeHybridForCausalLM",)
_ops = torch.ops.specdeploy


class Attention(nn.Module):
    """Causal GQA, RoPE or none, scores scaled by `attention_multiplier`."""

    def __init__(self, cfg: Config):
        super().__init__()
        h, d, hq, hkv, bias = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                               cfg.num_key_value_heads, cfg.attention_bias)
        self.head_dim, self.heads, self.scale = d, (hq, hkv), cfg.attention_multiplier
        self.q_proj = nn.Linear(h, hq * d, bias=bias)
        self.k_proj = nn.Linear(h, hkv * d, bias=bias)
        self.v_proj = nn.Linear(h, hkv * d, bias=bias)
        self.o_proj = nn.Linear(hq * d, h, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> torch.Tensor:
        shape, (hq, hkv), d = (*x.shape[:2], -1, self.head_dim), self.heads, self.head_dim
        q, k, v = (linear_col(p, x, "mha", [s]).view(shape) for p, s in (
            (self.q_proj, heads(hq, d)), (self.k_proj, heads(hkv, d, hq)),
            (self.v_proj, heads(hkv, d, hq))))
        if cos is not None:
            q, k = _ops.rope(q, cos, sin), _ops.rope(k, cos, sin)
        o = _ops.attention(q, k, v, self.scale, 0)
        return tp_reduce(linear_row(self.o_proj, o.flatten(2), "mha", [heads(hq, d)]), "mha")


class MoE(nn.Module):
    """Softmax over the top-k router logits; SwiGLU experts fused as released
    (`input_linear.weight` [E, 2I, H], gate rows first; `output_linear.weight` [E, H, I])."""

    def __init__(self, cfg: Config):
        super().__init__()
        e, i, h = cfg.num_local_experts, cfg.intermediate_size, cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.router, self.input_linear, self.output_linear = nn.Module(), nn.Module(), nn.Module()
        self.router.layer = nn.Linear(h, e, bias=False)
        self.input_linear.weight = nn.Parameter(torch.empty(e, 2 * i, h))
        self.output_linear.weight = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router.layer(flat)
        if logits.dtype != torch.float32:  # (fp32 routing, as transformers; no cast node in fp32
            logits = logits.float()         # graphs, where the MoE-block fusion reads the router)
        # softmax of the top-k logits = softmax over all, renormalized over the top k
        r = route_softmax_topk(logits, self.top_k, True)
        i = self.output_linear.weight.shape[-1]
        w_up = tp_param(self.input_linear.weight, "moe", "expert_colwise", 1, [Seg(i), Seg(i)])
        w_down = tp_param(self.output_linear.weight, "moe", "expert_rowwise", 2, [Seg(i)])
        y = _ops.moe_experts(flat, r.ids, r.weights.to(flat.dtype), w_up, w_down, "swiglu")
        return tp_reduce(y, "moe").view(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, kind: str):
        super().__init__()
        self.kind, self.res = kind, cfg.residual_multiplier
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.eps)
        if kind == "mamba":
            self.mamba = Mamba2Mixer(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.eps)
        if cfg.num_local_experts:
            self.block_sparse_moe = MoE(cfg)
        # (the released `shared_mlp.input_linear` [2I, H] is split into gate_proj / up_proj at
        # load: Llama's MLP, so its fusions and tensor-parallel hints apply as they are)
        self.shared_mlp = MLP(cfg.hidden_size, cfg.shared_intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.mamba(h) if self.kind == "mamba" else self.self_attn(h, cos, sin)
        x = x + h * self.res
        h = self.post_attention_layernorm(x)
        out = self.shared_mlp(h)
        if hasattr(self, "block_sparse_moe"):
            out = self.block_sparse_moe(h) + out
        return x + out * self.res


class Backbone(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, k) for k in cfg.block_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.eps)
        if cfg.rope is not None:
            self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.head_dim)


class Model(nn.Module):
    """`forward(input_ids[B,T], position_ids?) -> logits[B,T,V]`."""

    def __init__(self, cfg: Config, with_mtp: bool = False):
        super().__init__()
        if with_mtp:
            raise ValueError("Granite 4.0 checkpoints have no MTP head; use an EAGLE-3 drafter "
                             "or n-gram lookup")
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._tie()

    def _tie(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_buffers(self) -> None:
        if hasattr(self.model, "rotary_emb"):
            self.model.rotary_emb.init_buffers()
        self._tie()

    def forward_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
                       ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids) * self.cfg.embedding_multiplier
        cos = sin = None
        if hasattr(self.model, "rotary_emb"):
            if position_ids is None:
                t = input_ids.shape[1]
                position_ids = torch.arange(t, device=x.device).expand(input_ids.shape[0], t)
            cos, sin = self.model.rotary_emb(position_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        # NOTE: logits / s as lm_head(h / s) (the same up to rounding): the graph's output stays
        # the head's linear, which the logits-gathering transform looks for
        return self.lm_head(self.forward_hidden(input_ids, position_ids)
                            / self.cfg.logits_scaling)


_SHARED = {"gate_proj": "input_linear", "up_proj": "input_linear",
           "down_proj": "output_linear"}


def _shared_source(name: str, reader, cfg: Config) -> tuple[str, Callable] | None:
    """A shared-MLP parameter from the released fused `input_linear` (its gate or up rows) or
    `output_linear`; None where the reader holds our name (a GGUF's split tensors)."""
    parts = name.split(".")
    if name in reader or len(parts) < 3 or parts[-3] != "shared_mlp":
        return None
    src = ".".join([*parts[:-2], _SHARED[parts[-2]], "weight"])
    if parts[-2] == "down_proj":
        return src, from_keys(lambda: reader.get(src), src)
    i = cfg.shared_intermediate_size
    rows = torch.arange(i) + (i if parts[-2] == "up_proj" else 0)
    if hasattr(reader, "get_rows"):  # pre-quantized: the quantized rows go along
        return src, lambda: reader.get_rows(src, rows)
    return src, lambda: reader.get(src)[rows]


def checkpoint_to_params(reader: CheckpointReader, cfg: Config, with_mtp: bool = False
                         ) -> dict[str, Callable[[], torch.Tensor]]:
    """Our parameter names are the checkpoint's but for the shared MLP's split projections;
    raises `CheckpointError` naming missing keys."""
    if with_mtp:
        raise CheckpointError("Granite 4.0 checkpoints have no MTP weights")
    with torch.device("meta"):
        names = [n for n, _ in Model(cfg).named_parameters()]  # (a tied head appears once)
    params, missing = {}, []
    for n in names:
        shared = _shared_source(n, reader, cfg)
        src, thunk = shared or (n, from_keys(lambda n=n: reader.get(n), n))
        if src in reader:
            params[n] = thunk
        else:
            missing.append(src)
    if missing:
        missing = list(dict.fromkeys(missing))
        more = f" (+{len(missing) - 12} more)" if len(missing) > 12 else ""
        raise CheckpointError(f"{reader.path}: Granite 4.0 tensors are missing: "
                              f"{', '.join(missing[:12])}{more}")
    return params


def params_to_checkpoint(state_dict: dict[str, torch.Tensor], cfg: Config
                         ) -> dict[str, torch.Tensor]:
    """Our state dict → the released layout (the shared MLP's gate and up fused again)."""
    out = {k: v for k, v in state_dict.items() if not k.endswith("inv_freq")}
    for key in [k for k in out if k.endswith("shared_mlp.gate_proj.weight")]:
        base = key[: -len("gate_proj.weight")]
        out[f"{base}input_linear.weight"] = torch.cat(
            [out.pop(key), out.pop(f"{base}up_proj.weight")])
        out[f"{base}output_linear.weight"] = out.pop(f"{base}down_proj.weight")
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def tiny_hf_config(mtp_layers: int = 0, dense: bool = False) -> dict:
    """A tiny `GraniteMoeHybridForCausalLM` config.json: 4 layers (mamba, attention, mamba,
    mamba), 8 experts top 2 beside the shared MLP, NoPE, Granite's multipliers; `dense`: no
    routed experts, RoPE, all attention (Granite-4.0 Micro's shape)."""
    if mtp_layers:
        raise ValueError("Granite 4.0 has no MTP layers")
    cfg = {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 4,
        "layer_types": ["mamba", "attention", "mamba", "mamba"], "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
        "attention_bias": False, "hidden_act": "silu", "position_embedding_type": "nope",
        "attention_multiplier": 0.2, "embedding_multiplier": 1.5, "residual_multiplier": 0.8,
        "logits_scaling": 2.0, "num_local_experts": 8, "num_experts_per_tok": 2,
        "intermediate_size": 32, "shared_intermediate_size": 48, "mamba_n_heads": 8,
        "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_head": 16, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_chunk_size": 16, "mamba_conv_bias": True,
        "mamba_proj_bias": False, "tie_word_embeddings": True, "bos_token_id": 0,
        "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
    }
    if dense:
        cfg.update(num_local_experts=0, num_experts_per_tok=0, position_embedding_type="rope",
                   rope_theta=10000.0, layer_types=["attention"] * 4)
    return cfg


def make_tiny(out: str | Path, seed: int = 0, mtp_layers: int = 0,
              hf_config: dict | None = None) -> Path:
    from specdeploy.checkpoint.tiny import write_checkpoint, write_tiny_tokenizer

    hf = hf_config or tiny_hf_config(mtp_layers)
    cfg = Config.from_hf(hf)
    gen = torch.Generator().manual_seed(seed)
    model = Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.0, 2.0, generator=gen))
            elif name.endswith(("dt_bias", "D")) or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    write_checkpoint(out, hf, params_to_checkpoint(model.state_dict(), cfg))
    write_tiny_tokenizer(out, cfg.vocab_size)
    return Path(out)


__all__ = ["ARCHITECTURES", "Config", "Model", "checkpoint_to_params", "make_tiny",
           "params_to_checkpoint", "tiny_hf_config"]
