"""Prometheus metrics through `prometheus_client`, on a registry of the server's own (two apps in
one process, as in the tests, never share counters).

Names are vLLM's (`vllm:` prefix, `model_name` and `engine` labels), so dashboards and scripts
built for vLLM read them unchanged. The `specdeploy_` names of the previous release stay as
aliases (no labels) for one more release.

Observations made here (tokens, latencies, finished requests, HTTP responses) come from the
engine thread and the HTTP handlers; prometheus_client's metrics are thread-safe. What the engine
counts itself (running / waiting requests, cache pages, preemptions, speculative and prefix-cache
counters) is read from its `stats_dict()` snapshot when /metrics is scraped.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    def __init__(self, model_name: str = "model"):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.labels = (model_name, "0")
        v = dict(labelnames=LABELS, registry=r)
        self.v_prompt = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.", **v)
        self.v_gen = Counter("vllm:generation_tokens", "Generated tokens.", **v)
        self.v_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                 labelnames=(*LABELS, "finished_reason"), registry=r)
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds",
                                "From HTTP arrival to the first token.", buckets=TTFT_BUCKETS, **v)
        self.v_itl = Histogram("vllm:inter_token_latency_seconds",
                               "Time between consecutive output tokens.", buckets=ITL_BUCKETS, **v)
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds",
                               "From HTTP arrival to the last token.", buckets=E2E_BUCKETS, **v)
        for reason in FINISH_REASONS:  # present at 0 before the first request
            self.v_success.labels(*self.labels, reason)
        # the previous release's names (aliases)
        self.http = Counter("specdeploy_http_requests", "HTTP responses by endpoint and status.",
                            labelnames=("endpoint", "status"), registry=r)
        self.finished = Counter("specdeploy_requests", "Finished engine requests by finish "
                                "reason.", labelnames=("finish_reason",), registry=r)
        for reason in FINISH_REASONS:
            self.finished.labels(reason)
        self.prompt = Counter("specdeploy_prompt_tokens", "Prompt tokens of admitted requests.",
                              registry=r)
        self.gen = Counter("specdeploy_generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram("specdeploy_time_to_first_token_seconds",
                              "From HTTP arrival to the first token.", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("specdeploy_inter_token_latency_seconds",
                             "Time between consecutive output tokens.", buckets=ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("specdeploy_e2e_request_latency_seconds",
                             "From HTTP arrival to the last token.", buckets=E2E_BUCKETS,
                             registry=r)
        self._engine: dict = {}
        self._queue_len = 0
        self._render_lock = threading.Lock()
        r.register(_EngineCollector(self))

    # ---- observations ---------------------------------------------------------------------------
    def http_response(self, endpoint: str, status: int) -> None:
        self.http.labels(endpoint, str(status)).inc()

    def request_added(self, prompt_tokens: int) -> None:
        self.v_prompt.labels(*self.labels).inc(prompt_tokens)
        self.prompt.inc(prompt_tokens)

    def tokens(self, n: int, ttft: float | None, itls: list[float]) -> None:
        self.v_gen.labels(*self.labels).inc(n)
        self.gen.inc(n)
        if ttft is not None:
            self.v_ttft.labels(*self.labels).observe(ttft)
            self.ttft.observe(ttft)
        v_itl = self.v_itl.labels(*self.labels)
        for x in itls:
            v_itl.observe(x)
            self.itl.observe(x)

    def request_finished(self, reason: str, latency: float) -> None:
        self.v_success.labels(*self.labels, reason).inc()
        self.finished.labels(reason).inc()
        self.v_e2e.labels(*self.labels).observe(latency)
        self.e2e.observe(latency)

    # ---- exposition -----------------------------------------------------------------------------
    def render(self, engine: dict, queue_len: int) -> str:
        """The exposition; `engine` is a `stats_dict()` snapshot (speculative keys present
        with a drafter), `queue_len` the admitted requests waiting for the batch."""
        with self._render_lock:
            self._engine, self._queue_len = engine, queue_len
            return generate_latest(self.registry).decode()


class _EngineCollector:
    """Metrics read from the engine's snapshot at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def describe(self):
        return []  # NOTE: families depend on the engine (speculative or not)

    def collect(self):
        e, labels = self.m._engine, list(self.m.labels)
        pages = e.get("num_pages", 0)
        in_use = pages - e.get("free_pages", pages)
        usage = in_use / pages if pages else 0.0
        win = e.get("num_win_pages", 0)  # the sliding-window layers' own pages (cache/window.py)
        win_in_use = win - e.get("free_win_pages", win)
        if win:  # the fraction of both groups' bytes: their pages differ in size
            pb, wb = e.get("page_bytes", 1), e.get("win_page_bytes", 1)
            usage = (in_use * pb + win_in_use * wb) / (pages * pb + win * wb)

        def fam(kind, name, doc, value, extra=None):
            f = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                name, doc, labels=None if name.startswith("specdeploy_") else list(LABELS) + (
                    list(extra) if extra else []))
            if name.startswith("specdeploy_"):
                f.add_metric([], value)
            else:
                f.add_metric(labels, value)
            return f

        yield fam("gauge", "vllm:num_requests_running", "Requests in the running batch.",
                  e.get("num_running", 0))
        yield fam("gauge", "vllm:num_requests_waiting", "Admitted requests waiting for the "
                  "batch.", self.m._queue_len)
        yield fam("gauge", "vllm:kv_cache_usage_perc", "Fraction of the KV cache in use (0 to "
                  "1; with a sliding-window page group, of both groups' bytes).", usage)
        yield fam("counter", "vllm:num_preemptions", "Sequences preempted for lack of cache "
                  "pages.", e.get("num_preemptions", 0))
        yield fam("gauge", "specdeploy_num_requests_running", "Requests in the running batch.",
                  e.get("num_running", 0))
        yield fam("gauge", "specdeploy_num_requests_waiting", "Admitted requests waiting for "
                  "the batch (the queue that --max-queue bounds).", self.m._queue_len)
        yield fam("gauge", "specdeploy_cache_pages_in_use", "KV-cache pages held by requests.",
                  in_use)
        yield fam("gauge", "specdeploy_cache_pages_total", "KV-cache pages.", pages)
        if win:
            yield fam("gauge", "specdeploy_cache_window_pages_in_use", "Pages of the "
                      "sliding-window layers' own group held by requests.", win_in_use)
            yield fam("gauge", "specdeploy_cache_window_pages_total", "Pages of the "
                      "sliding-window layers' own group.", win)
        yield fam("counter", "specdeploy_preemptions", "Sequences preempted for lack of cache "
                  "pages.", e.get("num_preemptions", 0))
        if "prefix_cache_queries" in e:
            yield from _prefix(fam, e)
        if "draft_steps" in e:
            yield from _spec(fam, e, labels)


