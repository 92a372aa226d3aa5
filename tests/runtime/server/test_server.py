"""The HTTP server end to end on 127.0.0.1 (toy model, byte tokenizer with a chat template)."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
from toy import byte_tokenizer, toy_model

from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.server.app import ApiOptions


def metric(url: str, name: str, labels: str = "") -> float:
    """The value of the one sample `name` of /metrics whose labels include `labels` (written
    '{key="value",...}'); every series also carries model_name, the served name ("toy")."""
    from prometheus_client.parser import text_string_to_metric_families

    want = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    text = httpx.get(f"{url}/metrics").text
    found = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
             if s.name == name and want.items() <= s.labels.items()]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples in /metrics"
    return float(found[0])


def assert_healthy(url: str) -> None:
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def test_openai_client_streams_chat_like_offline_generation(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Hello there, héllo 👋"}]
    stream = client.chat.completions.create(model="toy", messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    tok = server.engine.tokenizer
    prompt = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False).input_ids
    want = client.chat.completions.create(model="toy", messages=messages, max_tokens=24, temperature=0)
    assert text == want.choices[0].message.content
    assert finish == [want.choices[0].finish_reason]
    assert usage.prompt_tokens == len(prompt) == want.usage.prompt_tokens
    assert usage.completion_tokens == want.usage.completion_tokens


def test_completions_stream_and_batch(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    parts = list(client.completions.create(model="toy", prompt="abc", max_tokens=12, temperature=0, stream=True))
    streamed = "".join(p.choices[0].text for p in parts if p.choices)
    whole = client.completions.create(model="toy", prompt="abc", max_tokens=12, temperature=0)
    assert streamed == whole.choices[0].text and whole.usage.completion_tokens == 12
    batch = client.completions.create(model="toy", prompt=["abc", "xyz"], n=2, max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == whole.choices[0].text[: len(batch.choices[0].text)]
    ids = client.completions.create(model="toy", prompt=[65, 66, 67], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3
    echo = client.completions.create(model="toy", prompt="abc", max_tokens=2, temperature=0, echo=True, logprobs=1)
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith("abc")
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == 3 + 2
    assert all(v <= 0 for v in lp.token_logprobs[1:])


def test_a_streamed_chunk_stays_one_line_for_line_readers(server) -> None:
    """Text holding U+0085, U+2028 or U+2029 (a model can sample them): str.splitlines(), which
    httpx's iter_lines uses, ends a line at each, so the server escapes them inside the JSON;
    every data line parses and the echoed text comes back unchanged."""
    prompt = "a\u2028b\x85c\u2029d é"
    body = {"model": "toy", "prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).startswith(prompt)


def test_chat_logprobs_and_models(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["toy"]
    r = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6


BAD_BODIES = [
    ("/v1/completions", "{not json"),
    ("/v1/completions", "[1, 2]"),
    ("/v1/completions", json.dumps({"max_tokens": 3})),  # prompt missing
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": "three"})),
    ("/v1/completions", json.dumps({"prompt": "x", "temperature": "hot"})),
    ("/v1/completions", json.dumps({"prompt": {"a": 1}})),
    ("/v1/chat/completions", json.dumps({"messages": "hi"})),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"})),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 0})),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": -5})),
    ("/v1/completions", json.dumps({"prompt": "xyz", "max_tokens": 254})),  # 3 + 254 > 256
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000})),
    ("/v1/completions", json.dumps({"prompt": "x" * 300})),  # longer than the context
    ("/v1/completions", json.dumps({"prompt": "x", "temperature": -0.5})),
    ("/v1/completions", json.dumps({"prompt": "x", "n": 9})),
    ("/v1/completions", json.dumps({"prompt": "x", "n": 0})),
    ("/v1/completions", json.dumps({"prompt": "x", "top_p": 1.5})),
    ("/v1/completions", json.dumps({"prompt": [1, 99999]})),  # token id outside the vocabulary
    ("/v1/completions", json.dumps({"prompt": "x", "logprobs": 50})),
]


@pytest.mark.parametrize("path,body", BAD_BODIES)
def test_invalid_requests_get_400_and_server_stays_up(server, path: str, body: str) -> None:
    r = httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert_healthy(server.url)


def test_unknown_model_is_404(server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


PROBES = {"/health", "/ping", "/version", "/metrics"}  # keyless, as docs/reference/serve.md lists them


def http_routes(app) -> list[tuple[str, str]]:
    """(method, path with "toy" for each parameter) of every route in the app's table. FastAPI
    0.16x keeps an included router as one entry, which `iter_route_contexts` expands; older
    versions list its routes flat."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:
        routes = list(app.routes)
    else:
        routes = list(iter_route_contexts(app.routes))
    return [(method, re.sub(r"\{[^}]*\}", "toy", route.path)) for route in routes for method in sorted(route.methods)]


def test_api_key_guards_every_route_but_the_probes(make_server) -> None:
    """Every route in the app's table, whatever registered it (FastAPI's schema route, the LoRA
    routes, one added later), answers 401 without the key; only the documented probes stay open."""
    with make_server(api_key="s3cret", options=ApiOptions(openapi=True)) as live:
        routes = http_routes(live.app)
        paths = {path for _, path in routes}
        assert {"/v1/chat/completions", "/v1/load_lora_adapter", "/tokenize", "/openapi.json"} | PROBES <= paths
        for method, path in routes:
            r = httpx.request(method, f"{live.url}{path}", json={})
            if path in PROBES:
                assert r.status_code == 200, (method, path, r.text)
            else:
                assert r.status_code == 401, (method, path, r.text)
                assert method == "HEAD" or r.json()["error"]["code"] == "invalid_api_key", (method, path, r.text)
        key = {"Authorization": "Bearer s3cret"}
        doc = httpx.get(f"{live.url}/openapi.json", headers=key)
        assert doc.status_code == 200 and "/v1/chat/completions" in doc.json()["paths"]
        for page in ("/docs", "/redoc"):  # FastAPI's pages are not served, with the key or without
            assert httpx.get(f"{live.url}{page}", headers=key).status_code == 404


