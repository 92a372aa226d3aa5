"""Unknown request fields (`request_body.parse_body`): every endpoint answers 400 naming the field, as
OpenAI does for an unrecognized argument; `ApiOptions.lenient_request_fields` (`serve
--lenient-request-fields`) logs and drops them, as vLLM does. What real clients send still passes:
the openai SDK's requests, lm-eval's local-completions payloads, vLLM's extensions, assistant
messages sent back with the keys the SDK gave them."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import httpx
import openai
import pytest
from toy import CHATML_TEMPLATE

from lmfoundry.runtime.server.app import ApiOptions

USER = [{"role": "user", "content": "hi"}]
ENDPOINTS = [
    ("/v1/completions", {"prompt": "ab", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/v1/embeddings", {"input": "hi"}),
    ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": [65, 66]}),
]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def refused(r: httpx.Response, field: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error", err
    assert err["message"].startswith("Unrecognized request argument supplied: ") and field in err["message"], err


@pytest.mark.parametrize("path,body", ENDPOINTS)
def test_every_endpoint_refuses_an_unknown_field_by_name(server, path: str, body: dict) -> None:
    assert post(server.url, path, body).status_code == 200
    refused(post(server.url, path, {**body, "unknown_field_xyz": 1}), "unknown_field_xyz")


def test_a_typo_beside_the_real_field_is_refused_not_ignored(server) -> None:
    """`max_token: 3` beside `max_tokens: 6` used to generate 6 tokens and say nothing."""
    refused(post(server.url, "/v1/chat/completions", {"messages": USER, "max_token": 3, "max_tokens": 6}), "max_token")
    refused(post(server.url, "/v1/completions", {"prompt": "a", "max_tokens": 2, "temprature": 0}), "temprature")
    # inside option objects too: a misspelt schema would otherwise leave the output unconstrained
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "shcema": {"type": "object"}}}
    refused(post(server.url, "/v1/chat/completions", {"messages": USER, "response_format": fmt}),
            "response_format.json_schema.shcema")
    refused(post(server.url, "/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"include_usge": True}}),
            "stream_options.include_usge")
    tools = [{"type": "function", "function": {"name": "f", "paramters": {}}}]
    refused(post(server.url, "/v1/chat/completions", {"messages": USER, "tools": tools}), "tools.0.function.paramters")


def test_the_lenient_server_logs_and_ignores_unknown_fields(make_server, caplog) -> None:
    with make_server(options=ApiOptions(lenient_request_fields=True)) as live:
        with caplog.at_level(logging.WARNING, logger="lmfoundry.server"):
            r = post(live.url, "/v1/chat/completions", {"messages": USER, "max_token": 3, "max_tokens": 6,
                                                        "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6  # max_tokens, the field it knows
        assert any("max_token" in rec.getMessage() for rec in caplog.records), caplog.text
        for path, body in ENDPOINTS:
            assert post(live.url, path, {**body, "unknown_field_xyz": {"a": 1}}).status_code == 200, path
        fmt = {"type": "json_object", "strict": True}
        assert post(live.url, "/v1/chat/completions", {"messages": USER, "max_tokens": 2,
                                                       "response_format": fmt}).status_code == 200
        # dropping what it does not know never lets through what it knows and refuses
        r = post(live.url, "/v1/chat/completions", {"messages": USER, "use_beam_search": True, "extra": 1})
        assert r.status_code == 400 and "use_beam_search" in r.json()["error"]["message"]
        r = post(live.url, "/v1/completions", {"prompt": "a", "max_tokens": "two", "extra": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_unknown_keys_of_a_named_tool_choice_follow_the_body_rules(server, make_server) -> None:
    """tool_choice is checked on its own (a string or an object), with the body's rule for unknown
    keys: refused by name, or dropped by a lenient server, as at the top level."""
    choice = {"type": "function", "function": {"name": "f", "strict": True}, "extra": 1}
    body = {"messages": USER, "max_tokens": 2, "tools": TOOLS, "tool_choice": choice}
    err = post(server.url, "/v1/chat/completions", body).json()["error"]
    assert err["message"].startswith("Unrecognized request arguments supplied: tool_choice.function.strict, "
                                     "tool_choice.extra "), err
    assert err["param"] == "tool_choice.function.strict"
    r = post(server.url, "/v1/chat/completions", {**body, "tool_choice": {"type": "function"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.function", r.text
    with make_server(options=ApiOptions(lenient_request_fields=True)) as live:
        r = post(live.url, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"
        r = post(live.url, "/v1/chat/completions", {**body, "tool_choice": {**choice, "function": {"name": "g"}}})
        assert r.status_code == 400 and "'g'" in r.json()["error"]["message"]  # what it knows is still checked


def test_what_the_openai_sdk_sends_passes(server) -> None:
    """The SDK's parameters (each only sent when given), OpenAI's no-op fields and vLLM's extensions
    through extra_body, on every endpoint the SDK calls."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="toy", messages=USER, max_completion_tokens=4, temperature=0.7, top_p=0.9, n=2, seed=3, stop=["\n\n"],
        frequency_penalty=0.1, presence_penalty=0.1, logit_bias={"65": 1}, logprobs=True, top_logprobs=2,
        user="u1", store=False, metadata={"team": "a"}, service_tier="auto", prompt_cache_key="k",
        safety_identifier="s", response_format={"type": "json_object"},
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": False, "min_tokens": 1,
                    "skip_special_tokens": True, "include_stop_str_in_output": False, "stop_token_ids": [65],
                    "chat_template_kwargs": {"enable_thinking": False}})
    assert len(chat.choices) == 2
    stream = client.chat.completions.create(model="toy", messages=USER, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}, parallel_tool_calls=False,
                                            tools=[{"type": "function", "function": {"name": "f", "strict": True,
                                                   "description": "d", "parameters": {"type": "object"}}}])
    assert list(stream)[-1].usage is not None
    comp = client.completions.create(model="toy", prompt="ab", max_tokens=3, best_of=1, n=1, echo=True, logprobs=1,
                                     temperature=0, seed=1, stop="\n", user="u", frequency_penalty=0.0,
                                     extra_body={"guided_regex": "[a-z]+"})
    assert comp.choices[0].text.startswith("ab")
    vector = client.embeddings.create(model="toy", input=["a", "b"], user="u")  # the SDK asks for base64
    assert len(vector.data) == 2
    resp = client.responses.create(model="toy", input="hi", instructions="be brief", max_output_tokens=3,
                                   temperature=0, top_p=1.0, store=False, metadata={"a": "b"}, user="u",
                                   service_tier="auto", prompt_cache_key="k", safety_identifier="s")
    assert resp.status in ("completed", "incomplete")
    # an assistant message sent back as the SDK returned it (null refusal, empty annotations, ...)
    turn = client.chat.completions.create(model="toy", messages=USER, max_tokens=2).choices[0].message
    again = client.chat.completions.create(model="toy", max_tokens=2,
                                           messages=[*USER, turn.model_dump(), {"role": "user", "content": "more"}])
    assert again.choices[0].message.role == "assistant"


