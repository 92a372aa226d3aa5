"""/metrics labels every series with model_name and exports the KV-cache usage fraction; the
Grafana dashboard (dashboards/lmfoundry.json) queries only what a started server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from helpers import assert_promtool_accepts
from prometheus_client.parser import text_string_to_metric_families

from .test_server import metric

DASHBOARD = Path(__file__).resolve().parents[3] / "dashboards" / "lmfoundry.json"

# PromQL words that are neither metric nor label names.
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
            "group_right", "inf", "nan", "start", "end"}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def exported(url: str) -> dict[str, set[str]]:
    """Sample name -> the label names it carries, from a live /metrics."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def queries(node: Any) -> Iterator[str]:
    """Every PromQL expression of a dashboard: panel targets' `expr`, and the metric queried by
    a template variable's label_values()."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            elif key == "definition" and isinstance(value, str):
                m = re.fullmatch(r"\s*label_values\(\s*([^,]+?)\s*,\s*(\w+)\s*\)\s*", value)
                assert m, f"unexpected variable query {value!r}"
                yield f"group by ({m.group(2)}) ({m.group(1)})"
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def names_in(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression refers to. Grafana variables, strings and range
    selectors are dropped; label names come from matchers and grouping clauses; what is left that
    is not a function call or a keyword is a metric name."""
    expr = re.sub(r"\$\{[^}]*\}|\$\w+", "", expr)
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    labels: set[str] = set()
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels.update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    for _, names in GROUPING.findall(expr):
        labels.update(n.strip() for n in names.split(",") if n.strip())
    expr = GROUPING.sub(" ", expr)
    words = re.findall(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", expr)
    metrics = {w for w, call in words if not call and w.lower() not in KEYWORDS}
    return metrics, labels


def test_names_in_reads_promql() -> None:
    expr = ('histogram_quantile(0.95, sum by (le, model_name) (rate(foo_bucket{model_name=~"$model_name",'
            'a!="x{y}"}[$__rate_interval]))) / on(model_name) group_left bar_total offset 5m')
    assert names_in(expr) == ({"foo_bucket", "bar_total"}, {"le", "model_name", "a"})


@pytest.fixture(scope="module")
def live() -> Iterator[Any]:
    from .conftest import live_server

    with live_server() as live:
        # Traffic of every kind the dashboard plots: finished requests, tokens, a prefix-cache hit,
        # a rejected request.
        for _ in range(2):
            r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "a shared prompt prefix, long enough",
                                                              "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
        assert httpx.post(f"{live.url}/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
        yield live


def test_every_series_has_model_name_and_kv_usage_is_a_fraction(live) -> None:
    series = exported(live.url)
    lmfoundry = {name: labels for name, labels in series.items() if name.startswith("lmfoundry_")}
    assert len(lmfoundry) > 20
    assert all("model_name" in labels for labels in lmfoundry.values()), lmfoundry
    assert metric(live.url, "lmfoundry_requests_total", '{model_name="toy",finish_reason="length"}') == 2
    assert metric(live.url, "lmfoundry_requests_total", '{model_name="toy",finish_reason="error"}') == 0
    assert metric(live.url, "lmfoundry_requests_rejected_total", '{model_name="toy",status="400"}') == 1
    assert metric(live.url, "lmfoundry_generation_tokens_total", '{model_name="toy"}') == 8
    assert metric(live.url, "lmfoundry_kv_cache_usage_ratio", '{model_name="toy"}') == 0.0


def test_kv_usage_is_read_at_scrape_time() -> None:
    """Scraped between two steps, the usage ratio is the engine's own (an engine in this process,
    so the test can look at its block manager)."""
    from .conftest import live_server

    with live_server(in_process=True) as live:
        llm = live.engine.engine  # type: ignore[attr-defined]
        step = llm.step
        used = []

        def watched() -> Any:
            events = step()
            bm = llm.block_manager
            used.append((bm.num_used_blocks / bm.num_blocks, metric(live.url, "lmfoundry_kv_cache_usage_ratio")))
            return events

        llm.step = watched
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "y" * 100, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200
    assert any(0 < ratio < 1 and ratio == seen for ratio, seen in used), used


def test_dashboard_queries_only_exported_metrics(live) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    series = exported(live.url)
    exprs = list(queries(dashboard))
    assert len(exprs) >= 15
    used: set[str] = set()
    for expr in exprs:
        metrics, labels = names_in(expr)
        assert metrics, f"no metric in {expr!r}"
        missing = metrics - series.keys()
        assert not missing, f"{expr!r} queries {missing}, which /metrics does not export"
        carried = set().union(*(series[m] for m in metrics))
        assert labels <= carried, f"{expr!r} uses labels {labels - carried} that {metrics} do not carry"
        used |= metrics
    # the dashboard shows the series this issue added
    assert {"lmfoundry_kv_cache_usage_ratio", "lmfoundry_requests_total", "lmfoundry_generation_tokens_total",
            "lmfoundry_time_to_first_token_seconds_bucket"} <= used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "model_name"]


# The vLLM series we promise (name -> Prometheus type), so that dashboards and autoscalers built
# for vLLM find them; each carries vLLM's labels model_name and engine.
VLLM_SERIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter", "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram", "vllm:request_params_max_tokens": "histogram",
}


def test_vllm_series_are_exported_with_vllm_names_types_and_labels(live) -> None:
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{live.url}/metrics").text)}
    for name, kind in VLLM_SERIES.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
        for sample in families[name].samples:
            assert sample.labels["model_name"] == "toy" and sample.labels["engine"] == "0", sample

    def value(name: str, **labels: str) -> float:
        return sum(s.value for f in families.values() for s in f.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    # The fixture's traffic: two finished requests of 4 tokens each.
    assert value("vllm:request_success_total", finished_reason="length") == 2
    assert value("vllm:generation_tokens_total") == value("lmfoundry_generation_tokens_total") == 8
    assert value("vllm:request_generation_tokens_sum") == 8
    assert value("vllm:prompt_tokens_total") == value("lmfoundry_prompt_tokens_total")
    for phase in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
                  "request_inference_time", "time_to_first_token"):
        assert value(f"vllm:{phase}_seconds_count") == 2, phase
    # the engine's phases fit inside what the server measured end to end
    inside = sum(value(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    assert 0 < inside <= value("vllm:e2e_request_latency_seconds_sum")
    assert value("vllm:inter_token_latency_seconds_count") == value("lmfoundry_inter_token_latency_seconds_count")


@pytest.mark.slow
def test_promtool_accepts_our_series(live) -> None:
    assert_promtool_accepts(live.url, "lmfoundry_requests_total")


@pytest.mark.slow
def test_promtool_accepts_the_whole_endpoint_with_our_names() -> None:
    """`serve --metrics-names ours`: a CI that lints the live /metrics as it is passes; the default
    endpoint fails only on vLLM's names (their ':')."""
    import shutil
    import subprocess

    from lmfoundry.runtime.server.app import ApiOptions

    from .conftest import live_server

    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")

    def lint(names: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        with live_server(options=ApiOptions(metrics_names=names)) as live:
            assert httpx.post(f"{live.url}/v1/completions", json={"prompt": "abc", "max_tokens": 3}).status_code == 200
            text = httpx.get(f"{live.url}/metrics").text
        return text, subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                                    timeout=60)

    text, result = lint("ours")
    assert "vllm:" not in text and "lmfoundry_model_info{" in text
    assert result.returncode == 0, result.stdout + result.stderr
    text, result = lint("both")
    assert result.returncode != 0
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert complaints and all("vllm:" in line for line in complaints), complaints
