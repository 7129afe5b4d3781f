"""Generic MTP head for a Llama-family target that ships none (e.g. SmolLM2), in Qwen3.5 naming.

Same math and forward contract as `qwen3_5_mtp.MTP` (DeepSeek-V3 style next-next-token module):
x = fc(cat(pre_fc_norm_embedding(emb(t_{p+1})), pre_fc_norm_hidden(h_p))), one decoder layer of
the target's own kind (Llama attention + gated MLP), hidden = norm(x), logits = the target's
shared LM head(hidden). `h_p` is the target's final-normed hidden state; the normed `hidden` feeds
the next draft step.

Stored as its own directory: `config.json` (`architectures: ["LlamaMTPHead"]`, the layer geometry,
`num_nextn_predict_layers`) + `model.safetensors` with `mtp.*` keys only. Unlike released Qwen3.5
checkpoints the norms are stored as plain weights (`norm_zero_centered: false`).

Optional draft vocabulary (`draft_vocab_size` in the config, `mtp.d2t` offsets as in EAGLE-3):
the head then drafts over those rows of the target's LM head only. A trained head was fitted
over its training vocab anyway, and every draft step reads Vd rows instead of the whole LM head
(SmolLM2: 6,144 of 49,152 rows, 14 MB instead of 113 MB in fp32).
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from specdeploy.checkpoint import CheckpointError, CheckpointReader
from specdeploy.checkpoint.tiny import write_checkpoint
from specdeploy.loading import assign_params, resolve_dtype
from specdeploy.models import llama
from specdeploy.models.drafters import Drafter, DraftOutput, whole_tiles
from specdeploy.models.layers import RMSNorm, RotaryEmbedding

ARCHITECTURES = ("LlamaMTPHead",)
PREFIX = "mtp."


class MTPHead(Drafter):
    """`forward(hidden_states[B,T,H], input_embeds[B,T,H], position_ids[B,T]) -> DraftOutput`.

    `embed_tokens` / `lm_head`: the target's modules, borrowed (not registered).
    """

    def __init__(self, cfg: llama.Config, embed_tokens: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.borrow(embed_tokens=embed_tokens, lm_head=lm_head)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps)
        self.pre_fc_norm_hidden = RMSNorm(h, eps)
        self.layers = nn.ModuleList([llama.DecoderLayer(cfg)])
        self.norm = RMSNorm(h, eps)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.head_dim)
        # Draft vocab (set_draft_vocab): its LM-head rows, and d2t offsets to the target's ids
        self.draft_head: nn.Linear | None = None
        self.d2t: torch.Tensor | None = None

    def init_buffers(self) -> None:
        self.rotary_emb.init_buffers()

    def set_draft_vocab(self, draft_ids: torch.Tensor, multiple: int = 1) -> None:
        """Draft over these target ids only (sorted): a copy of their LM-head rows; `multiple`
        as `Drafter.set_draft_vocab`'s."""
        ids = torch.as_tensor(draft_ids, dtype=torch.long).sort().values
        head = self.borrowed.pop("lm_head")  # NOTE: its rows are copied; it is not read after
        ids = whole_tiles(ids, head.weight.shape[0], multiple)
        w = head.weight.detach()[ids.to(head.weight.device)].clone()
        self.draft_head = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device,
                                    dtype=w.dtype)
        with torch.no_grad():
            self.draft_head.weight.copy_(w)
        self.draft_head.requires_grad_(False)
        self.d2t = ids - torch.arange(ids.shape[0])

    def fuse(self, hidden_states: torch.Tensor, input_embeds: torch.Tensor) -> torch.Tensor:
        x = torch.cat((self.pre_fc_norm_embedding(input_embeds.to(hidden_states.dtype)),
                       self.pre_fc_norm_hidden(hidden_states)), -1)
        return self.fc(x)

    def forward(self, hidden_states: torch.Tensor, input_embeds: torch.Tensor,
                position_ids: torch.Tensor | None = None, step: int = 0) -> DraftOutput:
        if position_ids is None:
            b, t = hidden_states.shape[:2]
            position_ids = torch.arange(t, device=hidden_states.device).expand(b, t)
        cos, sin = self.rotary_emb(position_ids)
        x = self.layers[step % len(self.layers)](self.fuse(hidden_states, input_embeds), cos, sin)
        hidden = self.norm(x)
        if self.draft_head is not None:  # logits over the draft vocab (map with d2t)
            return DraftOutput(hidden, self.draft_head(hidden))
        return DraftOutput(hidden, self.output_logits(hidden))


def _target_parts(target: nn.Module) -> tuple[llama.Config, nn.Module, nn.Module]:
    cfg = getattr(target, "cfg", None)
    if not isinstance(cfg, llama.Config):
        raise CheckpointError(f"generic MTP head: only Llama-family targets are supported, got "
                              f"{type(target).__name__} (hybrids ship their own MTP heads)")
    return cfg, target.model.embed_tokens, target.lm_head


