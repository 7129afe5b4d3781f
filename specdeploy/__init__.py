"""specdeploy: deploy HF-style checkpoints for fast, lossless speculative decoding."""
from __future__ import annotations

from specdeploy.config import SpecConfig
from specdeploy.engine.request import RequestOutput, SamplingParams
from specdeploy.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecConfig", "load_model", "load_tokenizer"]

# Loaders resolve on first use: `import specdeploy` stays light for the CLI and the server.
_LAZY = {"load_model": "specdeploy.loading", "load_tokenizer": "specdeploy.tokenizer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specdeploy' has no attribute {name!r}")
