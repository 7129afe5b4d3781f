"""EAGLE-3 drafter in the common `LlamaForCausalLMEagle3` checkpoint format.

Checked against SafeAILab EAGLE `model/cnets.py`, SpecForge `llama3_eagle.py`, vLLM
`llama_eagle3.py` / `llama.py` and ModelOpt's EAGLE export (Nov 2026):
- Keys: `fc.weight` [H, 3*Ht] (Ht = `target_hidden_size`, default H); `midlayer.{input_layernorm,
  hidden_norm,post_attention_layernorm}.weight`; `midlayer.self_attn.{q,k,v}_proj` (input 2H),
  `o_proj`; `midlayer.mlp.{gate,up,down}_proj` (SwiGLU); `norm.weight`; `lm_head.weight` [Vd, H];
  `d2t` [Vd] int64; `t2d` [V] bool; SpecForge exports add `embed_tokens.weight`, others share the
  target's. `fc` runs only on the 3 captured target features (first step); later steps feed the
  drafter's own H-wide hidden.
- Layer: residual = the fused hidden *before* `hidden_norm` (vLLM's `norm_before_residual`, off by
  default, makes it the normed one); x = cat(input_layernorm(embeds), hidden_norm(hidden)) → q/k/v;
  h = residual + o_proj(attn(x)); h = h + mlp(post_attention_layernorm(h)).
- The hidden chained into the next draft step is this *pre-`norm`* h (EAGLE `topK_genrate`,
  SpecForge `backbone`, vLLM `hidden_prenorm`); logits = lm_head(norm(h)) over the draft vocab.
- target_id = draft_id + d2t[draft_id]; t2d marks target ids in the draft vocab. A missing
  d2t/t2d is the identity (vLLM), valid only when Vd == V.
- Captured features (`eagle_config.eagle_aux_hidden_state_layer_ids`, default (2, L//2, L-3)) are
  the *inputs* of those target layers (vLLM: `hidden + residual` before layer idx), concatenated.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdeploy.checkpoint import CheckpointError, CheckpointReader
from specdeploy.checkpoint.tiny import write_checkpoint
from specdeploy.loading import assign_params, resolve_dtype
from specdeploy.models.drafters import Drafter, DraftOutput
from specdeploy.models.layers import MLP, RMSNorm, RopeConfig, RotaryEmbedding
from specdeploy.ops.shard import heads, linear_col, linear_row, tp_reduce

ARCHITECTURES = ("LlamaForCausalLMEagle3",)
# other names the same drafter ships under: vLLM's registry name, and the `speculators` library's
# format (Red Hat's `*-speculator.eagle3` heads: the layer's config nested, `layers.0.*` names)
ALIASES = ("Eagle3LlamaForCausalLM", "Eagle3Speculator")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's vocab
    draft_vocab_size: int
    target_hidden_size: int
    rope: RopeConfig = RopeConfig()
    aux_layer_ids: tuple[int, ...] | None = None  # eagle_config.eagle_aux_hidden_state_layer_ids
    use_aux_hidden_state: bool = True  # False: no `fc`, the target's last hidden feeds directly
    norm_before_residual: bool = False
    max_position_embeddings: int = 8192  # kept (RopeConfig falls back on it) for exact round trips

    @classmethod
    def from_hf(cls, hf: dict) -> Eagle3Config:
        hf = hf.get("text_config", hf)
        layers, act, bias = hf.get("num_hidden_layers", 1), hf.get("hidden_act", "silu"), \
            hf.get("attention_bias") or hf.get("mlp_bias")
        if layers != 1 or act != "silu" or bias:
            raise CheckpointError(f"EAGLE-3: only one bias-free SwiGLU layer is supported; config "
                                  f"has {layers} layers, hidden_act {act!r}, bias {bias}")
        eagle = hf.get("eagle_config") or {}
        h, heads = hf["hidden_size"], hf["num_attention_heads"]
        return cls(
            hidden_size=h, intermediate_size=hf["intermediate_size"], num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or h // heads, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=RopeConfig.from_hf(hf), vocab_size=hf["vocab_size"],
            draft_vocab_size=hf.get("draft_vocab_size") or hf["vocab_size"],
            target_hidden_size=hf.get("target_hidden_size") or h,
            aux_layer_ids=tuple(eagle.get("eagle_aux_hidden_state_layer_ids") or ()) or None,
            use_aux_hidden_state=eagle.get("use_aux_hidden_state", True),
            norm_before_residual=bool(hf.get("norm_before_residual", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 8192))

    def to_hf(self) -> dict:
        hf, r = asdict(self), self.rope  # the other field names are the HF keys
        del hf["rope"]
        scaling = {"rope_type": r.rope_type, "factor": r.factor}
        if r.rope_type == "llama3":
            scaling.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                           original_max_position_embeddings=r.original_max_position_embeddings)
        if r.yarn is not None:
            y = r.yarn
            scaling.update(factor=y.factor, beta_fast=y.beta_fast, beta_slow=y.beta_slow,
                           original_max_position_embeddings=y.original_max_position_embeddings,
                           truncate=y.truncate)
            if y.attention_factor is not None:
                scaling["attention_factor"] = y.attention_factor
        eagle = {"use_aux_hidden_state": hf.pop("use_aux_hidden_state")}
        if (aux := hf.pop("aux_layer_ids")) is not None:
            eagle["eagle_aux_hidden_state_layer_ids"] = list(aux)
        return {"architectures": list(ARCHITECTURES), "model_type": "llama", **hf,
                "rope_theta": r.theta,
                "rope_scaling": None if r.rope_type == "default" else scaling,
                "num_hidden_layers": 1, "hidden_act": "silu", "tie_word_embeddings": False,
                "eagle_config": eagle}


def _linears(**shapes: tuple[int, int]) -> nn.ModuleDict:
    """Bias-free projections under HF names (`q_proj=(in, out)`, ...)."""
    return nn.ModuleDict({k: nn.Linear(i, o, bias=False) for k, (i, o) in shapes.items()})


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, d, i, eps = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps
        hq, hkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        self.input_layernorm, self.hidden_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        # NOTE: q/k/v read the 2H-wide cat(embeds, hidden); everything after is H wide.
        self.self_attn = _linears(q_proj=(2 * h, hq), k_proj=(2 * h, hkv), v_proj=(2 * h, hkv),
                                  o_proj=(hq, h))
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, i)
        self.head_dim, self.norm_before_residual = d, cfg.norm_before_residual
        self.heads = (cfg.num_attention_heads, cfg.num_key_value_heads)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, (b, t, d), (hq, hkv) = self.self_attn, (*x.shape[:2], self.head_dim), self.heads
        q, k, v = (linear_col(p, x, "mha", [s]).view(b, t, -1, d) for p, s in (
            (a.q_proj, heads(hq, d)), (a.k_proj, heads(hkv, d, hq)),
            (a.v_proj, heads(hkv, d, hq))))
        q = torch.ops.specdeploy.rope(q, cos, sin)
        k = torch.ops.specdeploy.rope(k, cos, sin)
        o = torch.ops.specdeploy.attention(q, k, v, d**-0.5)
        return tp_reduce(linear_row(a.o_proj, o.reshape(b, t, -1), "mha", [heads(hq, d)]), "mha")

    def forward(self, embeds, hidden, cos, sin) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = residual + self.attention(x, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(Drafter):
    """One-layer EAGLE-3 head. `embed_tokens` (the target's) serves `embed()` only and is
    borrowed, not registered; `own_embedding=True` (default when none is passed) gives the
    drafter its own."""

    def __init__(self, cfg: Eagle3Config, embed_tokens: nn.Module | None = None,
                 own_embedding: bool | None = None):
        super().__init__()
        self.cfg = cfg
        if own_embedding if own_embedding is not None else embed_tokens is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.borrow(embed_tokens=embed_tokens)
        if cfg.use_aux_hidden_state:
            self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.head_dim)  # computed, never stored

    def init_buffers(self) -> None:  # the loader calls it once the weights are assigned
        self.rotary_emb.init_buffers()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        emb = self._modules.get("embed_tokens") or self.borrowed.get("embed_tokens")
        if emb is None:
            raise RuntimeError("EAGLE-3 drafter has no embedding: pass the target's embed_tokens")
        return emb(input_ids)

    def project(self, captured: torch.Tensor) -> torch.Tensor:
        """The captured low/middle/high target features [N, 3*Ht] → fc → [N, H]."""
        fc = self._modules.get("fc")
        if fc is not None and captured.shape[-1] == fc.in_features:
            fast = self.__dict__.get("fc_kernel")  # deploy/spec.py `_tiled_projection`
            if fast is not None and captured.dtype == torch.float32 and captured.is_cpu:
                return fast(captured)
            return fc(captured.to(fc.weight.dtype))
        return captured.to(self.dtype)

    def forward(self, hidden_states: torch.Tensor, input_embeds: torch.Tensor,
                position_ids: torch.Tensor, step: int = 0) -> DraftOutput:
        """hidden_states [B,T,3*Ht] (captured target features) or [B,T,H] (own previous hidden);
        input_embeds [B,T,H]; position_ids [B,T] → DraftOutput(pre-norm hidden [B,T,H],
        draft logits [B,T,Vd])."""
        cfg = self.cfg
        if cfg.use_aux_hidden_state and hidden_states.shape[-1] == 3 * cfg.target_hidden_size:
            hidden_states = self.fc(hidden_states)
        elif hidden_states.shape[-1] != cfg.hidden_size:
            raise ValueError(f"EAGLE-3: hidden_states last dim {hidden_states.shape[-1]}, expected "
                             f"{3 * cfg.target_hidden_size} (3 x target) or {cfg.hidden_size}")
        if position_ids.dim() == 3:  # [3, B, T] multimodal positions (a VLM target): text
            position_ids = position_ids[0]  # rows carry one position on all three axes
        cos, sin = self.rotary_emb(position_ids)
        h = self.midlayer(input_embeds.to(hidden_states.dtype), hidden_states, cos, sin)
        return DraftOutput(h, self.lm_head(self.norm(h)))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids (any shape) → target-vocab ids."""
        return draft_ids + self.d2t[draft_ids]

    def logits_to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., Vd] draft logits → [..., V], -inf outside the draft vocab (for sampling)."""
        ids = torch.arange(self.cfg.draft_vocab_size, device=logits.device) + self.d2t
        out = logits.new_full((*logits.shape[:-1], self.cfg.vocab_size), float("-inf"))
        return out.index_copy(-1, ids, logits)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high captured layers (vLLM / EAGLE / SpecForge default), as
    *input* layer ids; the one definition training and deployment share."""
    if num_layers >= 7:
        return (2, num_layers // 2, num_layers - 3)
    return (0, num_layers // 2, num_layers - 1)


def speculators_config(hf: dict, source: str) -> dict:
    """A `speculators` library config (`speculators_model_type`, `transformer_layer_config`,
    `speculators_config`) as the common format's, the way vLLM reads it: the layer config at
    the top, the EAGLE-3 fields beside it (`norm_before_residual` defaults to True there)."""
    if "speculators_model_type" not in hf:
        return hf
    kind = hf.get("speculators_model_type")
    layer = hf.get("transformer_layer_config")
    if kind != "eagle3" or not isinstance(layer, dict):
        raise CheckpointError(f"{source}: a speculators drafter of type {kind!r} (with "
                              f"transformer_layer_config: {isinstance(layer, dict)}); only "
                              "'eagle3' with its transformer_layer_config is supported")
    out = {**layer, "architectures": list(ARCHITECTURES),
           "draft_vocab_size": hf.get("draft_vocab_size") or layer.get("vocab_size"),
           "norm_before_residual": hf.get("norm_before_residual", True)}
    if hf.get("target_hidden_size") is not None:
        out["target_hidden_size"] = hf["target_hidden_size"]
    aux = hf.get("eagle_aux_hidden_state_layer_ids")
    if aux:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux)}
    return out


