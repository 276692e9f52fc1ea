"""The server's Prometheus metrics, in a registry of its own (one per app)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("hebrus_requests", "Requests accepted, by route", ["route"], registry=registry)
        self.tokens_in = Counter("hebrus_prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.tokens_out = Counter("hebrus_completion_tokens", "Tokens generated", registry=registry)
        self.ttft = Histogram("hebrus_time_to_first_token_seconds", "Time to first token", registry=registry,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.itl = Histogram("hebrus_inter_token_latency_seconds", "Time between tokens", registry=registry,
                             buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1))
        self.aborts = Counter("hebrus_aborted_transactions", "Transactions aborted, by failure kind and stage",
                              ["kind", "stage"], registry=registry)
        self._aborts: dict[tuple[str, str], int] = {}      # the engine's counts the counter has taken
        self.active = Gauge("hebrus_active_sessions", "Requests running in the engine", registry=registry)
        self.queue = Gauge("hebrus_queue_depth", "Requests waiting for the engine", registry=registry)
        self.preemptions = Gauge("hebrus_preemptions", "Requests preempted for want of state-pool blocks",
                                 registry=registry)
        cache = "The prefix cache: "
        self.cache = {
            "lookups": Gauge("hebrus_prefix_cache_lookups", cache + "prompts looked up", registry=registry),
            "hits": Gauge("hebrus_prefix_cache_hits", cache + "prompts that found a cached state", registry=registry),
            "saved": Gauge("hebrus_prefix_cache_saved_tokens", cache + "prompt tokens not fed again",
                           registry=registry),
            "used": Gauge("hebrus_prefix_cache_bytes", cache + "bytes held (slots, and blocks once each)",
                          registry=registry),
            "entries": Gauge("hebrus_prefix_cache_entries", cache + "states kept", registry=registry),
            "lost": Gauge("hebrus_prefix_cache_lost", cache + "chunks whose kept states could not be cached "
                          "(the chunk is published; only those states are lost)", registry=registry),
        }

    def request(self, chat: bool) -> None:
        self.requests.labels(route="chat" if chat else "completions").inc()

    def token(self, seconds: float, first: bool) -> None:
        self.tokens_out.inc()
        (self.ttft if first else self.itl).observe(seconds)

    def finished(self, prompt_tokens: int, tokens: int) -> None:
        self.tokens_in.inc(prompt_tokens)

    def render(self, counts: dict) -> bytes:
        """The metrics now, with the engine's `counts` (`Scheduler.counts`: a moment's values)."""
        self.active.set(counts["running"])
        self.queue.set(counts["waiting"])
        self.preemptions.set(counts["preemptions"])
        for name, gauge in self.cache.items():
            gauge.set(counts["cache"][name])
        for (kind, stage), n in counts["aborts"].items():     # the engine's count; the counter follows it
            seen = self._aborts.get((kind, stage), 0)
            if n > seen:
                self.aborts.labels(kind=kind, stage=stage).inc(n - seen)
                self._aborts[kind, stage] = n
        return generate_latest(self.registry)
