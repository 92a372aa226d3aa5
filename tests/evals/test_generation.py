"""The generative check: the prompt file, answer validation, greedy answers on the serving engine and
their paired comparison."""

from __future__ import annotations

import json

import pytest
import torch

from lmfoundry.errors import UserError
from lmfoundry.evals import generation
from lmfoundry.evals.generation import GenerationThresholds, Prompt, answer_is_valid, common_prefix, load_prompts
from lmfoundry.evals.stats import INCONCLUSIVE, PASS, REPORTED

PERSON = Prompt("p", "json", "...", schema={"type": "object", "properties": {"age": {"type": "integer"}},
                                            "required": ["age"]})
WEATHER = Prompt("w", "tool", "...", tools=[{"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}])


def test_the_shipped_prompts_load_with_every_kind():
    prompts = load_prompts()
    kinds = {p.kind for p in prompts}
    assert kinds == {"chat", "json", "tool"} and len({p.id for p in prompts}) == len(prompts)
    tool = next(p for p in prompts if p.kind == "tool")
    system = tool.messages()[0]
    assert system["role"] == "system" and tool.tools[0]["name"] in system["content"]


@pytest.mark.parametrize("body, message", [
    ("chat: [{id: a}]", "needs a string `id` and `prompt`"),
    ("json: [{id: a, prompt: x}]", "needs a `schema`"),
    ("tool: [{id: a, prompt: x}]", "needs `tools`"),
    ("chat: [{id: a, prompt: x}, {id: a, prompt: y}]", "used twice"),
    ("other: []", "a mapping with the keys"),
    ("chat: []", "no prompts"),
])
def test_bad_prompt_files_are_one_line_errors(tmp_path, body, message):
    path = tmp_path / "prompts.yaml"
    path.write_text(body)
    with pytest.raises(UserError, match=message):
        load_prompts(path)


def test_json_answers_are_parsed_and_checked_against_the_schema():
    assert answer_is_valid(PERSON, '{"age": 36, "name": "Ada"}') is True
    assert answer_is_valid(PERSON, '```json\n{"age": 36}\n```') is True
    assert answer_is_valid(PERSON, '{"age": "36"}') is False  # wrong type
    assert answer_is_valid(PERSON, '{"age": 36') is False  # cut off: not JSON
    assert answer_is_valid(PERSON, 'Sure! {"age": 36} is it.') is True  # the value inside a sentence
    assert answer_is_valid(PERSON, '```json\n{"age": 36}\n```\n\nThis object has the age.') is True
    assert answer_is_valid(PERSON, 'Ada is 36.') is False  # no JSON at all
    assert answer_is_valid(Prompt("c", "chat", "..."), "anything") is None


def test_tool_answers_must_be_one_call_with_valid_arguments():
    assert answer_is_valid(WEATHER, '{"name": "get_weather", "arguments": {"city": "Paris"}}') is True
    assert answer_is_valid(WEATHER, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    assert answer_is_valid(WEATHER, '{"name": "get_weather", "arguments": {"town": "Paris"}}') is False
    assert answer_is_valid(WEATHER, 'Calling: ```json\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n```')
    assert answer_is_valid(WEATHER, '{"name": "send_email", "arguments": {"city": "Paris"}}') is False
    two = json.dumps([{"name": "get_weather", "arguments": {"city": c}} for c in ("Paris", "Rome")])
    assert answer_is_valid(WEATHER, two) is False


def _answer(pid, tokens, text=""):
    return {"id": pid, "kind": "chat", "tokens": tokens, "text": text}


def test_comparison_counts_identical_answers_the_shared_prefix_and_valid_answers():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
    prompts = [Prompt("a", "chat", "..."), Prompt("b", "chat", "..."), Prompt("p", "json", "...", PERSON.schema)]
    base = [_answer("a", [1, 2, 3, 4]), _answer("b", [5, 6]), _answer("p", [7, 8], '{"age": 36}')]
    same = generation.compare(base, base, prompts, GenerationThresholds(0.9, 0.9, 0.9), 0.95, 500, 0)
    assert [c.statistic for c in same] == ["exact_match", "prefix_match", "valid_recovery"]
    assert all(c.point == 1.0 and c.verdict == PASS for c in same)
    cand = [_answer("a", [1, 2, 9, 9]), _answer("b", [0]), _answer("p", [7, 8], '{"age": "old"}')]
    diff = generation.compare(cand, base, prompts, GenerationThresholds(0.9, None, None), 0.95, 500, 0)
    exact, prefix, valid = diff
    assert exact.point == pytest.approx(1 / 3) and exact.verdict == INCONCLUSIVE  # 3 prompts decide little
    assert prefix.point == pytest.approx((0.5 + 0 + 1) / 3) and prefix.verdict == REPORTED
    assert prefix.extra["median_tokens_to_divergence"] == 2
    assert (valid.candidate, valid.baseline) == (0.0, 1.0) and valid.verdict == REPORTED and valid.threshold is None
    assert generation.validity(prompts, cand) == [None, None, False]
    with pytest.raises(UserError, match="different generation prompts"):
        generation.compare(cand[:2], base, prompts, GenerationThresholds(None, None, None), 0.95, 500, 0)
    with pytest.raises(UserError, match="changed prompt file"):
        generation.validity(prompts[:2], cand)


def test_greedy_answers_on_the_engine_are_deterministic(tiny_model_dir):
    from lmfoundry.evals.lm_adapter import RuntimeLM
    from lmfoundry.runtime.loader import load_model

    model, tok = load_model(tiny_model_dir, dtype=torch.float32)
    lm = RuntimeLM(model, tok)
    assert not getattr(tok, "chat_template", None)  # a model without a template gets the turns' text
    prompts = [Prompt("a", "chat", "The quick brown fox"), PERSON]
    one = generation.generate(lm, prompts, max_tokens=6)
    two = generation.generate(lm, prompts, max_tokens=6)
    assert one == two and [len(a["tokens"]) for a in one] == [6, 6]
    assert generation.validity(prompts, one) == [None, False]  # a random model writes no JSON
