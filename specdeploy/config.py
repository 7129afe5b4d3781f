"""Frozen, validated configuration dataclasses of the public API."""
from __future__ import annotations

from dataclasses import dataclass

SPEC_METHODS = ("mtp", "eagle3")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: `method` drafts `num_draft_tokens` (K) tokens per step.

    `draft_model` is the EAGLE-3 drafter checkpoint (MTP heads come from the target checkpoint);
    `capture_layers` overrides which target layers feed an EAGLE-3 drafter.
    """

    method: str
    num_draft_tokens: int = 3
    draft_model: str | None = None
    capture_layers: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ValueError(f"method: must be one of {', '.join(SPEC_METHODS)}, "
                             f"got {self.method!r}")
        k = self.num_draft_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"num_draft_tokens: must be an integer in 1..16, got {k!r}")
        if self.capture_layers is not None:
            layers = tuple(self.capture_layers)
            if not layers or any(not isinstance(i, int) or i < 0 for i in layers):
                raise ValueError(f"capture_layers: must be non-negative layer indices, "
                                 f"got {self.capture_layers!r}")
            object.__setattr__(self, "capture_layers", layers)
        if self.draft_model is not None:
            object.__setattr__(self, "draft_model", str(self.draft_model))
