"""Drafter training: `specdeploy train-drafter` (EAGLE-3 / MTP heads on a frozen target)."""
from __future__ import annotations
