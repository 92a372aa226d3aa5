"""Prometheus metrics: request latency histograms observed by the server, engine state (queue
lengths, KV blocks and their usage fraction, prefix-cache hit rate, token and preemption counts,
speculative decoding's draft and accepted tokens and their ratio) read at scrape time.

Every series carries a `model_name` label (the served model name), as vLLM's do, so that one
Prometheus and one dashboard (`dashboards/lmfoundry.json`) can tell several servers apart.
The labelled series a dashboard plots exist from the start (zero until something happens), so
panels show 0 rather than "no data" on a fresh server. vLLM's series (`vllm:*`, vllm_metrics.py)
are exported beside ours from the same measurements (`serve --metrics-names` picks ours, vLLM's or
both: vLLM's names carry ':', which `promtool check metrics` refuses, so a linted endpoint takes
`ours`). `lmfoundry_model_info` says what runs (dtype, device, CPU path, weight format).
"""

from __future__ import annotations

import time
from typing import AsyncIterator, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from lmfoundry.runtime.engine.outputs import StepEvent
from lmfoundry.runtime.engine.sampling_params import SamplingParams
from lmfoundry.runtime.server.vllm_metrics import VllmEngineCollector, VllmRequestMetrics

EngineStats = Callable[[], dict[str, float]]  # `EngineClient.stats`: the engine's counters as of its last step

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


class EngineCollector:
    """Reads the engine's counters when Prometheus scrapes (no bookkeeping in the hot loop)."""

    def __init__(self, stats: EngineStats, model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        s = self.stats()
        total = s["kv_blocks_total"]
        gauges = {
            "num_requests_running": ("Sequences in the running batch", s["requests_running"]),
            "num_requests_waiting": ("Sequences waiting for a slot", s["requests_waiting"]),
            "kv_cache_blocks_used": ("KV-cache blocks held by sequences", s["kv_blocks_used"]),
            "kv_cache_capacity_blocks": ("KV-cache blocks in the pool (a gauge: not a counter, no _total)", total),
            "kv_cache_usage_ratio": ("Fraction of the KV-cache blocks held by sequences (0..1)",
                                     s["kv_blocks_used"] / total if total else 0.0),
            "prefix_cache_hit_rate": ("Prompt tokens served from the prefix cache / prompt tokens admitted",
                                      s["prefix_cache_hit_rate"]),
            "spec_decode_acceptance_rate": ("Speculative draft tokens accepted / draft tokens scored, since start "
                                            "(0 without --speculative)", s["spec_acceptance_rate"]),
        }
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(f"lmfoundry_{name}", doc, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge
        counters = {
            "prompt_tokens": ("Prompt tokens received", s["prompt_tokens"]),
            "generation_tokens": ("Tokens generated", s["generation_tokens"]),
            "num_preemptions": ("Sequences preempted (recomputed) for lack of KV blocks", s["preemptions"]),
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", s["prefix_cache_queries_tokens"]),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache", s["prefix_cache_hits_tokens"]),
            "spec_decode_draft_tokens": ("Speculative draft tokens proposed and scored by the model",
                                         s["spec_draft_tokens"]),
            "spec_decode_accepted_tokens": ("Speculative draft tokens accepted (output as if decoded one by one)",
                                            s["spec_accepted_tokens"]),
        }
        for name, (doc, value) in counters.items():
            counter = CounterMetricFamily(f"lmfoundry_{name}", doc, labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter


FINISH_REASONS = ("stop", "length", "abort", "error")


METRICS_NAMES = ("ours", "vllm", "both")  # serve --metrics-names


class ServerMetrics:
    """The server's registry. `names` chooses the series exported: ours (`lmfoundry_*`), vLLM's
    (`vllm:*`, whose ':' promtool's linter flags) or both; every series is measured either way.
    `info` labels `lmfoundry_model_info` (what runs: dtype, device, CPU path, weight format)."""

    def __init__(self, stats: EngineStats, model_name: str, max_model_len: int, names: str = "both",
                 info: dict[str, str] | None = None) -> None:
        if names not in METRICS_NAMES:
            raise ValueError(f"metric names {names!r}: expected one of {', '.join(METRICS_NAMES)}")
        self.model_name = model_name
        self.registry = CollectorRegistry()
        ours = self.registry if names in ("ours", "both") else None  # None: measured, not exported
        label = ["model_name"]
        self.ttft = Histogram("lmfoundry_time_to_first_token_seconds", "Request arrival to first token",
                              label, buckets=LATENCY_BUCKETS, registry=ours).labels(model_name)
        self.itl = Histogram("lmfoundry_inter_token_latency_seconds", "Time between successive output tokens",
                             label, buckets=TOKEN_BUCKETS, registry=ours).labels(model_name)
        self.e2e = Histogram("lmfoundry_e2e_request_latency_seconds", "Request arrival to last token",
                             label, buckets=LATENCY_BUCKETS, registry=ours).labels(model_name)
        self.finished = Counter("lmfoundry_requests", "Finished requests by finish reason",
                                ["model_name", "finish_reason"], registry=ours)
        for reason in FINISH_REASONS:
            self.finished.labels(model_name, reason)  # exported as 0 from the start
        self.rejected = Counter("lmfoundry_requests_rejected", "Requests refused with an HTTP error",
                                ["model_name", "status"], registry=ours)
        theirs = self.registry if names in ("vllm", "both") else None
        self.vllm = VllmRequestMetrics(theirs, model_name, max_model_len)
        if ours is not None:
            self.registry.register(EngineCollector(stats, model_name))
            if info is not None:
                Info("lmfoundry_model", "What the engine runs: execution dtype, device, the CPU kernels' vector "
                     "path and the weight format", ["model_name"], registry=ours).labels(model_name).info(info)
        if theirs is not None:
            self.registry.register(VllmEngineCollector(stats, model_name))

    def count_finished(self, reason: str) -> None:
        self.finished.labels(self.model_name, reason).inc()

    def count_rejected(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def observe(self, events: AsyncIterator[StepEvent], start: float, params: SamplingParams
                      ) -> AsyncIterator[StepEvent]:
        """Pass one engine request's events through, timing the first token, the gaps between
        tokens and the end. A request the engine failed is counted with finish_reason "error",
        one the client left as "abort"."""
        last: dict[int, float] = {}
        first_token: float | None = None
        last_event: StepEvent | None = None
        generated = 0
        reason = "abort"
        try:
            async for ev in events:
                now = time.monotonic()
                if ev.token_ids:
                    prev = last.get(ev.index)
                    if prev is None:
                        self.ttft.observe(now - start)
                        if first_token is None:
                            first_token = now
                            self.vllm.ttft.observe(now - start)
                    else:
                        gap = (now - prev) / len(ev.token_ids)
                        for _ in ev.token_ids:
                            self.itl.observe(gap)
                            self.vllm.itl.observe(gap)
                    last[ev.index] = now
                    generated += len(ev.token_ids)
                if ev.finish_reason is not None:
                    reason = ev.finish_reason
                if ev.index == 0:
                    last_event = ev
                yield ev
        except Exception:
            reason = "error"
            raise
        finally:
            end = time.monotonic()
            if reason not in ("abort", "error"):
                self.e2e.observe(end - start)
            self.count_finished(reason)
            self.vllm.observe_request(start, first_token, end, reason, last_event, generated, params.n,
                                      params.max_tokens)