def checkpoint_to_params(reader: CheckpointReader, cfg: Eagle3Config) -> dict:
    """Checkpoint keys are our parameter names (`layers.0.*`, the speculators library's and
    vLLM's name of the one layer, read as `midlayer.*`); d2t/t2d default to the identity when
    Vd == V."""
    def ours(key: str) -> str:
        return "midlayer." + key[len("layers.0."):] if key.startswith("layers.0.") else key

    params = {ours(k): (lambda k=k: reader.get(k)) for k in reader.keys()}
    if cfg.draft_vocab_size == cfg.vocab_size:
        params.setdefault("d2t", lambda: torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        params.setdefault("t2d", lambda: torch.ones(cfg.vocab_size, dtype=torch.bool))
    return params


def check_fits_target(cfg: Eagle3Config, target_cfg: Any, source: str = "EAGLE-3 drafter") -> None:
    """`target_cfg`: the target's HF config dict or any config with hidden_size / vocab_size."""
    get = (target_cfg.get("text_config", target_cfg).get if isinstance(target_cfg, dict)
           else lambda key: getattr(target_cfg, key))
    hidden, vocab = get("hidden_size"), get("vocab_size")
    if cfg.target_hidden_size != hidden:
        raise CheckpointError(f"{source}: fc expects 3 x target hidden size "
                              f"{cfg.target_hidden_size} (= {3 * cfg.target_hidden_size}), but "
                              f"the target's hidden size is {hidden} (= {3 * hidden})")
    if cfg.vocab_size != vocab:
        raise CheckpointError(f"{source}: d2t/t2d map a target vocab of {cfg.vocab_size}, but the "
                              f"target's vocab size is {vocab}")


def load_eagle3(path: str | os.PathLike, target_cfg: Any = None,
                embed_tokens: nn.Module | None = None,
                dtype: str | torch.dtype = "auto") -> Eagle3Drafter:
    """Load a `LlamaForCausalLMEagle3` directory; checks it fits `target_cfg` when given. The
    checkpoint's own `embed_tokens.weight`, if any, wins over the shared `embed_tokens`."""
    reader = CheckpointReader(path)
    archs = reader.config.get("architectures") or []
    if not set(archs) & set(ARCHITECTURES + ALIASES):
        raise CheckpointError(f"{path}: architectures {archs} is not an EAGLE-3 drafter "
                              f"({', '.join(ARCHITECTURES + ALIASES)})")
    cfg = Eagle3Config.from_hf(speculators_config(reader.config, str(path)))
    if target_cfg is not None:
        check_fits_target(cfg, target_cfg, source=str(path))
    own = "embed_tokens.weight" in reader
    if not own and embed_tokens is not None and embed_tokens.weight.shape[-1] != cfg.hidden_size:
        raise CheckpointError(f"{path}: shared embedding width {embed_tokens.weight.shape[-1]} != "
                              f"drafter hidden size {cfg.hidden_size}, no embed_tokens.weight")
    with torch.device("meta"):
        drafter = Eagle3Drafter(cfg, embed_tokens=None if own else embed_tokens, own_embedding=own)
    assign_params(drafter, checkpoint_to_params(reader, cfg), resolve_dtype(dtype), str(path))
    drafter.init_buffers()
    return drafter.eval()


def save_eagle3(drafter: Eagle3Drafter, out: str | os.PathLike) -> Path:
    """Write config.json + model.safetensors in the released layout."""
    return write_checkpoint(out, drafter.cfg.to_hf(), drafter.state_dict())


def make_tiny_eagle3(target_dir: str | os.PathLike, out: str | os.PathLike, seed: int = 0,
                     draft_vocab_size: int | None = None) -> Path:
    """A random drafter that fits the target in `target_dir` (shares its embedding); the draft
    vocab is a random sorted subset of Vd target ids (default V // 2). Captured layers: the usual
    (2, L//2, L-3), or (0, L//2, L-1) on targets too shallow for those to be distinct."""
    t = json.loads((Path(target_dir) / "config.json").read_text())
    t = t.get("text_config", t)
    h, v, n = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    vd = draft_vocab_size or max(v // 2, 1)
    if not 0 < vd <= v:
        raise ValueError(f"draft_vocab_size must be in 1..{v} (the target vocab), got {vd}")
    aux = [2, n // 2, n - 3] if n >= 7 else [0, n // 2, n - 1]
    # The drafter copies the target's attention geometry and rope; the rest is Llama's.
    cfg = Eagle3Config.from_hf({
        **t, "num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "intermediate_size": t.get("intermediate_size") or 2 * h,
        "draft_vocab_size": vd, "target_hidden_size": h,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}})
    g = torch.Generator().manual_seed(seed)
    drafter = Eagle3Drafter(cfg, own_embedding=False)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.02 * noise)
        ids = torch.randperm(v, generator=g)[:vd].sort().values
        drafter.d2t.copy_(ids - torch.arange(vd))
        drafter.t2d.copy_(torch.zeros(v, dtype=torch.bool).index_fill(0, ids, True))
    return save_eagle3(drafter, out)
