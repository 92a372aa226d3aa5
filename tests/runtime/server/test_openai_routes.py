"""OpenAI routes beyond completions, through the unmodified openai client: `models.retrieve`,
OpenAI-shaped 404/405 bodies for unknown routes and methods, `/version`; and metric names that
follow Prometheus' rules (a `_total` suffix only on counters)."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmfoundry import __version__


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_models_retrieve(server) -> None:
    model = client(server.url).models.retrieve("toy")
    assert model.id == "toy" and model.object == "model"
    with pytest.raises(openai.NotFoundError) as exc:
        client(server.url).models.retrieve("no-such-model")
    assert exc.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nowhere", 404), ("POST", "/v1/embeddingz", 404),
                                                ("GET", "/v1/completions", 405)])
def test_unknown_routes_answer_with_openai_error_bodies(server, method, path, status) -> None:
    r = httpx.request(method, f"{server.url}{path}")
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and path in error["message"]
    if status == 405:
        assert "POST" in r.headers["allow"]


def test_version(server) -> None:
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}


def test_no_gauge_is_named_like_a_counter(server) -> None:
    families = list(text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text))
    assert families
    for f in families:
        if f.type != "counter":
            assert not any(s.name.endswith("_total") for s in f.samples), (f.name, f.type)
