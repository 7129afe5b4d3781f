"""Checkpoint formats: safetensors directories (single or sharded) and GGUF files."""
from __future__ import annotations

from specdeploy.checkpoint.reader import (
    CheckpointError,
    CheckpointReader,
    from_keys,
    open_checkpoint,
)

__all__ = ["CheckpointError", "CheckpointReader", "from_keys", "open_checkpoint"]
