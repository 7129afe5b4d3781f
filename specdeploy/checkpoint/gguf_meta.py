"""A GGUF file's architecture-prefixed metadata (`{arch}.{key}`), as the per-architecture
modules (gguf_llama.py, gguf_nemotron_h.py, gguf_qwen3_5.py) read it."""
from __future__ import annotations

import re

from specdeploy.checkpoint.errors import CheckpointError

BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def table_name(gguf_name: str, top: dict[str, str], layer: dict[str, str]) -> str | None:
    """A GGUF tensor's HF name from two tables: whole names (`token_embd.weight`) and block
    tails (`blk.N.<tail>` -> `model.layers.N.<layer[tail]>`); None for anything else."""
    if gguf_name in top:
        return top[gguf_name]
    m = BLK.match(gguf_name)
    if m is None or m.group(2) not in layer:
        return None
    return f"model.layers.{m.group(1)}.{layer[m.group(2)]}"


def joined_gate_up(reader, hf_suffix: str) -> dict[str, tuple[list[str], int]]:
    """Each block's routed experts' fused gate | up projection [E, 2I, H] (gate rows first),
    under `model.layers.N.<hf_suffix>`, from the converter's stacked `ffn_gate_exps` /
    `ffn_up_exps`."""
    out = {}
    for name in reader.tensor_infos:
        m = BLK.match(name)
        up = f"blk.{m.group(1)}.ffn_up_exps.weight" if m else None
        if m and m.group(2) == "ffn_gate_exps.weight" and up in reader.tensor_infos:
            out[f"model.layers.{m.group(1)}.{hf_suffix}"] = ([name, up], 1)
    return out


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
