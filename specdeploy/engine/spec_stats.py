"""The speculative engine's acceptance counters (`SpecEngine.stats_dict`, `LLM.stats()`)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Acceptance counters. mean accepted length = 1 + accepted / (draft steps + undrafted
    steps): tokens per target forward of a decoding sequence, bonus included."""

    k: int
    max_k: int = 0  # most drafts in one verify segment (lookup may draft more than K); 0: K
    draft_steps: int = 0  # verify segments
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    lookup_steps: int = 0  # verify segments whose drafts came from n-gram lookup
    lookup_accepted_tokens: int = 0
    store_steps: int = 0  # of which the suffix store's (engine/suffix_store.py)
    store_accepted_tokens: int = 0
    undrafted_steps: int = 0  # decode steps left without drafts by the confidence stop
    controlled_steps: int = 0  # decode steps the cost controller left without drafts
    batch_off_steps: int = 0  # decode steps at a batch size where speculation is off
    steps_by_num_drafts: list[int] = field(default_factory=list)  # decode steps by drafts

    def __post_init__(self):
        self.max_k = max(self.max_k, self.k)
        self.accepted_per_position = [0] * self.max_k
        self.steps_by_num_drafts = [0] * (self.max_k + 1)

    def reset(self, max_k: int) -> None:
        """Fresh counters in place (the draft sources hold this object)."""
        self.__init__(self.k, max_k)

    def as_dict(self) -> dict:
        n = self.draft_steps + self.undrafted_steps + self.controlled_steps + self.batch_off_steps
        steps = max(n, 1)
        return {
            "num_draft_tokens": self.k, "draft_steps": self.draft_steps,
            "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / max(self.draft_tokens, 1),
            "mean_accepted_length": 1 + self.accepted_tokens / steps if n else 0.0,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_per_position": [a / steps for a in self.accepted_per_position],
            "lookup_steps": self.lookup_steps,
            "lookup_accepted_tokens": self.lookup_accepted_tokens,
            "store_steps": self.store_steps,
            "store_accepted_tokens": self.store_accepted_tokens,
            "undrafted_steps": self.undrafted_steps,
            "controlled_steps": self.controlled_steps,
            "batch_off_steps": self.batch_off_steps,
            "steps_by_num_drafts": list(self.steps_by_num_drafts),
        }