def test_api_key(make_server) -> None:
    with make_server(api_key="s3cret") as live:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path in (("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("get", "/v1/models")):
                r = httpx.request(method, f"{live.url}{path}", json={"prompt": "x"}, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{live.url}/health").status_code == 200
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="s3cret")
        assert client.completions.create(model="toy", prompt="x", max_tokens=2).choices[0].finish_reason
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{live.url}/v1", api_key="nope", max_retries=0).models.list()


def _open_stream(client: httpx.Client, url: str, max_tokens: int = 200):
    cm = client.stream("POST", f"{url}/v1/completions",
                       json={"prompt": "hold", "max_tokens": max_tokens, "stream": True, "ignore_eos": True})
    resp = cm.__enter__()
    assert resp.status_code == 200
    return cm, resp


def test_full_queue_gets_429_then_recovers(make_server) -> None:
    # 1 running + 1 waiting sequence allowed; a slowed engine keeps both busy while we ask for a third.
    with make_server(max_num_seqs=1, max_waiting_requests=1, step_delay=0.01) as live:
        with httpx.Client(timeout=30) as client:
            held = [_open_stream(client, live.url) for _ in range(2)]
            r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            r = httpx.post(f"{live.url}/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True})
            assert r.status_code == 429
            for cm, _ in held:
                cm.__exit__(None, None, None)
        deadline = time.monotonic() + 20
        while metric(live.url, "lmfoundry_kv_cache_blocks_used") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert_healthy(live.url)


def test_disconnect_aborts_and_frees_blocks(make_server) -> None:
    with make_server(step_delay=0.005) as live:
        with httpx.Client(timeout=30) as client:
            cm, resp = _open_stream(client, live.url, max_tokens=240)
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert any(line.startswith("data: {") for line in got)
            assert metric(live.url, "lmfoundry_kv_cache_blocks_used") > 0
            cm.__exit__(None, None, None)  # hang up mid-stream
        deadline = time.monotonic() + 20
        while metric(live.url, "lmfoundry_kv_cache_blocks_used") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(live.url, "lmfoundry_kv_cache_blocks_used") == 0
        assert metric(live.url, "lmfoundry_num_requests_running") == 0
        assert metric(live.url, "lmfoundry_requests_total", '{finish_reason="abort"}') == 1
        assert metric(live.url, "lmfoundry_generation_tokens_total") < 240

        # a non-streaming request whose client gives up is aborted too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/completions", json={"prompt": "x", "max_tokens": 240, "ignore_eos": True},
                       timeout=0.3)
        deadline = time.monotonic() + 20
        while metric(live.url, "lmfoundry_requests_total", '{finish_reason="abort"}') < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(live.url, "lmfoundry_requests_total", '{finish_reason="abort"}') == 2
        assert metric(live.url, "lmfoundry_kv_cache_blocks_used") == 0
        assert_healthy(live.url)


def test_metrics_report_latencies_tokens_and_prefix_hits(make_server) -> None:
    with make_server() as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused")
        shared = "A long shared system prefix that many requests repeat verbatim. " * 2
        for i in range(3):
            client.completions.create(model="toy", prompt=shared + str(i), max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert metric(live.url, "lmfoundry_time_to_first_token_seconds_count") == 3
        assert metric(live.url, "lmfoundry_e2e_request_latency_seconds_count") == 3
        assert metric(live.url, "lmfoundry_inter_token_latency_seconds_count") == 3 * 5
        assert metric(live.url, "lmfoundry_generation_tokens_total") == 18
        assert metric(live.url, "lmfoundry_prompt_tokens_total") == 3 * (len(shared) + 1)
        assert metric(live.url, "lmfoundry_prefix_cache_hit_rate") > 0.5
        assert metric(live.url, "lmfoundry_kv_cache_capacity_blocks") == 256
        assert metric(live.url, "lmfoundry_num_preemptions_total") == 0
        assert metric(live.url, "lmfoundry_requests_total", '{finish_reason="length"}') == 3


def test_sampling_params_reach_the_engine(server) -> None:
    """Seeded sampling through HTTP equals the engine's own result for the same params."""
    r = httpx.post(f"{server.url}/v1/completions", json={
        "prompt": "seed", "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7})
    assert r.status_code == 200
    offline = LLMEngine(toy_model(seed=2), byte_tokenizer(), EngineConfig(num_kv_blocks=64, block_size=8))
    want = offline.generate(["seed"], SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=20,
                                                     seed=7))[0].outputs[0].text
    assert r.json()["choices"][0]["text"] == want


def test_engine_failure_fails_the_request_not_the_server(make_server) -> None:
    with make_server(in_process=True) as live:
        step = live.engine.engine.step
        calls = []

        def failing_once():
            if not calls:
                calls.append(1)
                raise RuntimeError("boom")
            return step()

        live.engine.engine.step = failing_once
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        assert metric(live.url, "lmfoundry_kv_cache_blocks_used") == 0
        assert_healthy(live.url)
