"""The app's HTTP options (`ApiOptions`, set by serve's flags) and what tooling expects of the
server: CORS with vLLM's flag names (off by default; credentials only for listed origins), /ping, /openapi.json behind a flag, the
/metrics names (ours, vLLM's or both), and what runs (dtype, CPU path, weight format) on
/v1/models and /metrics."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmfoundry.runtime.cpu.isa import isa
from lmfoundry.runtime.server.app import ApiOptions

PAGE = "http://localhost:3000"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "content-type, authorization"}


def test_cors_is_off_by_default(server) -> None:
    """A keyless server on 127.0.0.1 is no API for every web page a browser opens."""
    pre = httpx.options(f"{server.url}/v1/chat/completions", headers=PREFLIGHT)
    assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers={"Origin": PAGE})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_preflights_and_responses_for_the_allowed_origins(make_server) -> None:
    options = ApiOptions(allowed_origins=(PAGE,), allowed_headers=("content-type", "authorization"))
    with make_server(api_key="k", options=options) as live:
        pre = httpx.options(f"{live.url}/v1/chat/completions", headers=PREFLIGHT)  # no key: preflights carry none
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == PAGE
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        other = httpx.options(f"{live.url}/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.test"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        ok = httpx.post(f"{live.url}/v1/chat/completions", json=body, headers={"Origin": PAGE, "Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == PAGE
        # errors reach the page too (a browser hides a response without the header)
        denied = httpx.post(f"{live.url}/v1/chat/completions", json=body, headers={"Origin": PAGE})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == PAGE


EVIL = "http://evil.example"


@pytest.mark.parametrize("origins", [("*",), (PAGE, "*")])
def test_credentials_with_any_origin_cannot_be_built(origins: tuple[str, ...]) -> None:
    """Starlette would answer every origin with that origin and Allow-Credentials: true."""
    with pytest.raises(ValueError, match="list the origins explicitly"):
        ApiOptions(allowed_origins=origins, allow_credentials=True)


def test_credentials_go_only_to_the_listed_origins(make_server) -> None:
    """No origin outside the list gets itself reflected with Allow-Credentials: true, and the
    wildcard without credentials never allows them, cookies or not."""
    cookie = {"Origin": EVIL, "Cookie": "session=1"}
    body = {"prompt": "a", "max_tokens": 1}
    with make_server(options=ApiOptions(allowed_origins=(PAGE,), allow_credentials=True)) as live:
        pre = httpx.options(f"{live.url}/v1/completions", headers=PREFLIGHT)
        assert pre.headers["access-control-allow-origin"] == PAGE
        assert pre.headers["access-control-allow-credentials"] == "true"
        evil = httpx.options(f"{live.url}/v1/completions", headers={**PREFLIGHT, "Origin": EVIL})
        assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers
        r = httpx.post(f"{live.url}/v1/completions", json=body, headers=cookie)
        assert r.headers.get("access-control-allow-origin") is None
    with make_server(options=ApiOptions(allowed_origins=("*",))) as live:
        for r in (httpx.options(f"{live.url}/v1/completions", headers={**PREFLIGHT, "Origin": EVIL}),
                  httpx.post(f"{live.url}/v1/completions", json=body, headers=cookie)):
            assert r.status_code == 200, r.text
            assert "access-control-allow-credentials" not in r.headers, r.headers


def test_ping_answers_like_health(server) -> None:
    health = httpx.get(f"{server.url}/health")
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{server.url}/ping")
        assert (r.status_code, r.json()) == (health.status_code, health.json()) == (200, {"status": "ok"})


def test_openapi_is_served_only_when_enabled(server, make_server) -> None:
    from jsonschema import Draft202012Validator

    assert httpx.get(f"{server.url}/openapi.json").status_code == 404
    with make_server(options=ApiOptions(openapi=True)) as live:
        doc = httpx.get(f"{live.url}/openapi.json").json()
    assert doc["openapi"].startswith("3.") and {"/v1/chat/completions", "/ping", "/metrics"} <= doc["paths"].keys()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = Draft202012Validator({**body, "components": doc["components"]})
    good = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}}
    assert not list(validator.iter_errors(good))
    assert list(validator.iter_errors({**good, "max_token": 3}))  # the schema forbids unknown fields, as the server does


def families(url: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}


@pytest.mark.parametrize("names", ["ours", "vllm"])
def test_metrics_names_choose_the_series(make_server, names: str) -> None:
    with make_server(options=ApiOptions(metrics_names=names)) as live:
        assert httpx.post(f"{live.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
        exported = families(live.url)
    ours = {n for n in exported if n.startswith("lmfoundry_")}
    theirs = {n for n in exported if n.startswith("vllm:")}
    assert len(exported) == len(ours) + len(theirs)
    assert (bool(ours), bool(theirs)) == (names == "ours", names == "vllm"), exported.keys()


def test_models_and_metrics_say_what_runs(server) -> None:
    """The toy engine runs its float32 weights dense on this CPU's vector path."""
    want = {"dtype": "float32", "device": "cpu", "cpu_isa": isa(), "weight_format": "fp32 dense"}
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert model["lmfoundry"] == want
    assert httpx.get(f"{server.url}/v1/models/toy").json()["lmfoundry"] == want
    (sample,) = families(server.url)["lmfoundry_model_info"].samples  # type: ignore[attr-defined]
    assert sample.name == "lmfoundry_model_info" and sample.value == 1
    assert sample.labels == {"model_name": "toy", **want}
