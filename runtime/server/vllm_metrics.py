"""vLLM's metric names, types, labels and buckets beside ours, so that the dashboards, alerts and
autoscalers built for vLLM (its Grafana dashboard, KEDA, KServe, llm-d) can watch this server
unchanged. Only series we measure the same way are exported; each comes from the same engine
counters or request timings as our `lmfoundry_*` series.

Labels are vLLM's: `model_name` and `engine` (always "0": one engine per server). Request phase
times come from the engine's per-sequence timestamps (`SequenceTimes`): queue = arrival to first
scheduling, prefill = scheduling to first token, decode = first token to finish, inference =
prefill + decode. Buckets follow vLLM 0.32 (`vllm/v1/metrics/buckets.py`).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from lmfoundry.runtime.engine.outputs import StepEvent

LABELS = ["model_name", "engine"]
ENGINE = "0"
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
FINISHED_REASONS = ("stop", "length", "abort", "error")


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class VllmEngineCollector:
    """The engine's gauges and counters under vLLM's names, read at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, float]], model_name: str) -> None:
        self.stats = stats
        self.labels = [model_name, ENGINE]

    def collect(self) -> Iterable[Metric]:
        s = self.stats()
        total = s["kv_blocks_total"]
        gauges = {
            "num_requests_running": ("Number of requests in model execution batches.", s["requests_running"]),
            "num_requests_waiting": ("Number of requests waiting to be processed.", s["requests_waiting"]),
            "kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.",
                                    s["kv_blocks_used"] / total if total else 0.0),
        }
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(f"vllm:{name}", doc, labels=LABELS)
            gauge.add_metric(self.labels, value)
            yield gauge
        counters = {
            "prefix_cache_queries": ("Prefix cache queries, in terms of number of queried tokens.",
                                     s["prefix_cache_queries_tokens"]),
            "prefix_cache_hits": ("Prefix cache hits, in terms of number of cached tokens.",
                                  s["prefix_cache_hits_tokens"]),
            "num_preemptions": ("Cumulative number of preemption from the engine.", s["preemptions"]),
            "prompt_tokens": ("Number of prefill tokens processed.", s["prompt_tokens"]),
            "generation_tokens": ("Number of generation tokens processed.", s["generation_tokens"]),
            "spec_decode_num_draft_tokens": ("Number of draft tokens.", s["spec_draft_tokens"]),
            "spec_decode_num_accepted_tokens": ("Number of accepted tokens.", s["spec_accepted_tokens"]),
        }
        for name, (doc, value) in counters.items():
            counter = CounterMetricFamily(f"vllm:{name}", doc, labels=LABELS)
            counter.add_metric(self.labels, value)
            yield counter


class VllmRequestMetrics:
    """Per-request histograms and the finished-request counter under vLLM's names."""

    def __init__(self, registry: CollectorRegistry | None, model_name: str, max_model_len: int) -> None:
        """`registry` None: measured but not exported (`serve --metrics-names ours`)."""
        labels = [model_name, ENGINE]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"vllm:{name}", doc, LABELS, buckets=buckets, registry=registry).labels(*labels)

        tokens = one_two_five_buckets(max_model_len)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                               REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                                REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("request_generation_tokens", "Number of generation tokens processed.",
                                           tokens)
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", tokens)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               LABELS + ["finished_reason"], registry=registry)
        self.labels = labels
        for reason in FINISHED_REASONS:
            self.success.labels(*labels, reason)  # exported as 0 from the start

    def observe_request(self, start: float, first_token: float | None, end: float, reason: str,
                        last: StepEvent | None, num_generated: int, n: int, max_tokens: int) -> None:
        """One finished request: arrival `start`, its first token and end as the server saw them,
        the engine's timestamps from its last event."""
        self.success.labels(*self.labels, reason).inc()
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)
        if last is None:
            return
        self.prompt_tokens.observe(last.num_prompt_tokens)
        self.generation_tokens.observe(num_generated)
        if reason in ("abort", "error"):
            return
        self.e2e.observe(end - start)
        if first_token is not None and num_generated > 1:
            self.tpot.observe((end - first_token) / (num_generated - 1))
        times = last.times
        if times is None or times.scheduled is None:
            return
        finished = times.finished if times.finished is not None else time.monotonic()
        self.queue.observe(max(0.0, times.scheduled - start))
        self.inference.observe(max(0.0, finished - times.scheduled))
        if times.first_token is not None:
            self.prefill.observe(max(0.0, times.first_token - times.scheduled))
            self.decode.observe(max(0.0, finished - times.first_token))
