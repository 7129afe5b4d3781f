"""The periodic one-line speculative-decoding log (as vLLM's "SpecDecoding metrics" line): over
the last interval, the mean acceptance length, accepted / drafted throughput and the acceptance
rate at each draft position. Nothing is logged for an interval without drafts."""
from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("specdeploy.serving")


class SpecDecodingLogger:
    """Feed it engine snapshots (`stats_dict()`); it answers the line for the interval since
    the previous one, or None (no speculation, or no drafts since)."""

    def __init__(self):
        self._last: dict | None = None
        self._last_t = 0.0

    def line(self, snapshot: dict, now: float) -> str | None:
        if "draft_steps" not in snapshot:
            return None
        prev, dt = self._last, now - self._last_t
        cur = {"drafts": snapshot.get("draft_steps", 0),
               "draft_tokens": snapshot.get("draft_tokens", 0),
               "accepted": snapshot.get("accepted_tokens", 0),
               "per_pos": list(snapshot.get("accepted_per_position", []))}
        self._last, self._last_t = cur, now
        if prev is None:
            prev = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
        drafts = cur["drafts"] - prev["drafts"]
        if drafts <= 0:
            return None
        drafted = cur["draft_tokens"] - prev["draft_tokens"]
        accepted = cur["accepted"] - prev["accepted"]
        old = prev["per_pos"] + [0] * (len(cur["per_pos"]) - len(prev["per_pos"]))
        per_pos = [(a - b) / drafts for a, b in zip(cur["per_pos"], old)]
        rate = accepted / drafted if drafted else 0.0
        dt = dt if dt > 0 else float("nan")
        return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Accepted throughput: {accepted / dt:.2f} tokens/s, "
                f"Drafted throughput: {drafted / dt:.2f} tokens/s, "
                f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                f"Per-position acceptance rate: {', '.join(f'{p:.3f}' for p in per_pos)}, "
                f"Avg Draft acceptance rate: {100 * rate:.1f}%")


async def run_periodically(snapshot, interval: float, emit=log.info) -> None:
    """Log the line every `interval` seconds until cancelled (`snapshot()` → stats_dict)."""
    logger = SpecDecodingLogger()
    logger.line(snapshot(), time.monotonic())  # the baseline: count from now
    while True:
        await asyncio.sleep(interval)
        text = logger.line(snapshot(), time.monotonic())
        if text is not None:
            emit(text)
