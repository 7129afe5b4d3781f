"""Synthetic cost models and stand-in sequences for the speculation controller's tests
(test_spec_controller*.py, test_spec_cost_context.py, test_suffix.py)."""
from __future__ import annotations


class Linear:
    """Synthetic costs: a target forward `fixed + per_row * rows`, a drafter forward `draft`."""

    def __init__(self, fixed: float, per_row: float, draft: float):
        self.fixed, self.per_row, self.draft = fixed, per_row, draft

    def target_s(self, rows: int) -> float:
        return self.fixed + self.per_row * rows

    def draft_s(self, rows: int) -> float:
        return self.draft


NEVER = Linear(0.0, 1.0, 1.0)  # a draft costs a whole row and a forward: E(k) < 1 + k
FREE = Linear(1.0, 0.0, 0.0)  # drafts cost nothing: any acceptance > 0 pays for all K
MIXED = Linear(1.0, 0.08, 0.25)  # CPU-like: a few drafts pay at good acceptance only


class RowCost(Linear):
    """A drafter forward that costs by rows (`per_draft_row` each), as a long catch-up does."""

    def __init__(self, fixed, per_row, draft, per_draft_row):
        super().__init__(fixed, per_row, draft)
        self.per_draft_row = per_draft_row

    def draft_s(self, rows: int) -> float:
        return self.draft + self.per_draft_row * rows


class _Spec:
    def __init__(self, copied=0):
        self.control, self.lookup_copy = None, copied
        self.drafts, self.draft_probs, self.from_lookup = [], None, False


class _Seq:
    def __init__(self, copied=0):
        self.spec = _Spec(copied)
