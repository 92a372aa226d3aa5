"""Prometheus metrics: request latency histograms observed by the server, engine state (queue
lengths, KV blocks, prefix-cache hit rate, token and preemption counts) read at scrape time."""

from __future__ import annotations

import time
from typing import AsyncIterator, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from lmfoundry.runtime.engine.llm_engine import LLMEngine
from lmfoundry.runtime.engine.outputs import StepEvent

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


class EngineCollector:
    """Reads the engine's counters when Prometheus scrapes (no bookkeeping in the hot loop)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterable[Metric]:
        s = self.engine.stats()
        gauges = {
            "num_requests_running": ("Sequences in the running batch", s["requests_running"]),
            "num_requests_waiting": ("Sequences waiting for a slot", s["requests_waiting"]),
            "kv_cache_blocks_used": ("KV-cache blocks held by sequences", s["kv_blocks_used"]),
            "kv_cache_blocks_total": ("KV-cache blocks in the pool", s["kv_blocks_total"]),
            "prefix_cache_hit_rate": ("Prompt tokens served from the prefix cache / prompt tokens admitted",
                                      s["prefix_cache_hit_rate"]),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"lmfoundry_{name}", doc, value=value)
        counters = {
            "prompt_tokens": ("Prompt tokens received", s["prompt_tokens"]),
            "generation_tokens": ("Tokens generated", s["generation_tokens"]),
            "num_preemptions": ("Sequences preempted (recomputed) for lack of KV blocks", s["preemptions"]),
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", s["prefix_cache_queries_tokens"]),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache", s["prefix_cache_hits_tokens"]),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"lmfoundry_{name}", doc, value=value)


class ServerMetrics:
    def __init__(self, engine: LLMEngine) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram("lmfoundry_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("lmfoundry_inter_token_latency_seconds", "Time between successive output tokens",
                             buckets=TOKEN_BUCKETS, registry=self.registry)
        self.e2e = Histogram("lmfoundry_e2e_request_latency_seconds", "Request arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("lmfoundry_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=self.registry)
        self.rejected = Counter("lmfoundry_requests_rejected", "Requests refused with an HTTP error",
                                ["status"], registry=self.registry)
        self.registry.register(EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def observe(self, events: AsyncIterator[StepEvent], start: float) -> AsyncIterator[StepEvent]:
        """Pass events through, timing the first token, the gaps between tokens and the end. A
        request the engine failed is counted with finish_reason "error", one the client left as "abort"."""
        last: dict[int, float] = {}
        reason = "abort"
        try:
            async for ev in events:
                now = time.monotonic()
                if ev.token_ids:
                    prev = last.get(ev.index)
                    if prev is None:
                        self.ttft.observe(now - start)
                    else:
                        gap = (now - prev) / len(ev.token_ids)
                        for _ in ev.token_ids:
                            self.itl.observe(gap)
                    last[ev.index] = now
                if ev.finish_reason is not None:
                    reason = ev.finish_reason
                yield ev
        except Exception:
            reason = "error"
            raise
        finally:
            if reason not in ("abort", "error"):
                self.e2e.observe(time.monotonic() - start)
            self.finished.labels(finish_reason=reason).inc()
