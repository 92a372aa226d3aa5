"""Penalties, logit_bias and min_p through the HTTP API (issue 18): validated with 400s naming the
field, and applied in the engine's sampler, greedy decoding included."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from toy import byte_tokenizer, toy_model

from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.engine.sampler import reference_process_row

from .test_server import assert_healthy

EOS = 258


def offline(prompt: list[int], params: SamplingParams):
    """The same request on a fresh engine over the conftest server's model."""
    engine = LLMEngine(toy_model(seed=2), byte_tokenizer(), EngineConfig(num_kv_blocks=64, block_size=8))
    return engine.generate([prompt], params)[0].outputs[0]


def reference_ids(prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding by full recomputation with the reference model and the reference
    processing of each step's logits."""
    model = toy_model(seed=2)
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            token = int(reference_process_row(model(torch.tensor([ids]))[0, -1], params, prompt, out).argmax())
            out.append(token)
            ids.append(token)
            if token == EOS and not params.ignore_eos:
                break
    return out


def post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": "high"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.5}, "min_p"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "up"}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),  # outside the vocabulary
    ({"logit_bias": {"259": 1}}, "logit_bias"),  # one past the toy vocabulary (259 tokens)
    ({"logit_bias": [1, 2]}, "logit_bias"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields,name", BAD, ids=lambda x: json.dumps(x) if isinstance(x, dict) else x)
def test_bad_sampling_values_get_400_naming_the_field(server, path: str, fields: dict, name: str) -> None:
    base = {"prompt": "x", "max_tokens": 3} if path == "/v1/completions" else dict(CHAT)
    r = post(server.url, {**base, **fields}, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and name in err["message"] + str(err["param"]), err
    assert_healthy(server.url)


def test_penalties_change_greedy_text_as_the_reference_says(server) -> None:
    prompt = list(b"the cat and the dog and the cat and the dog and ")
    plain = post(server.url, {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}).json()
    for fields in ({"repetition_penalty": 1.8}, {"frequency_penalty": 1.5, "presence_penalty": 0.5},
                   {"presence_penalty": -2.0}):
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **fields)
        body = post(server.url, {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                 **fields}).json()
        out = offline(prompt, params)
        assert out.token_ids == reference_ids(prompt, params), fields
        assert body["choices"][0]["text"] == out.text
        assert body["choices"][0]["text"] != plain["choices"][0]["text"], fields


def test_logit_bias_forces_and_bans_tokens(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    z = byte_tokenizer().convert_tokens_to_ids("Z")
    forced = client.completions.create(model="toy", prompt="hello", max_tokens=6, temperature=0,
                                       logit_bias={str(z): 100})
    assert forced.choices[0].text == "Z" * 6
    sampled = client.completions.create(model="toy", prompt="hello", max_tokens=6, temperature=1.0, seed=3,
                                        logit_bias={str(z): 100})
    assert sampled.choices[0].text == "Z" * 6
    first = post(server.url, {"prompt": "hello", "max_tokens": 1, "temperature": 0, "logprobs": 0}).json()
    top_id = offline(byte_tokenizer()("hello").input_ids, SamplingParams(max_tokens=1, temperature=0)).token_ids[0]
    banned = post(server.url, {"prompt": "hello", "max_tokens": 1, "temperature": 0, "logprobs": 0,
                               "logit_bias": {str(top_id): -100}}).json()
    assert banned["choices"][0]["text"] != first["choices"][0]["text"]
    # logprobs stay the model's own: the banned token still has its raw logprob on record
    assert banned["choices"][0]["logprobs"]["token_logprobs"][0] < first["choices"][0]["logprobs"]["token_logprobs"][0]


def test_min_p_one_keeps_only_the_top_token(server) -> None:
    greedy = post(server.url, {"prompt": "abc", "max_tokens": 10, "temperature": 0}).json()["choices"][0]["text"]
    for seed in (1, 2, 3):
        r = post(server.url, {"prompt": "abc", "max_tokens": 10, "temperature": 1.5, "min_p": 1.0, "seed": seed})
        assert r.json()["choices"][0]["text"] == greedy
    wide = {post(server.url, {"prompt": "abc", "max_tokens": 10, "temperature": 1.5, "seed": s}).json()["choices"][0]
            ["text"] for s in (1, 2, 3)}
    assert len(wide) > 1  # without min_p these seeds do draw different texts


def test_chat_applies_penalties(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "say it again and again"}]
    r = client.chat.completions.create(model="toy", messages=messages, max_tokens=20, temperature=0,
                                       frequency_penalty=1.2, presence_penalty=0.3,
                                       extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    tok = byte_tokenizer()
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False).input_ids
    params = SamplingParams(max_tokens=20, temperature=0, frequency_penalty=1.2, presence_penalty=0.3,
                            repetition_penalty=1.3, ignore_eos=True)
    assert r.choices[0].message.content == offline(ids, params).text
    assert offline(ids, params).token_ids == reference_ids(ids, params)
