"""Structured output through the HTTP API (issue 18): `response_format` json_object / json_schema
and `tools` with every `tool_choice`. The toy model is random, so its unconstrained output is
garbage; every constrained response must still parse and validate against its schema, for any
seed and temperature. Requests without structure must come out exactly as before."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from toy import byte_tokenizer

from lmfoundry.runtime.engine import SamplingParams
from lmfoundry.runtime.engine.tool_calls import parse_tool_calls
from lmfoundry.runtime.engine.validation import RequestValidator
from lmfoundry.runtime.server.protocol import ChatMessage
from lmfoundry.runtime.server.tools import ToolCallStream, ToolChoice

from .test_sampling_params import reference_ids
from .test_server import assert_healthy

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "member", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -100, "maximum": 100},
                   "b": {"type": "integer", "minimum": -100, "maximum": 100}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: arguments must be {}
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "ping": {"type": "object", "additionalProperties": False}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def chat(url: str, **fields) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": 160, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def sse(url: str, path: str = "/v1/chat/completions", **fields) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}{path}", json={"messages": MESSAGES, "max_tokens": 160, "stream": True,
                                                    **fields}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def assert_valid_calls(calls: list[dict], single: bool = False) -> None:
    assert calls and (len(calls) == 1 or not single)
    assert len({c["id"] for c in calls}) == len(calls)
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


# ---- response_format ---------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.5])
def test_json_schema_responses_validate_for_every_seed(server, temperature: float) -> None:
    texts = set()
    for seed in range(3):
        r = chat(server.url, response_format=PERSON_FORMAT, temperature=temperature, seed=seed, n=2)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
            texts.add(choice["message"]["content"])
    assert temperature == 0 or len(texts) > 1


def test_json_schema_stream_matches_the_whole_response(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    whole = client.chat.completions.create(model="toy", messages=MESSAGES, max_tokens=160, temperature=1.0,
                                           seed=4, response_format=PERSON_FORMAT)
    chunks = list(client.chat.completions.create(model="toy", messages=MESSAGES, max_tokens=160, temperature=1.0,
                                                 seed=4, response_format=PERSON_FORMAT, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    jsonschema.validate(json.loads(text), PERSON)


def test_completions_take_response_format_too(server) -> None:
    for seed in range(3):
        r = httpx.post(f"{server.url}/v1/completions", json={
            "prompt": "A person:", "max_tokens": 160, "temperature": 1.0, "seed": seed,
            "response_format": PERSON_FORMAT}, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["text"]), PERSON)


def test_json_object_outputs_are_objects_or_valid_prefixes(server) -> None:
    """json_object allows any object, so a random model may write a string until max_tokens: a
    finished output is a JSON object, a cut one is still a prefix the grammar accepts."""
    grammars = RequestValidator(server.engine.info, server.engine.tokenizer).grammars
    tok = byte_tokenizer()
    finished = 0
    for path, seed in [("/v1/chat/completions", s) for s in range(3)] + [("/v1/completions", s) for s in range(3)]:
        fields = {"max_tokens": 60, "temperature": 1.0, "seed": seed, "response_format": {"type": "json_object"}}
        body = {"messages": MESSAGES, **fields} if "chat" in path else {"prompt": "JSON:", **fields}
        r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "chat" in path else choice["text"]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)
            finished += 1
        else:
            assert choice["finish_reason"] == "length" and text.startswith("{")
            matcher = grammars.matcher({"type": "object"})
            for token in tok(text, add_special_tokens=False).input_ids:
                matcher.accept(token)  # raises if the prefix left the grammar
    assert finished >= 1


# ---- tools -------------------------------------------------------------------------------------
@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_name_a_tool_and_match_its_schema(server, parallel: bool) -> None:
    """Every call names one of the given tools (each subset leaves the model other choices: the
    toy model's favourite first letter differs between them) with arguments valid for it."""
    names, most = set(), 0
    for tools in (TOOLS, TOOLS[1:], TOOLS[2:]):
        for temperature, seed in [(0.0, 0), (0.7, 1), (1.5, 2)]:
            r = chat(server.url, tools=tools, tool_choice="required", parallel_tool_calls=parallel,
                     temperature=temperature, seed=seed)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            assert choice["message"]["content"] is None
            calls = choice["message"]["tool_calls"]
            assert_valid_calls(calls, single=not parallel)
            assert {c["function"]["name"] for c in calls} <= {t["function"]["name"] for t in tools}
            names.update(c["function"]["name"] for c in calls)
            most = max(most, len(calls))
    assert len(names) == 3
    assert most > 1 if parallel else most == 1  # parallel calls do come as a list of several


def test_named_tool_choice_calls_that_function(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        whole = client.chat.completions.create(model="toy", messages=MESSAGES, max_tokens=160, temperature=1.0,
                                               seed=seed, tools=TOOLS, tool_choice=choice)
        message = whole.choices[0].message
        assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
        (call,) = message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        chunks = list(client.chat.completions.create(model="toy", messages=MESSAGES, max_tokens=160,
                                                     temperature=1.0, seed=seed, tools=TOOLS, tool_choice=choice,
                                                     stream=True))
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
        assert all(d.index == 0 and d.id is None for d in deltas[1:])
        assert len(deltas) > 2  # the arguments streamed as they were generated
        assert "".join(d.function.arguments for d in deltas) == call.function.arguments
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
            ["tool_calls"]


def test_required_stream_sends_the_calls_in_the_last_chunk(server) -> None:
    fields = dict(tools=TOOLS, tool_choice="required", temperature=1.0, seed=7)
    whole = chat(server.url, **fields).json()["choices"][0]
    chunks = sse(server.url, **fields)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    assert all(not d["delta"].get("content") for d in deltas[1:])
    with_calls = [d for d in deltas if d["delta"].get("tool_calls")]
    assert len(with_calls) == 1 and with_calls[0]["finish_reason"] == "tool_calls"
    streamed = with_calls[0]["delta"]["tool_calls"]
    assert [d["index"] for d in streamed] == list(range(len(streamed)))
    assert [d["function"] for d in streamed] == [c["function"] for c in whole["message"]["tool_calls"]]
    assert_valid_calls([{k: v for k, v in d.items() if k != "index"} for d in streamed])


def test_a_cut_required_call_is_returned_as_text(server) -> None:
    choice = chat(server.url, tools=TOOLS, tool_choice="required", max_tokens=5, temperature=0).json()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith("[{")


def test_auto_and_none_leave_free_text_alone(server) -> None:
    """The toy model writes no tool call: with "auto" its text is the content, as without tools;
    with "none" the request is the same as one without tools."""
    plain = chat(server.url, temperature=0, max_tokens=40).json()["choices"][0]
    for tool_choice in ("auto", "none", None):
        fields = {"tools": TOOLS, "temperature": 0, "max_tokens": 40}
        if tool_choice is not None:
            fields["tool_choice"] = tool_choice
        got = chat(server.url, **fields).json()["choices"][0]
        assert got == plain, tool_choice
        streamed = sse(server.url, **fields)
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed if c["choices"]) == \
            plain["message"]["content"]


def test_requests_without_structure_are_byte_identical_to_plain_greedy_decoding(server) -> None:
    """No response_format, response_format text, and tools with tool_choice none all give the
    tokens of greedy decoding by full recomputation with the reference model."""
    tok = byte_tokenizer()
    prompt = tok(tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False).input_ids
    want = tok.decode(reference_ids(prompt, SamplingParams(max_tokens=48, temperature=0)), skip_special_tokens=True)
    for fields in ({}, {"response_format": {"type": "text"}}, {"tools": TOOLS, "tool_choice": "none"}):
        got = chat(server.url, temperature=0, max_tokens=48, **fields).json()["choices"][0]["message"]
        assert got == {"role": "assistant", "content": want}, fields
    completion = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 48,
                                                                   "temperature": 0}).json()
    assert completion["choices"][0]["text"] == want


