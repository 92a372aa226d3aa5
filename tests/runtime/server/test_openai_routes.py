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


def test_embeddings_with_the_openai_client(server) -> None:
    """/v1/embeddings: one unit vector per input (the last token's final hidden state, as vLLM
    pools decoder models), equal to the engine's own `embed` offline; base64 decodes to the same
    float32 values; token-id inputs embed like their text."""
    import base64

    import numpy as np
    from toy import toy_engine

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    texts = ["The capital of France is", "héllo 👋"]
    out = client.embeddings.create(model="toy", input=texts, encoding_format="float")
    assert [d.index for d in out.data] == [0, 1] and out.usage.prompt_tokens > 0
    vectors = np.array([d.embedding for d in out.data])
    assert vectors.shape == (2, 64) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    offline = toy_engine(seed=2, num_kv_blocks=16)
    want = offline.embed([offline.encode(t) for t in texts])
    np.testing.assert_allclose(vectors, np.array(want), rtol=0, atol=1e-6)
    raw = httpx.post(f"{server.url}/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, vectors[0], rtol=0, atol=1e-6)
    by_ids = client.embeddings.create(model="toy", input=[offline.encode(texts[0])])
    np.testing.assert_allclose(by_ids.data[0].embedding, vectors[0], rtol=0, atol=1e-6)
    for body, param in (({"input": ""}, "input"), ({"input": [999999]}, "input"), ({"input": "x", "dimensions": 8},
                                                                                   "dimensions")):
        r = httpx.post(f"{server.url}/v1/embeddings", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_responses_api_with_the_openai_client(server) -> None:
    """/v1/responses for text: `instructions` and `input` become the chat the model sees (the
    same text as /v1/chat/completions with that system message), `max_output_tokens` cuts it
    (status incomplete), streaming events concatenate to the same text, and `text.format`
    json_schema constrains it through the grammar path."""
    import json

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    want = client.chat.completions.create(model="toy", messages=messages, max_tokens=12, temperature=0)
    got = client.responses.create(model="toy", instructions="Be brief.", input="Hello there", max_output_tokens=12,
                                  temperature=0)
    assert got.output_text == want.choices[0].message.content
    assert got.status == ("incomplete" if want.choices[0].finish_reason == "length" else "completed")
    assert got.usage.input_tokens == want.usage.prompt_tokens and got.usage.output_tokens == want.usage.completion_tokens
    as_items = client.responses.create(model="toy", max_output_tokens=12, temperature=0, input=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "input_text",
                                                                                   "text": "Hello there"}]}])
    assert as_items.output_text == got.output_text
    with client.responses.stream(model="toy", instructions="Be brief.", input="Hello there", max_output_tokens=12,
                                 temperature=0) as stream:
        kinds, deltas = [], []
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(deltas) == final.output_text == got.output_text
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}},
              "required": ["answer"], "additionalProperties": False}
    structured = client.responses.create(model="toy", input="Answer in JSON", max_output_tokens=60, temperature=0,
                                         text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    assert structured.status == "completed", structured.output_text  # the schema's value fits 60 tokens
    assert set(json.loads(structured.output_text)) == {"answer"}
    for body, needle in (({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
                         ({"input": [{"type": "reasoning", "summary": []}]}, "only messages")):
        r = httpx.post(f"{server.url}/v1/responses", json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_responses_api_function_calls(server) -> None:
    """Function tools through /v1/responses: a named tool_choice yields a function_call item whose
    arguments match the function's schema (grammar path), streamed as arguments deltas too; the
    call and its output go back as input items for the next turn."""
    import json

    import jsonschema

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "name": "weather", "description": "Weather in a city", "parameters": params}]
    choice = {"type": "function", "name": "weather"}
    got = client.responses.create(model="toy", input="Weather in Paris?", tools=tools, tool_choice=choice,
                                  max_output_tokens=60, temperature=0)
    calls = [item for item in got.output if item.type == "function_call"]
    assert got.status == "completed" and len(calls) == 1 and calls[0].name == "weather"
    jsonschema.validate(json.loads(calls[0].arguments), params)
    with client.responses.stream(model="toy", input="Weather in Paris?", tools=tools, tool_choice=choice,
                                 max_output_tokens=60, temperature=0) as stream:
        deltas = [ev.delta for ev in stream if ev.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == calls[0].arguments == final.output[0].arguments
    follow = client.responses.create(model="toy", tools=tools, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.usage.input_tokens > got.usage.input_tokens  # the call and its output reached the prompt
