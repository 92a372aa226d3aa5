"""eval-gate's generative check: greedy answers to fixed chat prompts, candidate against baseline.

Why beside perplexity and multiple-choice accuracy: both score given text, while a served model
writes its own, and 4-bit weights hurt reasoning, code and tool calling more than perplexity
suggests. So the gate decodes a fixed prompt set greedily on the serving engine and compares the
answers token by token (how many tokens until the first divergence, how many answers are
identical), and checks that answers asked to be JSON, or one call to a listed function, parse and
match their schema. Each prompt's result is paired with the baseline's on the same prompt.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from lmfoundry.errors import UserError
from lmfoundry.evals import stats
from lmfoundry.resources import shipped

PROMPTS = shipped("lmfoundry.evals", "data", "generation.yaml")
KINDS = ("chat", "json", "tool")
_FENCE = re.compile(r"```(?:json)?[ \t]*\n?(.*?)```", re.S)


@dataclass
class Prompt:
    id: str
    kind: str  # chat | json | tool
    text: str
    schema: dict[str, Any] | None = None  # json: the answer's schema
    tools: list[dict[str, Any]] = field(default_factory=list)  # tool: name, description, parameters

    def messages(self) -> list[dict[str, str]]:
        """The chat turns. Tools go into a system turn as text, because not every chat template
        renders a `tools` argument, and the same words must reach every model."""
        if self.kind != "tool":
            return [{"role": "user", "content": self.text}]
        listing = "\n".join(json.dumps(t, sort_keys=True) for t in self.tools)
        system = ("You can call these functions:\n" + listing + "\nTo call one, reply with only a JSON object "
                  '{"name": <function name>, "arguments": <object matching its parameters>}.')
        return [{"role": "system", "content": system}, {"role": "user", "content": self.text}]


def load_prompts(path: Path | None = None) -> list[Prompt]:
    """The prompt set (the shipped one by default), every entry checked."""
    path = path or PROMPTS
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{path}: cannot read the generation prompts ({exc})") from None
    if not isinstance(data, dict) or set(data) - set(KINDS):
        raise UserError(f"{path}: a mapping with the keys {', '.join(KINDS)}")
    prompts, seen = [], set()
    for kind in KINDS:
        for i, entry in enumerate(data.get(kind) or []):
            where = f"{path}: {kind}[{i}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or \
                    not isinstance(entry.get("prompt"), str):
                raise UserError(f"{where} needs a string `id` and `prompt`")
            if entry["id"] in seen:
                raise UserError(f"{where}: id {entry['id']!r} is used twice")
            seen.add(entry["id"])
            if kind == "json" and not isinstance(entry.get("schema"), dict):
                raise UserError(f"{where} needs a `schema` mapping")
            tools = entry.get("tools") or []
            if kind == "tool" and (not tools or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                        for t in tools)):
                raise UserError(f"{where} needs `tools`, each with a `name`")
            prompts.append(Prompt(entry["id"], kind, entry["prompt"], entry.get("schema"), tools))
    if not prompts:
        raise UserError(f"{path}: no prompts")
    return prompts


def tier_prompts(spec: Any) -> list[Prompt]:
    """The prompts of a tier's `generation` section (a GenerationSpec): its file or the shipped set."""
    return load_prompts(Path(spec.prompts).expanduser() if spec.prompts else None)


