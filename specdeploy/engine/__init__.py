"""Requests, scheduling, sampling and the step loop (see engine.py)."""
from __future__ import annotations

from specdeploy.engine.engine import Engine
from specdeploy.engine.request import RequestOutput, SamplingParams, Sequence

__all__ = ["Engine", "RequestOutput", "SamplingParams", "Sequence"]