def _prefix(fam, e: dict):
    for name, key, doc in (("queries", "prefix_cache_queries", "Prompt tokens looked up in the "
                            "prefix cache."),
                           ("hits", "prefix_cache_hits", "Of those, tokens found cached (not "
                            "prefilled).")):
        yield fam("counter", f"vllm:prefix_cache_{name}", doc, e.get(key, 0))
        yield fam("counter", f"specdeploy_prefix_cache_{name}", doc, e.get(key, 0))
    yield fam("gauge", "specdeploy_prefix_cache_checkpoints_used", "Recurrent-state checkpoint "
              "slots holding a cached page boundary.", e.get("checkpoints_used", 0))
    yield fam("gauge", "specdeploy_prefix_cache_checkpoints_total", "Recurrent-state checkpoint "
              "slots.", e.get("checkpoint_slots", 0))


def _spec(fam, e: dict, labels: list[str]):
    per_pos = e.get("accepted_per_position", [])
    yield fam("counter", "vllm:spec_decode_num_drafts", "Verify steps with drafts (one per "
              "drafting sequence).", e["draft_steps"])
    yield fam("counter", "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.",
              e.get("draft_tokens", 0))
    yield fam("counter", "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
              e.get("accepted_tokens", 0))
    f = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                            "Draft tokens accepted at each draft position (0 = first).",
                            labels=[*LABELS, "position"])
    for i, n in enumerate(per_pos):
        f.add_metric([*labels, str(i)], n)
    yield f
    alias = CounterMetricFamily("specdeploy_spec_accepted_tokens_per_position",
                                "Draft tokens accepted at each draft position (0 = first).",
                                labels=["position"])
    for i, n in enumerate(per_pos):
        alias.add_metric([str(i)], n)
    yield alias
    for kind, name, key, doc in (
            ("gauge", "num_draft_tokens", "num_draft_tokens", "Draft tokens proposed per step "
             "(K)."),
            ("counter", "draft_steps", "draft_steps", "Verify steps (one per drafting "
             "sequence)."),
            ("counter", "draft_tokens", "draft_tokens", "Draft tokens proposed."),
            ("counter", "accepted_tokens", "accepted_tokens", "Draft tokens accepted."),
            ("gauge", "acceptance_rate", "acceptance_rate", "Accepted / proposed draft tokens."),
            ("gauge", "mean_accepted_length", "mean_accepted_length", "Tokens gained per target "
             "step of a decoding sequence (accepted + bonus)."),
            ("counter", "lookup_steps", "lookup_steps", "Verify steps whose drafts came (at "
             "least in part) from n-gram lookup."),
            ("counter", "lookup_accepted_tokens", "lookup_accepted_tokens", "Draft tokens "
             "accepted in those steps."),
            ("counter", "store_steps", "store_steps", "Verify steps whose lookup drafts came "
             "from the suffix store (--spec suffix)."),
            ("counter", "store_accepted_tokens", "store_accepted_tokens", "Draft tokens "
             "accepted in those steps."),
            ("counter", "undrafted_steps", "undrafted_steps", "Decode steps left without drafts "
             "by the draft confidence stop (draft_min_prob).")):
        yield fam(kind, f"specdeploy_spec_{name}", doc, e.get(key, 0))


def parse_text(text: str) -> dict[str, float]:
    """`name{labels}` -> value of a rendered exposition (for tests and the benches). A labelled
    series also adds into its bare name (the sum over its label sets), so callers that do not
    care about `model_name` can read `vllm:prompt_tokens_total`."""
    values: dict[str, float] = {}
    bare: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
            name, brace, _ = key.partition("{")
            if brace:
                bare[name] = bare.get(name, 0.0) + float(value)
    for name, total in bare.items():
        values.setdefault(name, total)
    return values