def make_mtp_head(target: nn.Module, init_from_target: bool = True) -> MTPHead:
    """A fresh head for `target`; by default its layer / norm start as the target's last layer /
    final norm and `fc` passes the hidden half through (the head starts as a 1-extra-layer copy
    of the target's top, which trains much faster than a random init)."""
    cfg, emb, head = _target_parts(target)
    mtp = MTPHead(cfg, emb, head).to(emb.weight.dtype)
    if init_from_target:
        h = cfg.hidden_size
        with torch.no_grad():
            ours, theirs = mtp.layers[0].state_dict(), target.model.layers[-1].state_dict()
            # every tensor of the same name and shape (a Qwen3-MoE last layer's experts are not
            # the head's dense MLP: that keeps its init)
            mtp.layers[0].load_state_dict({k: theirs[k] if k in theirs and theirs[k].shape ==
                                           v.shape else v for k, v in ours.items()})
            mtp.norm.weight.copy_(target.model.norm.weight)
            mtp.fc.weight.zero_()
            mtp.fc.weight[:, h:].copy_(torch.eye(h))
            mtp.fc.weight[:, :h].normal_(0.0, 0.02)
    return mtp


def head_config(cfg: llama.Config) -> dict:
    hf = {"architectures": list(ARCHITECTURES), "model_type": "llama_mtp_head",
          "num_nextn_predict_layers": 1, "norm_zero_centered": False,
          "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
          "intermediate_size": cfg.intermediate_size,
          "num_attention_heads": cfg.num_attention_heads,
          "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
          "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": cfg.hidden_act,
          "attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias,
          "rope_theta": cfg.rope.theta, "max_position_embeddings": cfg.max_position_embeddings}
    if cfg.rope.rope_type != "default":
        r = cfg.rope
        hf["rope_scaling"] = {
            "rope_type": r.rope_type, "factor": r.factor, "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings}
    return hf


def save_mtp_head(mtp: MTPHead, out: str | os.PathLike, dtype: torch.dtype | None = None,
                  extra_config: dict | None = None) -> Path:
    """The head's own weights (`mtp.*`); with a draft vocab, `mtp.d2t` and `draft_vocab_size`
    (its LM-head rows are the target's, so they are not stored)."""
    sd = {PREFIX + k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
          for k, v in mtp.state_dict().items()
          if not k.endswith("inv_freq") and not k.startswith("draft_head.")}
    cfg = {**head_config(mtp.cfg), **(extra_config or {})}
    if mtp.d2t is not None:
        sd[PREFIX + "d2t"] = mtp.d2t.clone()
        cfg["draft_vocab_size"] = int(mtp.d2t.shape[0])
    return write_checkpoint(out, cfg, sd)


def load_mtp_head(path: str | os.PathLike, target: nn.Module,
                  dtype: str | torch.dtype = "auto") -> MTPHead:
    """Load a head saved by `save_mtp_head` next to `target` (shared embedding / LM head)."""
    reader = CheckpointReader(path)
    hf = reader.config
    if not set(hf.get("architectures") or []) & set(ARCHITECTURES):
        raise CheckpointError(f"{path}: architectures {hf.get('architectures')} is not an MTP "
                              f"head ({', '.join(ARCHITECTURES)})")
    tcfg, emb, head = _target_parts(target)
    if hf.get("norm_zero_centered"):
        raise CheckpointError(f"{path}: zero-centred norms are not supported in a generic head")
    want = {"hidden_size": tcfg.hidden_size, "vocab_size": tcfg.vocab_size}
    bad = {k: (hf.get(k), v) for k, v in want.items() if hf.get(k) != v}
    if bad:
        raise CheckpointError(f"{path}: MTP head does not fit the target: " + ", ".join(
            f"{k} head {a} vs target {b}" for k, (a, b) in bad.items()))
    # The layer geometry is the head's own (it may differ from the target's in width).
    cfg = replace(llama.Config.from_hf({**hf, "num_hidden_layers": 1}),
                  tie_word_embeddings=tcfg.tie_word_embeddings)
    with torch.device("meta"):
        mtp = MTPHead(cfg, emb, head)
    params = {k[len(PREFIX):]: (lambda k=k: reader.get(k)) for k in reader.keys()
              if k.startswith(PREFIX) and k != PREFIX + "d2t"}
    assign_params(mtp, params, resolve_dtype(dtype), str(path))
    mtp.init_buffers()
    if PREFIX + "d2t" in reader.keys():
        d2t = reader.get(PREFIX + "d2t").long()
        n = hf.get("draft_vocab_size", d2t.shape[0])
        ids = d2t + torch.arange(d2t.shape[0])
        if d2t.dim() != 1 or d2t.shape[0] != n or ids.min() < 0 or ids.max() >= tcfg.vocab_size:
            raise CheckpointError(f"{path}: mtp.d2t does not map {n} draft ids into the "
                                  f"target's vocab of {tcfg.vocab_size}")
        from specdeploy.ops.ggml_tiled import TILE

        mtp.set_draft_vocab(ids, multiple=TILE)  # (whole tiles: the tiled kernel)
    return mtp.eval()
