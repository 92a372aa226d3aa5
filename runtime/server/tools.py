"""Function calling for /v1/chat/completions: which output constraint a `tool_choice` asks for, and
how the generated text becomes OpenAI `tool_calls` (whole responses and streamed deltas).

What each `tool_choice` does:

* `"none"`: the tools are left out of the prompt and the output is free text (the request runs
  exactly as one without tools).
* `"auto"` (the default when tools are given): the tools go to the chat template, and the output
  is not constrained. If the whole output is a tool call, it is returned as one: a JSON object
  `{"name": ..., "arguments": {...}}` (`"parameters"` is accepted for `"arguments"`), a JSON list
  of such objects, or such objects each wrapped in `<tool_call>...</tool_call>` (the Hermes / Qwen
  format), naming a given function. Anything else is the message's content. Arguments in auto mode
  are what the model wrote (a JSON object), not checked against the function's schema; use
  `"required"` or a named function for arguments that must match it.
* `"required"`: the output is constrained to a JSON list of one or more calls
  `[{"name": ..., "arguments": {...}}]`, each matching one function's name and parameters schema
  (exactly one call with `parallel_tool_calls: false`).
* `{"type": "function", "function": {"name": F}}`: the output is constrained to F's parameters
  schema and is F's arguments.

A `response_format` other than text cannot be combined with `"required"` or a named function (a
400); with `"auto"` or `"none"` it constrains the output as it does without tools.

A constrained call that runs out of `max_tokens` cannot be parsed: for `"required"` the text is
returned as content with finish_reason "length"; a named call returns the partial arguments with
finish_reason "length" (as OpenAI does). A call parsed from a finished output has finish_reason
"tool_calls".

Streaming: a named call streams its arguments as they are generated; `"required"` output, and
`"auto"` output that starts like a tool call (`{`, `[` or `<tool_call>` after whitespace), is held
back and sent at the end as complete tool calls, or as content when it is not one. Auto output
that starts otherwise streams as content.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from lmfoundry.runtime.engine.tool_calls import TOOL_CALL_TAG, parse_tool_calls

NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
# A function without `parameters` takes no arguments (OpenAI): its arguments are `{}`.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass
class ToolChoice:
    """A request's resolved tool choice: the mode, the functions (name -> parameters schema) and,
    for a named choice, the function."""

    mode: ToolMode
    functions: dict[str, dict[str, Any]] = field(default_factory=dict)
    named: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match (None: unconstrained)."""
        if self.mode == "named":
            assert self.named is not None
            return self.functions[self.named]
        if self.mode == "required":
            return calls_schema(self.functions, self.parallel)
        return None


def calls_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON list of tool calls, each `{"name": F, "arguments": <F's parameters>}` for one of the
    functions; one call at least, and at most one unless `parallel`."""
    call = {"anyOf": [
        {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
         "required": ["name", "arguments"], "additionalProperties": False}
        for name, params in functions.items()]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_delta(index: int, call_id: str | None, name: str | None, arguments: str) -> dict[str, Any]:
    """One entry of a streamed `delta.tool_calls` (id, type and name only in a call's first)."""
    entry: dict[str, Any] = {"index": index}
    function: dict[str, Any] = {}
    if call_id is not None:
        entry.update(id=call_id, type="function")
        function["name"] = name
    function["arguments"] = arguments
    entry["function"] = function
    return entry


def _could_become_call(text: str) -> bool:
    """Whether auto-mode output beginning with `text` may still turn out to be a tool call."""
    s = text.lstrip()
    return not s or s[0] in "{[" or TOOL_CALL_TAG.startswith(s[: len(TOOL_CALL_TAG)])


class ToolCallStream:
    """Turns one choice's generated text into chat deltas under a `ToolChoice`: `feed` takes each
    event's new text and finish reason and returns the delta to send (possibly empty) and the
    finish reason to report. Whole responses are built from the same deltas, so streamed and
    whole responses agree."""

    def __init__(self, tool_choice: ToolChoice) -> None:
        self.tool_choice = tool_choice
        self.held = ""  # text not sent yet (required output, or auto output that may be a call)
        self.passthrough = tool_choice.mode == "none"  # sending text as content as it comes
        self.call_id: str | None = None  # the named call's id once its first delta is sent

    def feed(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        if self.passthrough:
            return ({"content": text} if text else {}), finish_reason
        if self.tool_choice.mode == "named":
            return self._named(text, finish_reason)
        self.held += text
        if self.tool_choice.mode == "auto" and not _could_become_call(self.held):
            self.passthrough = True
            held, self.held = self.held, ""
            return ({"content": held} if held else {}), finish_reason
        if finish_reason is None:
            return {}, None
        held, self.held = self.held, ""
        calls = parse_tool_calls(held, self.tool_choice.functions)
        if calls is None:
            return ({"content": held} if held else {}), finish_reason
        deltas = [_call_delta(i, new_call_id(), name, args) for i, (name, args) in enumerate(calls)]
        return {"tool_calls": deltas}, "tool_calls" if finish_reason == "stop" else finish_reason

    def _named(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        if self.call_id is not None:
            return ({"tool_calls": [_call_delta(0, None, None, text)]} if text else {}), reason
        self.call_id = new_call_id()  # the first delta names the call, even before any argument text
        return {"tool_calls": [_call_delta(0, self.call_id, self.tool_choice.named, text)]}, reason
