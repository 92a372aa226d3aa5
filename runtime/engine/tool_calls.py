"""Which generated text is a tool call: the output forms a chat model writes calls in (a JSON
object or list of `{"name", "arguments"}`, or each wrapped in Hermes / Qwen `<tool_call>` tags).
The server turns such text into OpenAI `tool_calls` (runtime/server/tools.py, which documents
what each `tool_choice` does) and evals score generations with the same reading."""

from __future__ import annotations

import json
import re
from typing import Any

TOOL_CALL_TAG = "<tool_call>"
_TAGGED = re.compile(r"\s*<tool_call>(.*?)</tool_call>\s*", re.S)


def parse_tool_calls(text: str, names: set[str] | dict[str, Any]) -> list[tuple[str, str]] | None:
    """(name, arguments as a JSON string) of every call when the whole of `text` is tool calls
    naming functions in `names` (the forms above); None when it is
    not, or names an unknown function."""
    stripped = text.strip()
    if stripped.startswith(TOOL_CALL_TAG):
        bodies = _TAGGED.findall(stripped)
        if not bodies or _TAGGED.sub("", stripped).strip():
            return None
    else:
        bodies = [stripped]
    calls: list[tuple[str, str]] = []
    for body in bodies:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in names:
                return None
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(args, dict):
                return None
            calls.append((item["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None