def test_tool_call_history_reaches_the_chat_template(server) -> None:
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "tools": TOOLS,
                                                              "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    rendered = ChatMessage.model_validate(messages[1]).as_template_input()
    assert rendered["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius", "days": 1}
    assert ChatMessage.model_validate(messages[2]).as_template_input()["tool_call_id"] == "call_1"


# ---- refused requests --------------------------------------------------------------------------
def _schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# A recursive $ref without an end: llguidance compiles it, decoding failed a few tokens in (HTTP 500).
ENDLESS = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
BAD = [
    ({"response_format": _schema_format({"type": "nonsense"})}, "response_format"),
    ({"response_format": _schema_format({"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}})},
     "response_format"),
    ({"response_format": _schema_format({"not": {"type": "string"}})}, "response_format"),
    ({"response_format": _schema_format(ENDLESS)}, "response_format"),  # no finite instance (issue 46)
    ({"response_format": _schema_format({"type": "integer", "minimum": "zero"})}, "response_format"),
    ({"response_format": _schema_format([1, 2])}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": TOOLS + [TOOLS[1]], "tool_choice": "auto"}, "tools[3].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": TOOLS + [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools[3].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[p for _, p in BAD])
def test_bad_formats_and_tools_get_400_naming_the_field(server, fields: dict, param: str) -> None:
    r = chat(server.url, max_tokens=4, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert_healthy(server.url)


def test_bad_schema_on_completions_gets_400(server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 4,
                                                         "response_format": _schema_format({"type": "nonsense"})})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "nonsense" in r.json()["error"]["message"]


# ---- how text becomes tool calls (auto mode) ---------------------------------------------------
FUNCTIONS = {"add": ADD, "ping": SCHEMAS["ping"]}


@pytest.mark.parametrize("text,want", [
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', [("add", '{"a": 1, "b": 2}')]),
    (' \n{"name": "add", "parameters": {"a": 1, "b": 2}}\n', [("add", '{"a": 1, "b": 2}')]),
    ('{"name": "add", "arguments": "{\\"a\\": 1}"}', [("add", '{"a": 1}')]),
    ('[{"name": "ping", "arguments": {}}, {"name": "add", "arguments": {"a": 3}}]',
     [("ping", "{}"), ("add", '{"a": 3}')]),
    ('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "add"}</tool_call>',
     [("ping", "{}"), ("add", "{}")]),
    ('{"name": "delete_everything", "arguments": {}}', None),  # not a given function
    ('{"name": "add", "arguments": [1, 2]}', None),
    ('{"name": "add", "arguments": {"a": 1}} and more', None),
    ('<tool_call>{"name": "ping"}</tool_call> trailing words', None),
    ("The answer is 3.", None),
    ('{"a": 1}', None),
    ("", None),
])
def test_parse_tool_calls(text: str, want) -> None:
    assert parse_tool_calls(text, FUNCTIONS) == want


def test_auto_stream_passes_text_through_and_holds_back_what_may_be_a_call() -> None:
    tool_choice = ToolChoice("auto", FUNCTIONS)
    words = ToolCallStream(tool_choice)
    assert words.feed("  ", None) == ({}, None)  # may still become a call
    assert words.feed("Hi", None) == ({"content": "  Hi"}, None)
    assert words.feed(" there", "stop") == ({"content": " there"}, "stop")
    call = ToolCallStream(tool_choice)
    assert call.feed("<tool", None) == ({}, None)
    assert call.feed('_call>{"name": "add", "arguments": {"a": 1}}', None) == ({}, None)
    delta, reason = call.feed("</tool_call>", "stop")
    assert reason == "tool_calls"
    (entry,) = delta["tool_calls"]
    assert entry["index"] == 0 and entry["function"] == {"name": "add", "arguments": '{"a": 1}'}
    broken = ToolCallStream(tool_choice)
    assert broken.feed('{"name": "add", "argu', None) == ({}, None)
    assert broken.feed("", "length") == ({"content": '{"name": "add", "argu'}, "length")


# ---- vLLM's structured-output parameters -------------------------------------------------------
@pytest.mark.parametrize("field", ["guided_json", "guided_json_text", "structured_outputs"])
def test_vllm_guided_json_constrains_like_response_format(server, field: str) -> None:
    """openai's `extra_body={"guided_json": ...}` (vLLM's serving guide) and `structured_outputs`."""
    body = {"guided_json": PERSON} if field == "guided_json" else \
        {"guided_json": json.dumps(PERSON)} if field == "guided_json_text" else {"structured_outputs": {"json": PERSON}}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    for seed in range(2):
        out = client.chat.completions.create(model="toy", messages=MESSAGES, max_tokens=160, temperature=1.0,
                                             seed=seed, extra_body=body)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


CHOICES = ["Paris", "Lyon", "Marseille", "Saint-Étienne"]
GRAMMAR = 'start: "ID-" DIGIT DIGIT DIGIT ("." WORD)?\nDIGIT: /[0-9]/\nWORD: /[a-z]{2,5}/'


@pytest.mark.parametrize("body,check", [
    ({"guided_choice": CHOICES}, lambda text: text in CHOICES),
    ({"structured_outputs": {"choice": CHOICES}}, lambda text: text in CHOICES),
    ({"guided_regex": "[0-9]{3}-[a-z]{2,4}"}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2,4}", text)),
    ({"structured_outputs": {"regex": "(yes|no), because [a-z ]{1,20}"}},
     lambda text: re.fullmatch("(yes|no), because [a-z ]{1,20}", text)),
    ({"guided_grammar": GRAMMAR}, lambda text: re.fullmatch(r"ID-[0-9]{3}(\.[a-z]{2,5})?", text)),
], ids=["guided_choice", "structured_outputs.choice", "guided_regex", "structured_outputs.regex", "guided_grammar"])
def test_vllm_guided_regex_choice_and_grammar_constrain_the_output(server, body: dict, check) -> None:
    """vLLM's other structured-output parameters run through the same llguidance path: sampled at
    temperature 1 from a random model, every output is one the constraint allows."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    finished = 0
    for seed in range(3):
        out = client.chat.completions.create(model="toy", messages=MESSAGES, max_tokens=40, temperature=1.0,
                                             seed=seed, extra_body=body)
        text = out.choices[0].message.content
        if out.choices[0].finish_reason == "stop":
            assert check(text), text
            finished += 1
        else:  # cut by max_tokens: the regex and grammar allow long outputs
            assert "choice" not in json.dumps(body), text
    comp = client.completions.create(model="toy", prompt="Answer:", max_tokens=40, temperature=1.0, seed=5,
                                     extra_body=body)
    if comp.choices[0].finish_reason == "stop":
        assert check(comp.choices[0].text), comp.choices[0].text
        finished += 1
    assert finished >= 2  # the constraint was checked on whole outputs, not only on cut ones


@pytest.mark.parametrize("body,name", [
    ({"guided_regex": "[0-9"}, "regular expression"), ({"guided_grammar": "start: ("}, "grammar"),
    ({"guided_choice": []}, "guided_choice"), ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "both constrain"),
    ({"guided_regex": "a+", "response_format": PERSON_FORMAT}, "both constrain"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"guided_json": PERSON, "response_format": PERSON_FORMAT}, "both constrain"),
    ({"guided_json": ENDLESS}, "no finite instance"),
    ({"guided_grammar": 'start: a\na: "x" a'}, "no finite output"),
])
def test_vllm_fields_we_do_not_implement_are_refused_by_name(server, body: dict, name: str) -> None:
    r = chat(server.url, **body)
    assert r.status_code == 400, r.text
    assert name in r.json()["error"]["message"]
