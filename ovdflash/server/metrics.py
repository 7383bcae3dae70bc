"""Prometheus metrics of one server, named as vLLM names them with the prefix `ovdflash:`.

Contract: `ServerMetrics(model_name, prefix_caching=True)` owns a private `CollectorRegistry` (several apps may live in
one process, as tests build them), served by `/metrics`. Every series carries `model_name`.
- Counters: `ovdflash:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
  `..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total{position}` (0-based
  draft position), `..._num_lookup_drafts_total` (the rounds whose drafts came from n-gram
  lookup), `..._num_forced_draft_tokens_total` (drafts a grammar forced: structured outputs),
  `ovdflash:prompt_tokens_total`, `ovdflash:generation_tokens_total`,
  `ovdflash:prefix_cache_queries_total` / `ovdflash:prefix_cache_hits_total` (prompt tokens looked
  up in the prefix cache, and those whose KV it gave),
  `ovdflash:structured_requests_total{kind}` (requests the engine took whose output is held to a
  grammar: json, json_object, regex, choice, grammar), `ovdflash:request_success_total{finished_reason}` (stop, length, abort, error: every request
  the engine took, answered or not), `ovdflash:request_rejected_total{reason}` (queue_full,
  shutting_down).
- Gauges: `ovdflash:num_requests_running`, `ovdflash:num_requests_waiting`,
  `ovdflash:resident_memory_bytes` (the server process's resident set, read at each scrape) and,
  when batching, `ovdflash:kv_pool_blocks{state}` (used: held by running requests; cached: prefix
  blocks nobody holds, evicted on demand; free: the rest, which add up to the pool's blocks).
- Histograms (seconds, from the request's arrival at the engine): `ovdflash:time_to_first_token_seconds`,
  `ovdflash:time_per_output_token_seconds` (per request: (end - first token) / (tokens - 1)),
  `ovdflash:e2e_request_latency_seconds`.
`record_finished` adds one request's GenerationStats, so the spec-decode counters are the sums of
the `usage.spec_decode` objects of the responses.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..decode.stats import GenerationStats
from ..ov.memory import resident_bytes

PREFIX = "ovdflash:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, model_name: str, prefix_caching: bool = True):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.prefix_caching = prefix_caching  # off: no prompt token is looked up
        r, m = self.registry, ["model_name"]

        def counter(name, doc, labels=()):
            return Counter(PREFIX + name, doc, m + list(labels), registry=r)

        self.num_drafts = counter("spec_decode_num_drafts", "Verify rounds that carried drafts.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.num_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                            "Accepted draft tokens by position in the block.", ["position"])
        self.num_lookup_drafts = counter("spec_decode_num_lookup_drafts",
                                         "Verify rounds whose drafts came from n-gram lookup.")
        self.num_forced_draft_tokens = counter("spec_decode_num_forced_draft_tokens",
                                               "Draft tokens a grammar forced (structured outputs).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens whose KV the prefix cache gave.")
        self.request_success = counter("request_success", "Requests finished, by reason.", ["finished_reason"])
        self.structured_requests = counter("structured_requests", "Requests held to a grammar, by kind.", ["kind"])
        self.request_rejected = counter("request_rejected", "Requests refused before the engine, by reason.",
                                        ["reason"])
        self.running = Gauge(PREFIX + "num_requests_running", "Requests generating now.", m, registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting for the engine.", m, registry=r)
        self.resident = Gauge(PREFIX + "resident_memory_bytes", "Resident memory of the server process.", m,
                              registry=r)
        self.resident.labels(model_name).set_function(resident_bytes)
        self.pool_blocks = Gauge(PREFIX + "kv_pool_blocks", "KV cache pool blocks by state (used, cached, free).",
                                 m + ["state"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Time per output token after the first.",
                              m, buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency in the engine.", m,
                             buckets=_LATENCY_BUCKETS, registry=r)

    def watch_load(self, num_running, num_waiting) -> None:
        """Read the two gauges from these callables at each scrape (so they are current while a round runs)."""
        self.running.labels(self.model_name).set_function(num_running)
        self.waiting.labels(self.model_name).set_function(num_waiting)

    def watch_pool(self, pool_usage) -> None:
        """Read the pool gauges from pool_usage() (a dict with used, cached and free blocks) at each scrape."""
        for state in ("used", "cached", "free"):
            self.pool_blocks.labels(self.model_name, state).set_function(lambda state=state: pool_usage()[state])

    def record_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def record_structured(self, kind: str) -> None:
        self.structured_requests.labels(self.model_name, kind).inc()

    def record_rejected(self, reason: str) -> None:
        self.request_rejected.labels(self.model_name, reason).inc()

    def record_finished(self, stats: GenerationStats, num_output_tokens: int, finish_reason: str,
                        e2e_s: float, ttft_s: float | None) -> None:
        name = self.model_name
        self.num_drafts.labels(name).inc(stats.num_drafts)
        self.num_draft_tokens.labels(name).inc(stats.num_draft_tokens)
        self.num_accepted_tokens.labels(name).inc(stats.num_accepted_tokens)
        self.num_lookup_drafts.labels(name).inc(stats.num_lookup_drafts)
        self.num_forced_draft_tokens.labels(name).inc(stats.num_forced_draft_tokens)
        for position, accepted in enumerate(stats.accepted_per_position):
            self.num_accepted_per_pos.labels(name, str(position)).inc(accepted)
        self.prompt_tokens.labels(name).inc(stats.num_prompt_tokens)
        if self.prefix_caching:
            self.prefix_cache_queries.labels(name).inc(stats.num_prompt_tokens)
            self.prefix_cache_hits.labels(name).inc(stats.num_cached_prompt_tokens)
        self.generation_tokens.labels(name).inc(num_output_tokens)
        self.request_success.labels(name, finish_reason).inc()
        self.e2e.labels(name).observe(e2e_s)
        if ttft_s is not None and num_output_tokens > 1:
            self.tpot.labels(name).observe((e2e_s - ttft_s) / (num_output_tokens - 1))

