"""GLM-4.5's MTP layers (DeepSeek-V3 style), as vLLM's `glm4_moe_mtp.py` runs them (checked Dec
2026): layer j is the checkpoint's decoder layer `num_hidden_layers + j` (attention + MoE) with
`enorm`, `hnorm`, `eh_proj` [H, 2H] and `shared_head.norm` beside it. One draft step:

    e = embed(next_token), zero at position 0       # vLLM masks it there
    x = eh_proj(cat(enorm(e), hnorm(h)))              # the embedding half first
    x = decoder_layer(x)                              # the target's layer kinds, its own KV
    logits = lm_head(shared_head.norm(x))             # hidden for the next step: x, un-normed

`h` of the first step is the target's final-normed hidden (what vLLM's target returns); draft
step j runs layer j mod n (vLLM: `spec_step_idx % num_mtp_layers`). The embedding and LM head are
the target's (the DeepSeek-V3 report's shared modules; copies a checkpoint may hold under the
MTP layer are not read).
"""
from __future__ import annotations

import torch
from torch import nn

from specdeploy.models.drafters import Drafter, DraftOutput
from specdeploy.models.layers import RMSNorm, RotaryEmbedding


class SharedHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _layer(cfg, decoder_layer):
    layer = decoder_layer(cfg, cfg.num_hidden_layers)  # (an MoE layer, as the trailing ones)
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    layer.enorm, layer.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
    layer.eh_proj = nn.Linear(2 * h, h, bias=False)
    layer.shared_head = SharedHead(cfg)
    return layer


class MTP(Drafter):
    """`forward(hidden_states[B,T,H], input_embeds[B,T,H], position_ids[B,T], step=0)
    -> DraftOutput`; each of the `num_nextn_predict_layers` layers is a group.
    `decoder_layer(cfg, index)`: the target family's decoder layer (models/glm4_moe.py)."""

    group_policy = "cycle"

    def __init__(self, cfg, embed_tokens: nn.Module, lm_head: nn.Module, decoder_layer):
        super().__init__()
        self.cfg = cfg
        self.borrow(embed_tokens=embed_tokens, lm_head=lm_head)
        self.d2t = None
        n = max(1, cfg.num_nextn_predict_layers)
        self.layers = nn.ModuleList(_layer(cfg, decoder_layer) for _ in range(n))
        self.num_groups = n
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.rotary_dim)

    def init_buffers(self) -> None:
        self.rotary_emb.init_buffers()

    def forward(self, hidden_states: torch.Tensor, input_embeds: torch.Tensor,
                position_ids: torch.Tensor | None = None, step: int = 0) -> DraftOutput:
        if position_ids is None:
            b, t = hidden_states.shape[:2]
            position_ids = torch.arange(t, device=hidden_states.device).expand(b, t)
        cos, sin = self.rotary_emb(position_ids)
        layer = self.layers[self.group_of(step)]
        e = input_embeds.masked_fill((position_ids == 0)[..., None], 0.0)
        x = layer.eh_proj(torch.cat((layer.enorm(e), layer.hnorm(hidden_states)), -1))
        x = layer(x, cos, sin)
        return DraftOutput(x, self.output_logits(layer.shared_head.norm(x)))
