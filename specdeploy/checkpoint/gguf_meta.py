"""A GGUF file's architecture-prefixed metadata (`{arch}.{key}`), as the per-architecture
modules (gguf_llama.py, gguf_nemotron_h.py, gguf_qwen3_5.py) read it."""
from __future__ import annotations

from specdeploy.checkpoint.errors import CheckpointError


class ArchMeta:
    def __init__(self, reader, arch: str | None = None):
        self.md, self.path = reader.metadata, reader.path
        self.arch = arch or self.md["general.architecture"]

    def get(self, key: str, default=None):
        return self.md.get(f"{self.arch}.{key}", default)

    def need(self, key: str):
        """The value, or CheckpointError naming the missing key."""
        if f"{self.arch}.{key}" not in self.md:
            raise CheckpointError(f"{self.path}: GGUF metadata lacks {self.arch}.{key}")
        return self.md[f"{self.arch}.{key}"]

    def blocks(self) -> tuple[int, int]:
        """(transformer blocks, of them trailing MTP blocks: `nextn_predict_layers`)."""
        return int(self.need("block_count")), int(self.get("nextn_predict_layers", 0) or 0)
