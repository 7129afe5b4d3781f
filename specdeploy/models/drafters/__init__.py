"""Drafter modules: EAGLE-3 and MTP heads (see docs/interfaces.md for the forward contract)."""
from __future__ import annotations

from typing import NamedTuple

import torch


class DraftOutput(NamedTuple):
    """What one draft step returns.

    hidden: [B,T,H] the drafter's hidden state that feeds its next draft step.
    logits: [B,T,V'] draft logits (V' is the draft vocab; EAGLE-3 maps ids back with `d2t`).
    """

    hidden: torch.Tensor
    logits: torch.Tensor


__all__ = ["DraftOutput"]
