"""Qwen3.5 (and Qwen3-Next) MTP head: one full-attention MoE decoder layer on top of the target.

Checked against vLLM `qwen3_5_mtp.py` / `qwen3_next_mtp.py` and SGLang `qwen3_next_mtp.py`:
- Input: `hidden_states` is the target's *final-normed* last hidden state (what the target feeds
  its LM head; vLLM/SGLang pass the model's normed output to the proposer), `input_embeds` the
  target embedding of the next token.
- `fc` [H, 2H] is applied to cat(pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h)): embedding
  first. Then `layers[step % n]` (a full-attention decoder layer with MoE) and `norm`: with
  `mtp_num_hidden_layers` = n > 1, vLLM's `qwen3_next_mtp.py` picks
  `layers[spec_step_idx % num_mtp_layers]` (as its `deepseek_mtp.py` does), so draft step j runs
  layer j mod n here (`group_policy = "cycle"`); `fc` and the norms are shared by all steps.
- Output: `hidden` is *after* `mtp.norm` (vLLM returns the normed state, feeds it to the LM head
  and, as the drafter's hidden, to the next draft step); logits = shared LM head(hidden).
- All MTP RMSNorms (pre_fc_norm_*, norm, the layer's norms, q/k norms) are stored zero-centred
  (GemmaRMSNorm / `1 + w` in vLLM/SGLang); the loader converts them to plain weights.
- Embedding and LM head are the target's (`mtp_use_dedicated_embeddings` is false in releases).
"""
from __future__ import annotations

import torch
from torch import nn

from specdeploy.models.drafters import Drafter, DraftOutput
from specdeploy.models.layers import RMSNorm
from specdeploy.models.qwen3_5_blocks import Config, DecoderLayer
from specdeploy.ops import rope_cos_sin


class MTP(Drafter):
    """`forward(hidden_states[B,T,H], input_embeds[B,T,H], position_ids[B,T], step=0)
    -> DraftOutput`; each of the `mtp_num_hidden_layers` layers is a group (`group_of(step)`).

    `embed_tokens` / `lm_head` are the target's modules (anything with `.weight` [V, H]),
    borrowed: outside the module tree, so not this drafter's parameters.
    """

    group_policy = "cycle"

    def __init__(self, cfg: Config, embed_tokens: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.borrow(embed_tokens=embed_tokens, lm_head=lm_head)
        self.d2t = None
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps)
        self.pre_fc_norm_hidden = RMSNorm(h, eps)
        n = max(1, cfg.mtp_num_hidden_layers)
        self.layers = nn.ModuleList(DecoderLayer(cfg, "full_attention") for _ in range(n))
        self.num_groups = n
        self.norm = RMSNorm(h, eps)
        self.register_buffer("inv_freq", cfg.rope_inv_freq(), persistent=False)

    def init_buffers(self) -> None:
        self.inv_freq = self.cfg.rope_inv_freq()  # computed, never stored in checkpoints

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_embeds: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        step: int = 0,
    ) -> DraftOutput:
        if position_ids is None:
            b, t = hidden_states.shape[:2]
            position_ids = torch.arange(t, device=hidden_states.device).expand(b, t)
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, self.cfg.mrope_section,
                                self.cfg.mrope_interleaved)
        x = torch.cat(
            (self.pre_fc_norm_embedding(input_embeds), self.pre_fc_norm_hidden(hidden_states)), -1
        )
        x = self.layers[self.group_of(step)](self.fc(x), cos, sin)
        hidden = self.norm(x)
        return DraftOutput(hidden, self.output_logits(hidden))
