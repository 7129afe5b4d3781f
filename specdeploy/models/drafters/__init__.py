"""Drafter modules: EAGLE-3 and MTP heads (see docs/interfaces.md for the forward contract).

`Drafter` is what a one-model deployment needs of any of them (EAGLE-3, trained MTP heads,
checkpoint MTP modules): `embed`, `project` (captured target features → its hidden input),
`borrowed` (the target's modules it reads, e.g. embedding and LM head, which it does not own),
`d2t` (draft-vocab offsets to target ids, None when it drafts over the target's vocabulary) and
`forward(hidden, embeds, position_ids, step) -> DraftOutput`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class DraftOutput(NamedTuple):
    """What one draft step returns.

    hidden: [B,T,H] the drafter's hidden state that feeds its next draft step.
    logits: [B,T,V'] draft logits (V' is the draft vocab; EAGLE-3 maps ids back with `d2t`).
    """

    hidden: torch.Tensor
    logits: torch.Tensor


class Borrowed(dict):
    """Target modules a drafter reads but does not own: outside its module tree (not its
    parameters, not in its state_dict, not cast by `.to`), and shared, never copied, by deepcopy."""

    def __deepcopy__(self, memo) -> Borrowed:
        return Borrowed(self)


class Drafter(nn.Module):
    """Base of every drafter module. Subclasses call `borrow(...)`, set `d2t` (a buffer or None)
    and define `forward`."""

    def __init__(self):
        super().__init__()
        self.borrowed = Borrowed()

    def borrow(self, **modules: nn.Module | None) -> None:
        self.borrowed.update({k: m for k, m in modules.items() if m is not None})

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.borrowed["embed_tokens"].weight)

    def project(self, captured: torch.Tensor) -> torch.Tensor:
        """Captured target features [N, Hc] → the hidden input of the first draft step."""
        return captured.to(self.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.borrowed["lm_head"].weight)


__all__ = ["Borrowed", "DraftOutput", "Drafter"]
