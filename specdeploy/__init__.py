"""specdeploy: deploy HF-style checkpoints for fast, lossless speculative decoding."""
from __future__ import annotations

from specdeploy.config import SpecConfig
from specdeploy.engine.request import RequestOutput, SamplingParams
from specdeploy.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecConfig"]
