"""The one error type of checkpoint loading (beneath every format module)."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or does not fit the model."""
