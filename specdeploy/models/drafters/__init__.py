"""Drafter modules: EAGLE-3 and MTP heads (see docs/interfaces.md for the forward contract).

`Drafter` is what a one-model deployment needs of any of them (EAGLE-3, trained MTP heads,
checkpoint MTP modules): `embed`, `project` (captured target features → its hidden input),
`borrowed` (the target's modules it reads, e.g. embedding and LM head, which it does not own),
`d2t` (draft-vocab offsets to target ids, None when it drafts over the target's vocabulary) and
`forward(hidden, embeds, position_ids, step) -> DraftOutput`.

A checkpoint's MTP module may hold several groups of layers (`num_groups`, one per
`num_nextn_predict_layers` / `mtp_num_hidden_layers`); draft step j runs group `group_of(j)` and
a deployment exports one program (with its own paged KV) per group. EAGLE-3 and trained MTP
heads have one group.
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


GROUP_POLICIES = ("last", "cycle")


def group_of(step: int, num_groups: int, policy: str) -> int:
    """The group that drafts step `step` (0-based): "last" = min(step, G-1) (group j at step j,
    the last group once they run out), "cycle" = step mod G. Both agree while step < G."""
    if policy not in GROUP_POLICIES:
        raise ValueError(f"MTP group policy: one of {GROUP_POLICIES}, got {policy!r}")
    return min(step, num_groups - 1) if policy == "last" else step % num_groups


class Drafter(nn.Module):
    """Base of every drafter module. Subclasses call `borrow(...)`, set `d2t` (a buffer or None)
    and define `forward`; multi-group MTP modules set `num_groups` and `group_policy`."""

    num_groups: int = 1
    group_policy: str = "last"

    def __init__(self):
        super().__init__()
        self.borrowed = Borrowed()

    def group_of(self, step: int) -> int:
        return group_of(step, self.num_groups, self.group_policy)

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
        head = self._modules.get("draft_head")  # set_draft_vocab: logits over the draft vocab
        if head is not None:
            return head(hidden)
        return F.linear(hidden, self.borrowed["lm_head"].weight)

    def set_draft_vocab(self, draft_ids: torch.Tensor, multiple: int = 1) -> None:
        """Draft over these target ids only: a copy of their LM-head rows, and `d2t` offsets
        that map draft ids back (EAGLE-3's convention; the deployment maps argmaxes and q).
        A drafter step on a CPU is bound by reading the LM head: a 49k x 256 fp32 head is
        50 MB, 8k rows of it 8 MB. Lossless whatever the set: the target verifies.
        `multiple`: the set grows to a multiple of it with the lowest target ids it lacks
        (`whole_tiles`; the deployment's 16: whole tiles of the tiled kernel)."""
        ids = torch.as_tensor(draft_ids, dtype=torch.long).unique().sort().values
        head = self.borrowed.pop("lm_head")  # NOTE: its rows are copied; it is not read after
        ids = whole_tiles(ids, head.weight.shape[0], multiple)
        w = head.weight.detach()[ids.to(head.weight.device)].clone()
        self.draft_head = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device,
                                    dtype=w.dtype)
        with torch.no_grad():
            self.draft_head.weight.copy_(w)
        self.draft_head.requires_grad_(False)
        self.d2t = ids - torch.arange(ids.shape[0])


def whole_tiles(ids: torch.Tensor, vocab: int, multiple: int) -> torch.Tensor:
    """Sorted draft-vocabulary ids grown to a multiple of `multiple` with the lowest of the
    target's `vocab` ids they lack. NOTE: hybrid-demo's 8,175-token draft head ran on the
    integer-dot kernel, its 8,176-token one on the tiled kernel (whole 16-output tiles): 0.17 ->
    0.16 ms at 1 row, 0.22 -> 0.17 ms at 2, cache-cold, 2 cores (2026-12-07). Lossless: each
    draft id still maps to one target id, and the target verifies whatever is drafted."""
    short = -ids.numel() % multiple
    if not short:
        return ids
    free = torch.ones(vocab, dtype=torch.bool)
    free[ids] = False
    return torch.cat((ids, free.nonzero()[:short, 0])).sort().values


__all__ = ["GROUP_POLICIES", "Borrowed", "DraftOutput", "Drafter", "group_of", "whole_tiles"]
