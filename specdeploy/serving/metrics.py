"""Prometheus text exposition (format 0.0.4), written by hand: a few counters, gauges and
histograms do not justify a dependency.

Observations come from the engine thread and the HTTP handlers; rendering from the event loop;
one lock guards them all (every operation is a few dict updates).
"""
from __future__ import annotations

import bisect
import threading
from collections import defaultdict

PREFIX = "specdeploy_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last = +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for le, c in zip((*self.buckets, float("inf")), self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{"+Inf" if le == float("inf") else le}"}} {acc}')
        out += [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
        return out


class ServerMetrics:
    """Counters the server keeps itself; engine gauges and speculative counters are read from the
    engine's `stats_dict()` snapshot at render time."""

    def __init__(self):
        self._lock = threading.Lock()
        self.http = defaultdict(int)  # (endpoint, status) -> count
        self.finished = defaultdict(int)  # finish_reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def http_response(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.http[(endpoint, status)] += 1

    def request_added(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def tokens(self, n: int, ttft: float | None, itls: list[float]) -> None:
        with self._lock:
            self.generation_tokens += n
            if ttft is not None:
                self.ttft.observe(ttft)
            for x in itls:
                self.itl.observe(x)

    def request_finished(self, reason: str, latency: float) -> None:
        with self._lock:
            self.finished[reason] += 1
            self.e2e.observe(latency)

    def render(self, engine: dict, queue_len: int) -> str:
        """`engine` is a `stats_dict()` snapshot (speculative keys present with a drafter)."""
        out: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {PREFIX}{name} {help}")
            out.append(f"# TYPE {PREFIX}{name} {kind}")
            out.extend(f"{PREFIX}{name}{labels} {value}" for labels, value in samples)

        def hist(name: str, help: str, h: Histogram) -> None:
            out.append(f"# HELP {PREFIX}{name} {help}")
            out.append(f"# TYPE {PREFIX}{name} histogram")
            out.extend(h.lines(PREFIX + name))

        with self._lock:
            metric("http_requests_total", "counter", "HTTP responses by endpoint and status.",
                   [(f'{{endpoint="{e}",status="{s}"}}', c)
                    for (e, s), c in sorted(self.http.items())])
            metric("requests_total", "counter", "Finished engine requests by finish reason.",
                   [(f'{{finish_reason="{r}"}}', self.finished.get(r, 0))
                    for r in sorted({"stop", "length", "abort", *self.finished})])
            metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
                   [("", self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "Generated tokens.",
                   [("", self.generation_tokens)])
            hist("time_to_first_token_seconds", "From HTTP arrival to the first token.",
                 self.ttft)
            hist("inter_token_latency_seconds", "Time between consecutive output tokens.",
                 self.itl)
            hist("e2e_request_latency_seconds", "From HTTP arrival to the last token.", self.e2e)
        pages = engine.get("num_pages", 0)
        metric("num_requests_running", "gauge", "Requests in the running batch.",
               [("", engine.get("num_running", 0))])
        metric("num_requests_waiting", "gauge", "Admitted requests waiting for the batch "
               "(the queue that --max-queue bounds).", [("", queue_len)])
        metric("cache_pages_in_use", "gauge", "KV-cache pages held by requests.",
               [("", pages - engine.get("free_pages", pages))])
        metric("cache_pages_total", "gauge", "KV-cache pages.", [("", pages)])
        metric("preemptions_total", "counter", "Sequences preempted for lack of cache pages.",
               [("", engine.get("num_preemptions", 0))])
        if "prefix_cache_queries" in engine:
            _prefix_metrics(metric, out, engine)
        if "draft_steps" in engine:
            _spec_metrics(metric, engine)
        return "\n".join(out) + "\n"


def _prefix_metrics(metric, out: list[str], engine: dict) -> None:
    # vLLM's own names as well, so dashboards built for vLLM read them unchanged
    for name, key in (("queries", "prefix_cache_queries"), ("hits", "prefix_cache_hits")):
        out += [f"# TYPE vllm:prefix_cache_{name}_total counter",
                f"vllm:prefix_cache_{name}_total {engine.get(key, 0)}"]
    metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
           [("", engine["prefix_cache_queries"])])
    metric("prefix_cache_hits_total", "counter", "Of those, tokens found cached (not prefilled).",
           [("", engine.get("prefix_cache_hits", 0))])
    metric("prefix_cache_checkpoints_used", "gauge",
           "Recurrent-state checkpoint slots holding a cached page boundary.",
           [("", engine.get("checkpoints_used", 0))])
    metric("prefix_cache_checkpoints_total", "gauge", "Recurrent-state checkpoint slots.",
           [("", engine.get("checkpoint_slots", 0))])


def _spec_metrics(metric, engine: dict) -> None:
    metric("spec_num_draft_tokens", "gauge", "Draft tokens proposed per step (K).",
           [("", engine.get("num_draft_tokens", 0))])
    metric("spec_draft_steps_total", "counter", "Verify steps (one per drafting sequence).",
           [("", engine["draft_steps"])])
    metric("spec_draft_tokens_total", "counter", "Draft tokens proposed.",
           [("", engine.get("draft_tokens", 0))])
    metric("spec_accepted_tokens_total", "counter", "Draft tokens accepted.",
           [("", engine.get("accepted_tokens", 0))])
    metric("spec_accepted_tokens_per_position_total", "counter",
           "Draft tokens accepted at each draft position (0 = first).",
           [(f'{{position="{i}"}}', n)
            for i, n in enumerate(engine.get("accepted_per_position", []))])
    metric("spec_acceptance_rate", "gauge", "Accepted / proposed draft tokens.",
           [("", engine.get("acceptance_rate", 0.0))])
    metric("spec_mean_accepted_length", "gauge",
           "Tokens gained per target step of a decoding sequence (accepted + bonus).",
           [("", engine.get("mean_accepted_length", 0.0))])
    metric("spec_lookup_steps_total", "counter",
           "Verify steps whose drafts came (at least in part) from n-gram lookup.",
           [("", engine.get("lookup_steps", 0))])
    metric("spec_lookup_accepted_tokens_total", "counter",
           "Draft tokens accepted in those steps.",
           [("", engine.get("lookup_accepted_tokens", 0))])
    metric("spec_undrafted_steps_total", "counter",
           "Decode steps left without drafts by the draft confidence stop (draft_min_prob).",
           [("", engine.get("undrafted_steps", 0))])


def parse_text(text: str) -> dict[str, float]:
    """`name{labels}` -> value of a rendered exposition (for tests and the bench)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values
