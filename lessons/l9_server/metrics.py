"""What GET /metrics shows, in Prometheus' text format: the engine's queues and pool, and its latencies.

The engine thread writes the engine's values (after each step, and as it emits tokens); the HTTP handlers
count what they refuse and the slow readers they cut, and render the rest. prometheus_client's metrics are
thread-safe, so no lock of ours is needed. Each server owns
its registry, so two servers in one process (tests) never mix their numbers.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lessons.l9_server.engine import L9Engine

# Seconds. CPU steps of the tiny model take milliseconds; a real model on a GPU tens of them; a long queue seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "paged_"


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, registry=r)

        self.running = gauge("requests_running", "Sequences admitted to the engine (holding blocks).")
        self.waiting = gauge("requests_waiting", "Sequences queued for admission, preempted ones included.")
        self.blocks_free = gauge("blocks_free", "KV blocks never used or evicted.")
        self.blocks_cached = gauge("blocks_cached", "KV blocks nobody holds whose prefix is cached (evictable).")
        self.blocks_held = gauge("blocks_held", "KV blocks referenced by requests (and the CUDA-graph dummy block).")
        self.hit_rate = gauge("prefix_cache_hit_rate", "Share of admitted prompt tokens served from the prefix cache.")
        self.preemptions = Counter(PREFIX + "preemptions", "Requests evicted to make room (recomputed later).",
                                   registry=r)
        # Per choice, not per request: a request with n choices adds n, each under the reason that ended that
        # choice (its own stop or length, or the abort of a request whose client left before it finished).
        self.requests = Counter(PREFIX + "requests_finished", "Choices ended (n per request of n choices), by "
                                "finish reason: stop, length, or abort (the client left before it finished).",
                                ["reason"], registry=r)
        self.slow_readers = Counter(PREFIX + "slow_readers", "Streams cut (their requests aborted) because the client "
                                    "fell too far behind.", registry=r)
        self.rejected = Counter(PREFIX + "requests_rejected", "Requests refused before reaching the engine.",
                                ["status"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "From arrival to the first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_seconds", "Between two tokens of one output.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self._preemptions_seen = 0
        self.spec: SpecMetrics | None = None  # L11: made at the first update from an engine that drafts

    def update(self, engine: L9Engine) -> None:
        """Called by the engine thread after each step."""
        # L11's SpecStats, from an engine with a drafter only (L12's int8 engine is L11's, drafting or not);
        # L9's and L10's engines have none
        spec = getattr(engine, "spec", None) if getattr(engine, "drafter", None) is not None else None
        if spec is not None:
            if self.spec is None:
                self.spec = SpecMetrics(self.registry)
            self.spec.update(spec)
        sched, alloc, stats = engine.scheduler, engine.allocator, engine.stats
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.blocks_free.set(alloc.num_free - alloc.num_cached_unheld)
        self.blocks_cached.set(alloc.num_cached_unheld)
        self.blocks_held.set(alloc.num_blocks - alloc.num_free)
        self.hit_rate.set(stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0)
        self.preemptions.inc(stats.preemptions - self._preemptions_seen)
        self._preemptions_seen = stats.preemptions

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SpecMetrics:
    """L11's speculation, from the engine's SpecStats: registered only for an engine that has them, so an L9 or
    L10 server's /metrics is unchanged. The counters are vLLM's spec-decode counters under this server's prefix."""

    def __init__(self, registry: CollectorRegistry):
        self.drafts = Counter(PREFIX + "spec_drafts", "Decode rows verified with at least one draft token.",
                              registry=registry)
        self.draft_tokens = Counter(PREFIX + "spec_draft_tokens", "Draft tokens proposed and verified.",
                                    registry=registry)
        self.accepted_tokens = Counter(PREFIX + "spec_accepted_tokens", "Draft tokens equal to the target's own "
                                       "choice (kept).", registry=registry)
        self.mean_accepted_length = Gauge(PREFIX + "spec_mean_accepted_length", "Tokens per verified row so far: "
                                          "1 + accepted draft tokens / drafts (0 before the first draft).",
                                          registry=registry)
        self._seen = (0, 0, 0)  # (verify rows, drafted, accepted) already counted

    def update(self, spec) -> None:
        now = (spec.verify_rows, spec.drafted, spec.accepted)
        for counter, value, seen in zip((self.drafts, self.draft_tokens, self.accepted_tokens), now, self._seen):
            counter.inc(value - seen)
        self._seen = now
        self.mean_accepted_length.set(spec.mean_accepted_length)