def _json_value(text: str) -> Any:
    """The JSON value an answer gives: the whole answer, else its first fenced code block, else
    the first JSON object or array in it. Chat models wrap JSON in a ```json fence and add a
    sentence after it; what is checked is whether the value they meant parses and fits."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    fenced = _FENCE.search(text)
    if fenced:
        return json.loads(fenced.group(1))
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        raise ValueError("no JSON value in the answer")
    return json.JSONDecoder().raw_decode(text, min(starts))[0]


def answer_is_valid(prompt: Prompt, text: str) -> bool | None:
    """Whether a json/tool answer parses and matches its schema; None for chat prompts."""
    import jsonschema

    if prompt.kind == "chat":
        return None
    if prompt.kind == "json":
        try:
            jsonschema.validate(_json_value(text), prompt.schema or {})
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    from lmfoundry.runtime.engine.tool_calls import parse_tool_calls

    functions = {t["name"]: t.get("parameters") or {} for t in prompt.tools}
    calls = parse_tool_calls(text, functions)  # the forms the server accepts, <tool_call> tags included
    if calls is None:
        try:
            calls = parse_tool_calls(json.dumps(_json_value(text)), functions)
        except ValueError:
            return False
    if not calls or len(calls) != 1:
        return False
    name, arguments = calls[0]
    try:
        jsonschema.validate(json.loads(arguments), functions[name])
    except jsonschema.ValidationError:
        return False
    return True


def _prompt_ids(lm: Any, prompt: Prompt) -> list[int]:
    """The prompt through the model's chat template; a model without one (a base model) gets the
    turns' text, one paragraph each, with the tokenizer's own special tokens."""
    if getattr(lm.tokenizer, "chat_template", None):
        return list(lm.tok_encode(lm.apply_chat_template(prompt.messages()), add_special_tokens=False))
    return list(lm.tok_encode("\n\n".join(turn["content"] for turn in prompt.messages()) + "\n"))


def generate(lm: Any, prompts: list[Prompt], max_tokens: int) -> list[dict[str, Any]]:
    """Greedy answers of `lm` (a RuntimeLM) on its serving engine: token ids and text (validity
    is judged at comparison time, so a cached answer is judged by the current rules)."""
    from lmfoundry.runtime.engine.sampling_params import SamplingParams

    ids = [_prompt_ids(lm, p) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, skip_special_tokens=True)
    outs = lm.engine().generate(ids, params)
    results = []
    for prompt, out in zip(prompts, outs, strict=True):
        text = out.outputs[0].text
        results.append({"id": prompt.id, "kind": prompt.kind, "tokens": list(out.outputs[0].token_ids),
                        "text": text})
    return results


def common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens two sequences share before they first differ."""
    n = 0
    for x, y in zip(a, b, strict=False):  # the answers may differ in length
        if x != y:
            break
        n += 1
    return n


@dataclass
class GenerationThresholds:
    min_exact_match: float | None  # share of answers identical to the baseline's
    min_prefix_match: float | None  # mean share of the baseline's tokens before the first divergence
    min_valid_recovery: float | None  # valid structured answers, candidate / baseline


def validity(prompts: list[Prompt], answers: list[dict[str, Any]]) -> list[bool | None]:
    """Each answer judged against its prompt (None for chat prompts)."""
    by_id = {p.id: p for p in prompts}
    if [a["id"] for a in answers] != [p.id for p in prompts]:
        raise UserError("the answers are not those of the generation prompts (a changed prompt file?)")
    return [answer_is_valid(by_id[a["id"]], a["text"]) for a in answers]


def compare(cand: list[dict[str, Any]], base: list[dict[str, Any]], prompts: list[Prompt],
            limits: GenerationThresholds, confidence: float, resamples: int, seed: int) -> list[stats.Comparison]:
    """Paired statistics of the candidate's answers against the baseline's, prompt by prompt."""
    if [r["id"] for r in cand] != [r["id"] for r in base]:
        raise UserError("candidate and baseline answered different generation prompts")
    exact = np.array([[float(c["tokens"] == b["tokens"])] for c, b in zip(cand, base, strict=True)])
    prefix = np.array([[common_prefix(c["tokens"], b["tokens"]) / max(1, len(b["tokens"]))]
                       for c, b in zip(cand, base, strict=True)])
    rows = [
        stats.window_statistic("exact_match", exact, stats.mean_of, limits.min_exact_match, True, 1.0,
                               confidence, resamples, seed),
        stats.window_statistic("prefix_match", prefix, stats.mean_of, limits.min_prefix_match, True, 1.0,
                               confidence, resamples, seed + 1),
    ]
    first = [common_prefix(c["tokens"], b["tokens"]) for c, b in zip(cand, base, strict=True)]
    rows[1].extra["median_tokens_to_divergence"] = float(np.median(first))
    pairs = [(c, b) for c, b in zip(validity(prompts, cand), validity(prompts, base), strict=True) if b is not None]
    if pairs:
        valid = stats.paired_accuracy([float(bool(c)) for c, _ in pairs], [float(bool(b)) for _, b in pairs],
                                      limits.min_valid_recovery or 1.0, confidence, resamples, seed + 2)
        valid.statistic = "valid_recovery"
        if limits.min_valid_recovery is None:
            valid.threshold, valid.verdict, valid.samples_needed = None, stats.REPORTED, None
        rows.append(valid)
    return rows
