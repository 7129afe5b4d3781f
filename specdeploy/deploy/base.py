"""What the engine sees of a deployed model (the runner contract)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdeploy.cache.metadata import BatchMetadata


@dataclass
class CacheLayout:
    """Sizes the engine allocates against: pages of `page_size` tokens and recurrent-state slots."""

    page_size: int
    num_pages: int
    num_slots: int
    bytes_by_handler: dict[str, int] = field(default_factory=dict)
    prefix_caching: bool = False  # the engine shares cached prefix pages (cache/prefix.py)
    recurrent: bool = False  # recurrent states: a prefix hit needs a checkpoint
    num_checkpoints: int = 0
    checkpoint_every: int = 1
    checkpoint_bytes: int = 0
    # the sliding-window page group (cache/window.py): 0 pages when the graph has none
    num_win_pages: int = 0
    window: int = 0
    page_bytes: int = 0  # one page of each group, all its layers (cache/plan.py)
    win_page_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_handler.values())


@dataclass
class StepOutput:
    logits: torch.Tensor  # [N, V] fp32, rows in `BatchMetadata.logits_idx` order
    hidden: torch.Tensor | None = None  # [N, Hc] captured features for drafters (spec only)


class DeployedModel(Protocol):
    """A model ready to run steps. `forward` is the whole hot path of a step."""

    vocab_size: int
    max_seq_len: int
    layout: CacheLayout
    hf_config: dict

    def forward(self, meta: BatchMetadata) -> StepOutput: ...
