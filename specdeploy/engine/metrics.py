"""Per-request timing and engine-wide counters (`LLM.stats()`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestMetrics:
    """Times are `time.perf_counter()` seconds. `token_times[i]` is when output token i was made."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list, repr=False)
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens over the whole request (queueing and prefill included)."""
        lat = self.latency
        return len(self.token_times) / lat if lat else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first (the decode rate)."""
        n = len(self.token_times)
        if n < 2 or self.first_token_time is None:
            return None
        dt = self.token_times[-1] - self.first_token_time
        return (n - 1) / dt if dt > 0 else None

    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def summary(self) -> dict:
        return {"ttft": self.ttft, "latency": self.latency, "tokens_per_s": self.tokens_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s,
                "num_preemptions": self.num_preemptions}


@dataclass
class EngineStats:
    """Counters since the engine started. Speculative decoding adds its own fields later."""

    num_steps: int = 0
    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_errors: int = 0  # requests finished with "error" (a failure of theirs alone)
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    forward_tokens: int = 0  # tokens fed to the model (recomputation after preemption included)
    forward_time_s: float = 0.0
    step_time_s: float = 0.0
    max_running: int = 0

    def as_dict(self) -> dict:
        return asdict(self)
