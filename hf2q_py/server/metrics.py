"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import mlx.core as mx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..budget import MemoryLedger
from ..disk_writer import DiskStats
from ..prompt_cache import PromptCache
from ..stats import GenerationStats

#: Paths counted by name; any other path is counted as "other".
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/responses", "/v1/models", "/health", "/metrics")  # fmt: skip
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_PER_TOKEN = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class _PromptCacheCollector(Collector):
    """Reads the Target's prompt cache at each scrape."""

    def __init__(self, cache: Callable[[], PromptCache | None]):
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        cache = self.cache()
        if cache is None:
            return
        s = cache.stats
        for name, doc, value in (
            ("lookups", "prompt cache lookups (one per request)", s.lookups),
            ("hits", "lookups that reused at least one prompt token", s.hits),
            ("reused_tokens", "prompt tokens whose states came from the cache", s.reused_tokens),
            ("evictions", "snapshots evicted (least recently used)", s.evicted),
        ):
            yield CounterMetricFamily(f"hf2q_prompt_cache_{name}", doc, value=value)
        yield GaugeMetricFamily("hf2q_prompt_cache_entries", "snapshots held", value=len(cache))
        yield GaugeMetricFamily("hf2q_prompt_cache_bytes", "memory the snapshots hold", value=cache.nbytes)
        if cache.disk is not None:
            yield from _disk_metrics(cache.disk.stats)


def _disk_metrics(d: DiskStats) -> Iterator[Metric]:
    for name, doc, value in (
        ("hits", "lookups that reused states read from disk", d.hits),
        ("reused_tokens", "prompt tokens whose states came from disk", d.reused_tokens),
        ("written_files", "files written to the prompt cache on disk", d.files_written),
        ("written_bytes", "bytes written to the prompt cache on disk", d.bytes_written),
        ("skipped_files", "files skipped as unusable (corrupt, truncated, foreign) and removed", d.skipped),
        ("evicted_files", "files removed to keep the disk bound (least recently used)", d.evicted),
    ):
        yield CounterMetricFamily(f"hf2q_prompt_cache_disk_{name}", doc, value=value)
    yield GaugeMetricFamily(
        "hf2q_prompt_cache_disk_bytes", "bytes the files on disk held at the last scan", value=d.bytes
    )


class _BatchCollector(Collector):
    """Reads the scheduler's rounds per batch size at each scrape."""

    def __init__(self, rounds: Callable[[], dict[int, int]]):
        self.rounds = rounds

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "hf2q_batch_rounds", "batched forwards by how many generations shared them", labels=["size"]
        )
        for size, n in sorted(self.rounds().items()):
            family.add_metric([str(size)], n)
        yield family


class _MemoryCollector(Collector):
    """Reads the memory budget's numbers (the scheduler's last step) and
    MLX's allocator at each scrape."""

    def __init__(self, ledger: Callable[[], MemoryLedger | None]):
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        mlx = GaugeMetricFamily("hf2q_mlx_memory_bytes", "MLX's allocator: active, peak and cached buffers",
                                labels=["kind"])  # fmt: skip
        for kind, value in (("active", mx.get_active_memory()), ("peak", mx.get_peak_memory()),
                            ("cache", mx.get_cache_memory())):  # fmt: skip
            mlx.add_metric([kind], value)
        yield mlx
        ledger = self.ledger()
        if ledger is None:
            return
        r = ledger.report
        yield GaugeMetricFamily("hf2q_memory_budget_bytes", "what the server may hold in all", value=r.budget)
        held = GaugeMetricFamily("hf2q_memory_bytes", "bytes held or reserved, by kind", labels=["kind"])
        for kind, value in (("weights", r.weights), ("kv_reserved", r.kv_reserved), ("kv_in_use", r.kv_in_use),
                            ("prompt_cache", r.prompt_cache), ("activations_reserved", r.transient)):  # fmt: skip
            held.add_metric([kind], value)
        yield held
        yield GaugeMetricFamily("hf2q_memory_waiting", "requests waiting for memory", value=r.waiting)
        refused = CounterMetricFamily("hf2q_memory_refusals", "requests refused by the memory budget, by reason",
                                      labels=["reason"])  # fmt: skip
        for reason in ("prompt_too_long", "queue_full", "allocation_failed"):
            refused.add_metric([reason], r.refusals.get(reason, 0))
        yield refused
        yield CounterMetricFamily("hf2q_memory_clamped", "requests whose max_tokens was cut to what fits",
                                  value=r.clamped)  # fmt: skip
        yield CounterMetricFamily("hf2q_memory_evictions", "prompt-cache snapshots evicted to make room",
                                  value=r.evictions)  # fmt: skip


class Metrics:
    """Counters and histograms of one server."""

    def __init__(
        self,
        prompt_cache: Callable[[], PromptCache | None],
        queue_depth: Callable[[], int],
        batch_rounds: Callable[[], dict[int, int]] = dict,
        ledger: Callable[[], MemoryLedger | None] = lambda: None,
    ):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "hf2q_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("hf2q_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("hf2q_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            "hf2q_time_to_first_token_seconds",
            "from the request's arrival to its first generated text",
            buckets=_LATENCY,
            registry=r,
        )
        self.per_token = Histogram(
            "hf2q_time_per_output_token_seconds",
            "decode time per generated token after the first",
            buckets=_PER_TOKEN,
            registry=r,
        )
        self.e2e = Histogram(
            "hf2q_request_seconds", "from arrival to the last token", buckets=_LATENCY, registry=r
        )
        self.drafted = Counter("hf2q_spec_drafted_tokens", "draft tokens verified", ["method"], registry=r)
        self.accepted = Counter("hf2q_spec_accepted_tokens", "draft tokens accepted", ["method"], registry=r)
        self.verify_rounds = Counter(
            "hf2q_spec_verify_rounds", "batched verify forwards", ["method"], registry=r
        )
        self.queue = Gauge("hf2q_queue_depth", "requests waiting for the model", registry=r)
        self.queue.set_function(queue_depth)
        r.register(_PromptCacheCollector(prompt_cache))
        r.register(_BatchCollector(batch_rounds))
        r.register(_MemoryCollector(ledger))

    def request(self, path: str, status: int) -> None:
        self.requests.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    def finished(self, stats: GenerationStats, ttft: float | None, seconds: float) -> None:
        """One generation's tokens, latencies and speculation counts."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.generated_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        if stats.generated_tokens > 1:
            self.per_token.observe(stats.decode_seconds / stats.generated_tokens)
        self.e2e.observe(seconds)
        method = stats.method
        self.drafted.labels(method).inc(stats.drafted)
        self.accepted.labels(method).inc(stats.accepted)
        self.verify_rounds.labels(method).inc(stats.verify_rounds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
