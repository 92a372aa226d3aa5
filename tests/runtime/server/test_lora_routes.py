"""LoRA adapters over HTTP (the engine in its own process, as `serve` runs it): a request's
`model` picks the adapter (an endpoint that cannot apply one refuses its name), /v1/models lists
each with its parent, adapters load and unload at run time behind the API key (refused while in
use), and /metrics counts requests per adapter under our names and vLLM's."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from helpers import assert_promtool_accepts, write_lora_adapter
from prometheus_client.parser import text_string_to_metric_families
from toy import byte_tokenizer, toy_engine, toy_model

from lmfoundry.runtime.engine import SamplingParams
from lmfoundry.runtime.server.app import ApiOptions

from .test_server import metric

KEY = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    config = toy_model(seed=2).config
    return {"a": write_lora_adapter(folder / "a", config, rank=8, seed=1),
            "b": write_lora_adapter(folder / "b", config, rank=4, seed=2, targets=("q_proj", "v_proj")),
            "c": write_lora_adapter(folder / "c", config, rank=16, seed=3, targets=("qkv_proj", "down_proj")),
            "too_big": write_lora_adapter(folder / "too_big", config, rank=32, seed=4)}


@pytest.fixture(scope="module")
def live(make_server_module, adapters):
    with make_server_module(api_key="k", max_loras=3, max_num_seqs=16, max_waiting_requests=32,
                            lora_modules=(("a", str(adapters["a"])), ("b", str(adapters["b"])))) as live:
        yield live


@pytest.fixture(scope="module")
def make_server_module():
    from .conftest import live_server

    return live_server


def offline(adapters, prompt: str, lora: str | None, max_tokens: int = 8) -> list[int]:
    """The tokens the same engine gives `prompt` offline, alone."""
    engine = toy_engine(seed=2, num_kv_blocks=64, max_loras=3, lora_modules=tuple((k, str(adapters[k])) for k in "abc"))
    ids = byte_tokenizer()(prompt).input_ids
    return engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                 lora=lora))[0].outputs[0].token_ids


def complete(url: str, model: str, prompt: str = "hello there", max_tokens: int = 8, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=KEY, timeout=60,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "logprobs": 0, **extra})


def tokens_of(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def test_models_lists_adapters_with_their_parent(live) -> None:
    data = httpx.get(f"{live.url}/v1/models", headers=KEY).json()["data"]
    assert [m["id"] for m in data] == ["toy", "a", "b"]
    assert data[0].get("parent") is None and {m["parent"] for m in data[1:]} == {"toy"}
    one = httpx.get(f"{live.url}/v1/models/b", headers=KEY).json()
    assert one["id"] == "b" and one["parent"] == "toy"


def test_the_model_field_picks_the_adapter(live, adapters) -> None:
    tok = byte_tokenizer()
    for model, lora in (("toy", None), ("a", "a"), ("b", "b")):
        r = complete(live.url, model)
        assert r.json()["model"] == model
        assert tokens_of(r) == [tok.decode([t]) for t in offline(adapters, "hello there", lora)], model
    r = complete(live.url, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_chat_and_responses_run_the_adapter(live, adapters) -> None:
    tok = byte_tokenizer()
    messages = [{"role": "user", "content": "hello there"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    r = httpx.post(f"{live.url}/v1/chat/completions", headers=KEY, timeout=60, json={
        "model": "a", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": True})
    assert r.status_code == 200 and r.json()["model"] == "a", r.text
    got = [c["token"] for c in r.json()["choices"][0]["logprobs"]["content"]]
    assert got == [tok.decode([t]) for t in offline(adapters, prompt, "a")]
    chat = httpx.post(f"{live.url}/v1/chat/completions", headers=KEY, timeout=60,
                      json={"model": "a", "messages": messages, "max_tokens": 8, "temperature": 0})
    resp = httpx.post(f"{live.url}/v1/responses", headers=KEY, timeout=60,
                      json={"model": "a", "input": "hello there", "max_output_tokens": 8, "temperature": 0})
    assert resp.status_code == 200 and resp.json()["model"] == "a", resp.text
    texts = [part["text"] for item in resp.json()["output"] for part in item.get("content", [])]
    assert "".join(texts) == chat.json()["choices"][0]["message"]["content"]


def test_endpoints_that_cannot_apply_an_adapter_refuse_its_name(live) -> None:
    """Embeddings come from the base weights: an adapter's name there is a 400 saying so, not the
    base's vectors under the adapter's name. The tokenizer endpoints answer for an adapter as for
    the base: an adapter runs with the base's tokenizer (one that adapts the embedding or the LM
    head is refused at load)."""
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{live.url}{path}", headers=KEY, timeout=60, json=body)

    r = post("/v1/embeddings", {"model": "a", "input": "hi"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and "LoRA adapter" in err["message"] and "'toy'" in err["message"], err
    base = post("/v1/embeddings", {"model": "toy", "input": "hi"})
    assert base.status_code == 200 and base.json()["model"] == "toy"
    assert post("/v1/embeddings", {"model": "nope", "input": "hi"}).status_code == 404
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [65, 66]})):
        assert post(path, {**body, "model": "a"}).json() == post(path, {**body, "model": "toy"}).json()


def test_load_and_unload_refuse_unknown_fields_by_name(live, adapters) -> None:
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["c"]), "lora_scale": 2}),
                       ("/v1/unload_lora_adapter", {"lora_name": "a", "force": True})):
        r = httpx.post(f"{live.url}{path}", headers=KEY, timeout=60, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["message"].startswith("Unrecognized request argument supplied: ") and err["param"] in body, err
    assert [m["id"] for m in httpx.get(f"{live.url}/v1/models", headers=KEY).json()["data"]] == ["toy", "a", "b"]


def test_a_lenient_server_ignores_unknown_fields_of_load_and_unload(make_server_module, adapters) -> None:
    with make_server_module(max_loras=1, options=ApiOptions(lenient_request_fields=True)) as live:
        r = httpx.post(f"{live.url}/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": "a", "lora_path": str(adapters["a"]), "lora_scale": 2})
        assert r.status_code == 200, r.text
        r = httpx.post(f"{live.url}/v1/unload_lora_adapter", timeout=60, json={"lora_name": "a", "force": True})
        assert r.status_code == 200, r.text


def test_twelve_concurrent_streams_of_the_base_and_adapters_equal_each_alone(live, adapters) -> None:
    prompts = ["the quick brown fox", "lorem ipsum dolor", "0123456789"]
    models = ["toy", "a", "b"]

    async def run() -> list[list[str]]:
        async with httpx.AsyncClient(headers=KEY, timeout=120) as client:
            async def one(model: str, prompt: str) -> list[str]:
                r = await client.post(f"{live.url}/v1/completions",
                                      json={"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0,
                                            "ignore_eos": True, "logprobs": 0})
                return tokens_of(r)
            return await asyncio.gather(*(one(m, p) for p in prompts for m in models + ["a"]))

    together = asyncio.run(run())
    alone = [tokens_of(complete(live.url, m, p, 10)) for p in prompts for m in models + ["a"]]
    assert together == alone


def test_adapters_load_and_unload_at_run_time(live, adapters) -> None:
    def load(name: str, path, key=KEY) -> httpx.Response:
        return httpx.post(f"{live.url}/v1/load_lora_adapter", headers=key, timeout=60,
                          json={"lora_name": name, "lora_path": str(path)})

    def unload(name: str) -> httpx.Response:
        return httpx.post(f"{live.url}/v1/unload_lora_adapter", headers=KEY, timeout=60, json={"lora_name": name})

    assert load("c", adapters["c"], key={}).status_code == 401
    r = load("c", adapters["c"])
    assert r.status_code == 200 and r.text.startswith("Success")
    assert "c" in [m["id"] for m in httpx.get(f"{live.url}/v1/models", headers=KEY).json()["data"]]
    tok = byte_tokenizer()
    assert tokens_of(complete(live.url, "c")) == [tok.decode([t]) for t in offline(adapters, "hello there", "c")]
    assert load("c", adapters["a"]).status_code == 400  # the name is taken
    assert load("toy", adapters["a"]).status_code == 400  # the base's name
    full = load("d", adapters["a"])
    assert full.status_code == 400 and "slots" in full.json()["error"]["message"]
    assert unload("c").status_code == 200
    big = load("big", adapters["too_big"])
    assert big.status_code == 400 and "exceeds --max-lora-rank 16" in big.json()["error"]["message"]
    assert load("gone", "/no/such/adapter").status_code == 400
    assert unload("c").status_code == 404
    assert complete(live.url, "c").status_code == 404
    assert "c" not in [m["id"] for m in httpx.get(f"{live.url}/v1/models", headers=KEY).json()["data"]]


def test_unloading_an_adapter_in_use_is_refused(make_server_module, adapters) -> None:
    with make_server_module(max_loras=1, step_delay=0.05, lora_modules=(("a", str(adapters["a"])),)) as live:
        async def run() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                long = asyncio.ensure_future(client.post(f"{live.url}/v1/completions", json={
                    "model": "a", "prompt": "hi", "max_tokens": 60, "ignore_eos": True}))
                await asyncio.sleep(1.0)  # the request is running
                busy = await client.post(f"{live.url}/v1/unload_lora_adapter", json={"lora_name": "a"})
                return busy, await long

        busy, long = asyncio.run(run())
        assert busy.status_code == 409 and "in use" in busy.json()["error"]["message"], busy.text
        assert long.status_code == 200
        assert httpx.post(f"{live.url}/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200


def test_lora_off_refuses_loading(make_server_module, adapters) -> None:
    with make_server_module() as live:
        r = httpx.post(f"{live.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a"])})
        assert r.status_code == 400 and "LoRA is off" in r.json()["error"]["message"]
        assert "lora" not in httpx.get(f"{live.url}/metrics").text


def test_metrics_per_adapter(live) -> None:
    before = metric(live.url, "lmfoundry_lora_requests_total", '{lora_name="b"}')
    assert complete(live.url, "b").status_code == 200
    assert metric(live.url, "lmfoundry_lora_requests_total", '{lora_name="b"}') == before + 1
    assert metric(live.url, "lmfoundry_lora_requests_running", '{lora_name="b"}') == 0
    assert metric(live.url, "lmfoundry_lora_max_adapters") == 3
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{live.url}/metrics").text)}
    (info,) = families["vllm:lora_requests_info"].samples
    assert info.labels == {"max_lora": "3", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert info.value > 1e9  # the scrape's time, as vLLM sets it


@pytest.mark.slow
def test_promtool_accepts_the_lora_series(live) -> None:
    assert_promtool_accepts(live.url, "lmfoundry_lora_requests_total")
