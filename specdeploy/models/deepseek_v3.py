"""DeepSeek-V3 / R1 / Kimi K2 (`DeepseekV3ForCausalLM`) and DeepSeek-V2 / V2-Lite
(`DeepseekV2ForCausalLM`: softmax routing, no MTP): multi-head latent attention (MLA) with
GLM-4.5's DeepSeek MoE (models/glm4_moe.py: sigmoid routing steered by
`e_score_correction_bias`, group-limited, renormalized, scaled; shared experts; the first
`first_k_dense_replace` layers dense) and its MTP layer layout (models/drafters/glm4_moe_mtp.py:
`enorm` / `hnorm` / `eh_proj` / `shared_head`, stored as the trailing decoder layers).

MLA per token: q from `q_a_proj → q_a_layernorm → q_b_proj` (or `q_proj` when q_lora_rank is
None); `kv_a_proj_with_mqa` gives the latent c (kv_lora_rank) and one RoPE key k_rope
(qk_rope_head_dim) shared by all heads. transformers expands `kv_b_proj(kv_a_layernorm(c))` into
each head's k_nope and v; here kv_b_proj is absorbed (as vLLM / SGLang / llama.cpp decode): its
rows per head are W_UK [H, qk_nope, kv_lora] and W_UV [H, v, kv_lora], q_nope · k_nope =
(q_nope W_UK) · c, so each head's query [q_nope W_UK, rope(q_rope)] attends ONE shared key
[c, rope(k_rope)] whose value is c (its leading kv_lora dims), and each head's output leaves
through W_UV, then o_proj. The expanded math up to float reassociation (same softmax scale);
the paged cache holds the key only, kv_lora + qk_rope values per token and layer (DeepSeek-V3:
576, expanded 128 heads x 320 = 40960). Sharding: the heads of q, W_UK, W_UV and o_proj split
over ranks; the latent path (q_a, kv_a, their norms) and the one key are replicated.

Names and math follow transformers' `modeling_deepseek_v3.py` / `modeling_deepseek_v2.py`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdeploy.models import glm4_moe, llama
from specdeploy.models.layers import MLP, RMSNorm
from specdeploy.models.rope_yarn import Yarn, YarnRotaryEmbedding, yarn_mscale
from specdeploy.ops import Routing, route_softmax_topk
from specdeploy.ops.shard import heads, linear_col, linear_row, tp_param, tp_reduce

ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
_ops = torch.ops.specdeploy
# DeepSeek's configs name their routing; each architecture runs transformers' router for it
_ROUTING = {"deepseek_v3": (("sigmoid",), ("noaux_tc",)),
            "deepseek_v2": (("softmax",), ("greedy", "group_limited_greedy"))}
# transformers' defaults where GLM's reader has others (released configs set them all)
_DEFAULTS = {"deepseek_v3": dict(first_k_dense_replace=3, n_group=8, topk_group=4,
                                 norm_topk_prob=True, routed_scaling_factor=2.5),
             "deepseek_v2": dict(first_k_dense_replace=0, n_group=1, topk_group=1,
                                 norm_topk_prob=False, routed_scaling_factor=1.0,
                                 n_shared_experts=2)}
# NOTE: transformers builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, not the
# config's rms_norm_eps (as DeepSeek's reference code)
_LATENT_EPS = 1e-6


@dataclass(frozen=True)
class Config(glm4_moe.Config):
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True  # RoPE on interleaved pairs (DeepSeek's weights' layout)
    yarn: Yarn = Yarn(theta=10000.0)
    softmax_scale: float = 0.0
    kind: str = "deepseek_v3"  # "deepseek_v2": softmax routing
    topk_method: str = "noaux_tc"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: dict) -> Config:
        hf = hf.get("text_config") or hf
        kind = "deepseek_v2" if "DeepseekV2ForCausalLM" in (hf.get("architectures") or ()) \
            else "deepseek_v3"
        _refuse(hf, kind)
        hf = {**_DEFAULTS[kind], **{k: v for k, v in hf.items() if v is not None}}
        params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        yarn = Yarn.from_params(params, theta, int(hf.get("max_position_embeddings", 4096)),
                                family=kind, mscale=True)
        rope_dim, nope = int(hf["qk_rope_head_dim"]), int(hf["qk_nope_head_dim"])
        # GLM's reader for the MoE / MTP fields; the RoPE it sees is plain (the YaRN is ours)
        base = glm4_moe.Config.from_hf({
            **hf, "rope_scaling": None, "head_dim": rope_dim, "rope_parameters": {
                "rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 1.0}})
        scale = (nope + rope_dim) ** -0.5
        if params.get("rope_type", params.get("type", "default")) != "default" \
                and params.get("mscale_all_dim"):
            # transformers' yarn_apply_mscale: the softmax scale too (all dims, not only RoPE's)
            m = yarn_mscale(yarn.factor, float(params["mscale_all_dim"]))
            scale = scale * m * m
        q_lora = hf.get("q_lora_rank")
        return cls(**{**base.__dict__, "qkv_bias": False,
                      "attention_bias": bool(hf.get("attention_bias", False))},
                   q_lora_rank=int(q_lora) if q_lora else None,
                   kv_lora_rank=int(hf["kv_lora_rank"]), qk_nope_head_dim=nope,
                   qk_rope_head_dim=rope_dim, v_head_dim=int(hf["v_head_dim"]),
                   rope_interleave=bool(hf.get("rope_interleave", True)), yarn=yarn,
                   softmax_scale=scale, kind=kind,
                   topk_method=str(hf.get("topk_method", _ROUTING[kind][1][0])))


def _refuse(hf: dict, name: str) -> None:
    """What this module does not run, by name (never loaded as something else)."""
    scorings, methods = _ROUTING[name]
    scoring = hf.get("scoring_func") or scorings[0]
    if scoring not in scorings:
        raise ValueError(f"{name}: scoring_func {scoring!r} is not supported; supported: "
                         f"{', '.join(scorings)}")
    topk = hf.get("topk_method") or methods[0]
    if topk not in methods:
        raise ValueError(f"{name}: topk_method {topk!r} is not supported; supported: "
                         f"{', '.join(methods)}")
    if name == "deepseek_v2" and hf.get("norm_topk_prob"):
        # (DeepSeek's code renormalizes the top-k softmax weights, transformers' V2 does not)
        raise ValueError("deepseek_v2: norm_topk_prob=true is not supported")
    if hf.get("mlp_bias"):
        raise ValueError(f"{name}: mlp_bias=true is not supported")
    if int(hf.get("moe_layer_freq", 1) or 1) != 1:
        raise ValueError(f"{name}: moe_layer_freq={hf['moe_layer_freq']} is not supported "
                         "(every layer past first_k_dense_replace is MoE)")
    heads_, kv = hf["num_attention_heads"], hf.get("num_key_value_heads")
    if kv is not None and int(kv) != int(heads_):
        raise ValueError(f"{name}: num_key_value_heads={kv} != num_attention_heads={heads_} "
                         "is not supported (MLA: every head reads the one latent key)")


class Attention(nn.Module):
    """MLA, absorbed (see the module docstring): `forward(x[B,T,H], cos, sin) -> [B,T,H]`."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        h, n, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, n * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, n * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                            bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, _LATENT_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank,
                                   n * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * cfg.v_head_dim, h, bias=bias)

    def _pairs(self, x: torch.Tensor) -> torch.Tensor:
        """Interleaved RoPE pairs (x0, x1), (x2, x3).. as the rotate-half layout the rope op
        takes: evens then odds. q and k get the same permutation, so q·k is unchanged (what
        transformers' apply_rotary_pos_emb_interleave computes). NOTE: it could be folded into
        the rows of q_b_proj / kv_a_proj_with_mqa at load time; here it is two views and a
        copy of the RoPE part."""
        if not self.cfg.rope_interleave:
            return x
        b, t, _, r = x.shape
        return x.view(b, t, -1, r // 2, 2).transpose(-1, -2).reshape(b, t, -1, r)

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, qk_nope, kv_lora], W_UV [H, v, kv_lora]): kv_b_proj's rows per head (this
        rank's heads under tensor parallelism)."""
        c = self.cfg
        nope, dv = c.qk_nope_head_dim, c.v_head_dim
        w = tp_param(self.kv_b_proj.weight, "mha", "colwise", 0,
                     [heads(c.num_attention_heads, nope + dv)])
        w_uk, w_uv = w.view(-1, nope + dv, c.kv_lora_rank).split([nope, dv], 1)
        return w_uk, w_uv

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, (b, t, _) = self.cfg, x.shape
        n, nope, r, dv, lat = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, \
            c.v_head_dim, c.kv_lora_rank
        # sharding hints: the heads of q_b (q) / kv_b / o split over ranks; the latent path
        # (q_a, kv_a and their norms) is small and replicated, so every rank has the one key
        if c.q_lora_rank:
            q = linear_col(self.q_b_proj, self.q_a_layernorm(self.q_a_proj(x)), "mha",
                           [heads(n, c.qk_head_dim)])
        else:
            q = linear_col(self.q_proj, x, "mha", [heads(n, c.qk_head_dim)])
        q_nope, q_rope = q.view(b, t, -1, c.qk_head_dim).split([nope, r], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([lat, r], -1)
        w_uk, w_uv = self.absorbed()
        q_lat = torch.einsum("bthd,hdl->bthl", q_nope, w_uk)
        q_rope = _ops.rope(self._pairs(q_rope), cos, sin)
        k_rope = _ops.rope(self._pairs(k_rope.view(b, t, 1, r)), cos, sin)
        k = torch.cat((self.kv_a_layernorm(latent).view(b, t, 1, lat), k_rope), -1)
        # the value is the key's leading kv_lora dims (the normed latent): the cache stores it
        # once (deploy/passes/insert_cache.py)
        o = _ops.attention(torch.cat((q_lat, q_rope), -1), k, k[..., :lat], c.softmax_scale, 0)
        o = torch.einsum("bthl,hvl->bthv", o, w_uv).reshape(b, t, -1)
        return tp_reduce(linear_row(self.o_proj, o, "mha", [heads(n, dv)]), "mha")


class SoftmaxMoE(glm4_moe.MoE):
    """DeepSeek-V2's routing (transformers' DeepseekV2TopkRouter): softmax over the experts,
    top-k (greedy), or top-k within the `topk_group` groups of the best single expert
    (group_limited_greedy); the weights not renormalized, times routed_scaling_factor."""

    correction_bias = False

    def route(self, logits: torch.Tensor) -> Routing:
        c = self.cfg
        if c.topk_method == "greedy" or c.n_group == 1:
            r = route_softmax_topk(logits, c.num_experts_per_tok, False)
            return Routing(r.ids, r.weights * c.routed_scaling_factor)
        probs = logits.softmax(-1)
        groups = probs.view(-1, c.n_group, c.num_experts // c.n_group).amax(-1)
        keep = torch.zeros_like(groups).scatter(1, groups.topk(c.topk_group, -1).indices, 1.0)
        keep = keep[..., None].expand(-1, -1, c.num_experts // c.n_group).reshape(probs.shape)
        weights, ids = probs.masked_fill(keep == 0, 0.0).topk(c.num_experts_per_tok, -1)
        return Routing(ids, weights * c.routed_scaling_factor)


class DecoderLayer(nn.Module):
    """Llama's residual layout around MLA and (past `first_k_dense_replace`) GLM's MoE."""

    forward = llama.DecoderLayer.forward

    def __init__(self, cfg: Config, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = SoftmaxMoE if cfg.kind == "deepseek_v2" else glm4_moe.MoE
        self.mlp = moe(cfg) if cfg.sparse(index) else MLP(
            cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)


class Model(glm4_moe.Model):
    """`forward(input_ids[B,T], position_ids?) -> logits`; `with_mtp`: the checkpoint's MTP
    layers as `self.mtp` (a drafter)."""

    decoder_layer = DecoderLayer

    def __init__(self, cfg: Config, with_mtp: bool = False):
        super().__init__(cfg, with_mtp=with_mtp)
        # YaRN (cos / sin scaled by its attention factor) or plain RoPE, over qk_rope_head_dim
        self.model.rotary_emb = YarnRotaryEmbedding(cfg.yarn, cfg.rotary_dim)
        if with_mtp:
            self.mtp.rotary_emb = YarnRotaryEmbedding(cfg.yarn, cfg.rotary_dim)


def checkpoint_to_params(reader, cfg: Config, with_mtp: bool = False
                         ) -> dict[str, Callable[[], torch.Tensor]]:
    """Our parameter name → lazy tensor (GLM-4.5's layout: per-expert or fused experts, MTP
    layers as trailing decoder layers); raises `CheckpointError` naming missing keys."""
    return glm4_moe.checkpoint_to_params(reader, cfg, with_mtp, model_cls=Model,
                                         family=cfg.kind.replace("deepseek_v", "DeepSeek-V"))


params_to_checkpoint = glm4_moe.params_to_checkpoint


def tiny_hf_config(mtp_layers: int = 0, q_lora_rank: int | None = 24, yarn: bool = False,
                   v2: str | None = None) -> dict:
    """A tiny `DeepseekV3ForCausalLM` config.json (release-style keys): 4 layers (the first
    dense), 4 heads of 16 + 8 (RoPE) with v 16, latent 32, q latent `q_lora_rank` (None: a
    plain q_proj), 8 experts in 2 groups (top 2 of 1 group) + 1 shared; `yarn`: YaRN x4 with
    DeepSeek's mscale / mscale_all_dim; `v2` (a topk_method): a `DeepseekV2ForCausalLM`."""
    cfg = llama.tiny_hf_config()
    cfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
               num_hidden_layers=4, intermediate_size=96, num_key_value_heads=4,
               q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
               n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
               topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1,
               num_nextn_predict_layers=mtp_layers, rope_scaling=None)
    del cfg["head_dim"]
    if v2:
        cfg.update(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                   topk_method=v2, scoring_func="softmax", norm_topk_prob=False)
        del cfg["num_nextn_predict_layers"]
    if yarn:
        cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 128, "beta_fast": 32,
                               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
    return cfg


def make_tiny(out: str | Path, seed: int = 0, mtp_layers: int = 0, hf_config: dict | None = None
              ) -> Path:
    """A tiny random checkpoint in the released layout (+ MTP layers when asked); `hf_config`
    replaces `tiny_hf_config(mtp_layers)`."""
    from specdeploy.checkpoint.tiny import write_checkpoint, write_tiny_tokenizer

    hf = hf_config or tiny_hf_config(mtp_layers)
    cfg = Config.from_hf(hf)
    model = Model(cfg, with_mtp=cfg.num_nextn_predict_layers > 0)
    write_checkpoint(out, hf, params_to_checkpoint(glm4_moe.random_state(model, seed), cfg))
    write_tiny_tokenizer(out, cfg.vocab_size)
    return Path(out)


__all__ = ["ARCHITECTURES", "Config", "Model", "checkpoint_to_params", "make_tiny",
           "params_to_checkpoint", "tiny_hf_config"]
