"""NemotronH multi-token-prediction head (Nemotron 3 Super style).

Checkpoint layout: one MTP group per `num_nextn_predict_layers`, each `mtp_hybrid_override_pattern`
long ("*E": attention then MoE), numbered flat: group g is `mtp.layers.{gL .. gL+L-1}`. The first
layer of a group also holds `enorm`, `hnorm`, `eh_proj` [H, 2H]; the last holds `final_layernorm`.

One draft step (as vLLM's `nemotron_h_mtp.py` and SGLang compute it; checked Nov 2026):
    x = eh_proj(cat(enorm(embed(next_token)), hnorm(h)))     # embedding half first, as DeepSeek
    for each layer of the group: x = x + mixer(norm(x))      # the target's block, no RoPE
    hidden = final_layernorm(x);  logits = lm_head(hidden)   # shared lm_head, no extra norm
`hidden` is post-`final_layernorm` and is what the next draft step gets as `h` (vLLM feeds back
the layer-stack output). The first step's `h` is the target's final-normed (`norm_f`) hidden.
Several groups (checked Dec 2026): vLLM's `nemotron_h_mtp.py` asserts num_nextn_predict_layers
== 1; TensorRT-LLM's "MTP vanilla" (blog 2, DeepSeek-R1 MTP) applies module j at draft step j,
each module with its own KV, for as many steps as there are modules. Nothing defines a step past
the last group, so draft step j runs group min(j, G-1) (`group_policy = "last"`): a group >= 1
was trained on an MTP output as its `h`, which is what later steps feed it, whereas group 0
expects the target's hidden. Each group is its own deployed program with its own paged KV.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from specdeploy.models.drafters import Drafter, DraftOutput
from specdeploy.models.layers import RMSNorm
from specdeploy.models.nemotron_h_blocks import Block

if TYPE_CHECKING:
    from specdeploy.models.nemotron_h_config import Config


class MTPLayer(Block):
    def __init__(self, cfg: Config, kind: str, first: bool, last: bool):
        super().__init__(cfg, kind)
        if first:
            self.enorm = RMSNorm(cfg.hidden_size, cfg.eps)
            self.hnorm = RMSNorm(cfg.hidden_size, cfg.eps)
            self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        if last:
            self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.eps)


class MTP(Drafter):
    """`forward(hidden_states[B,T,H], input_embeds[B,T,H], position_ids, step=0) -> DraftOutput`.

    `embed_tokens` / `lm_head` are the target's modules, borrowed (not this module's parameters).
    """

    def __init__(self, cfg: Config, embed_tokens: nn.Module, lm_head: nn.Module):
        super().__init__()
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError("NemotronH MTP: the config has num_nextn_predict_layers = 0")
        kinds, n = cfg.mtp_block_types, len(cfg.mtp_block_types)
        self.group_len = n
        self.num_groups = cfg.num_nextn_predict_layers
        self.layers = nn.ModuleList(
            MTPLayer(cfg, kinds[i % n], first=i % n == 0, last=i % n == n - 1)
            for i in range(cfg.num_nextn_predict_layers * n))
        self.borrow(embed_tokens=embed_tokens, lm_head=lm_head)
        self.d2t = None

    def forward(self, hidden_states: torch.Tensor, input_embeds: torch.Tensor,
                position_ids: torch.Tensor | None = None, step: int = 0) -> DraftOutput:
        start = self.group_of(step) * self.group_len
        group = self.layers[start:start + self.group_len]
        first = group[0]
        x = first.eh_proj(torch.cat([first.enorm(input_embeds), first.hnorm(hidden_states)], -1))
        for layer in group:
            x = layer(x)
        hidden = group[-1].final_layernorm(x)
        return DraftOutput(hidden, self.output_logits(hidden))