def test_vllm_clients_defaults_pass_and_other_values_are_refused(server) -> None:
    """vLLM fields this server does not implement: vLLM's default value changes nothing and passes;
    anything else is refused by name."""
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
                "priority": 0, "truncate_prompt_tokens": None, "bad_words": [], "allowed_token_ids": None}
    assert post(server.url, "/v1/completions", {"prompt": "a", "max_tokens": 2, **defaults}).status_code == 200
    for name, value in (("length_penalty", 0.5), ("priority", 3), ("bad_words", ["x"])):
        r = post(server.url, "/v1/completions", {"prompt": "a", "max_tokens": 2, name: value})
        assert r.status_code == 400 and name in r.json()["error"]["message"], r.text
    for field, value in (("functions", [{"name": "f"}]), ("reasoning_effort", "low"), ("modalities", ["audio"])):
        r = post(server.url, "/v1/chat/completions", {"messages": USER, field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    assert post(server.url, "/v1/chat/completions", {"messages": USER, "max_tokens": 2,
                                                     "modalities": ["text"]}).status_code == 200


def test_lm_eval_local_completions_payloads_pass(server) -> None:
    """lm-eval's own payload builders (local-completions: loglikelihood and generate_until;
    local-chat-completions), not a copy of what they send."""
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    lm = SimpleNamespace(model="toy", _max_gen_toks=4)
    gen = {"until": ["\n\n"], "do_sample": False, "max_gen_toks": 4, "temperature": 0.0}
    payloads = [
        ("/v1/completions", LocalCompletionsAPI._create_payload(lm, [[65, 66, 67]], generate=False)),
        ("/v1/completions", LocalCompletionsAPI._create_payload(lm, ["abc", "de"], generate=True, gen_kwargs=dict(gen),
                                                                eos="<|im_end|>")),
        ("/v1/chat/completions", LocalChatCompletion._create_payload(lm, USER, generate=True, gen_kwargs=dict(gen),
                                                                     eos="<|im_end|>")),
    ]
    for path, body in payloads:
        r = post(server.url, path, body)
        assert r.status_code == 200, (body, r.text)


def test_chat_template_kwargs_reach_the_template(make_server) -> None:
    """vLLM's chat_template_kwargs become template variables (Qwen3's enable_thinking, say); the
    template call's own arguments are refused."""
    with make_server(in_process=True) as live:
        live.engine.tokenizer.chat_template = (
            "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}" + CHATML_TEMPLATE)

        def prompt_tokens(**extra) -> int:
            r = post(live.url, "/v1/chat/completions", {"messages": USER, "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text
            return int(r.json()["usage"]["prompt_tokens"])

        plain = prompt_tokens()
        assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == plain + len("/no_think ")  # a byte a token
        assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain
        r = post(live.url, "/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"tokenize": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
