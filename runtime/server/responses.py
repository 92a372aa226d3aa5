"""OpenAI response bodies built from engine events: streamed chunks and whole responses of
/v1/completions (legacy logprobs format, echo) and /v1/chat/completions (chat logprobs format).

Legacy completions logprobs, as OpenAI returns them and as `lm_eval --model local-completions`
reads them for loglikelihood tasks: `tokens` (each token's text), `token_logprobs` (null for the
first prompt token when echoed: nothing predicts it), `top_logprobs` (per token a {text: logprob}
map of the `logprobs` most likely tokens plus the chosen one, so up to logprobs + 1 entries; null
for the first prompt token; tokens whose texts coincide, such as byte tokens that are not whole
UTF-8 characters, share one entry, the most likely one's) and `text_offset` (where each token's text starts in the choice's
text, counting the echoed prompt). With `echo: true` and `max_tokens: 0` a choice is the prompt
alone: its text and its prompt logprobs, no generated token.

Chat tool calls: each choice's text goes through a `ToolCallStream` (tools.py), which passes it on
as content or turns it into `tool_calls` deltas; whole chat responses are merged from the same
deltas as the stream, so both carry the same message and finish_reason.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, AsyncIterator, Callable

from lmfoundry.runtime.engine.outputs import StepEvent, TokenLogprob
from lmfoundry.runtime.server.prepare import PreparedChat, PreparedCompletion
from lmfoundry.runtime.server.tools import ToolCallStream

TokenText = Callable[[int], str]  # a token id's text, as logprobs report it


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class CompletionBuilder:
    """/v1/completions chunks (stream) or the whole response, from engine events."""

    def __init__(self, job: PreparedCompletion, rid: str, token_text: TokenText) -> None:
        self.job, self.req, self.prompts, self.rid = job, job.req, job.prompts, rid
        self.token_text = token_text
        self.model = job.model
        self.created = int(time.time())
        self.completion_tokens = 0
        self.text_offsets: dict[int, int] = {}
        # echo with max_tokens 0: the engine runs one token (a request must produce one) that the
        # response leaves out, so a choice is the prompt and its logprobs alone.
        self.echo_only = job.req.echo and job.req.max_tokens == 0

    def _choice_index(self, prompt_idx: int, ev: StepEvent) -> int:
        return prompt_idx * self.req.n + ev.index

    def _logprobs(self, idx: int, ev: StepEvent, prompt_idx: int) -> dict | None:
        if self.req.logprobs is None:
            return None
        entries: list[TokenLogprob | None] = []
        if self.req.echo and ev.prompt_logprobs is not None:
            entries.extend(ev.prompt_logprobs)
        entries.extend(ev.logprobs or [])
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = self.text_offsets.get(idx, 0)
        prompt_ids = self.prompts[prompt_idx]
        for _j, lp in enumerate(entries):
            token_id = lp.token_id if lp is not None else prompt_ids[0]
            text = self.token_text(token_id)
            tokens.append(text)
            token_lps.append(lp.logprob if lp is not None else None)
            if lp is None:
                tops.append(None)
            else:
                top: dict[str, float] = {}
                for t, v in lp.top:  # most likely first: a text two tokens share keeps the higher value
                    top.setdefault(self.token_text(t), v)
                top.setdefault(text, lp.logprob)  # OpenAI: the chosen token is always listed
                tops.append(top)
            offsets.append(offset)
            offset += len(text)
        self.text_offsets[idx] = offset
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _text(self, prompt_idx: int, ev: StepEvent, first: bool) -> str:
        prefix = self.job.echo_texts[prompt_idx] if self.req.echo and first else ""
        return prefix + ev.text

    async def chunks(self, events: AsyncIterator[tuple[int, StepEvent]]) -> AsyncIterator[dict]:
        seen: set[int] = set()
        async for prompt_idx, ev in events:
            if self.echo_only:
                ev = dataclasses.replace(ev, token_ids=[], text="", logprobs=None,
                                         finish_reason=None if ev.finish_reason is None else "length")
            idx = self._choice_index(prompt_idx, ev)
            first = idx not in seen
            seen.add(idx)
            self.completion_tokens += len(ev.token_ids)
            text = self._text(prompt_idx, ev, first)
            logprobs = self._logprobs(idx, ev, prompt_idx)
            if not text and logprobs is None and ev.finish_reason is None:
                continue  # text held back (partial UTF-8 character or possible stop string)
            choice = {"index": idx, "text": text, "logprobs": logprobs, "finish_reason": ev.finish_reason}
            yield {"id": self.rid, "object": "text_completion", "created": self.created,
                   "model": self.model, "choices": [choice]}
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield {"id": self.rid, "object": "text_completion", "created": self.created,
                   "model": self.model, "choices": [], "usage": self._usage()}

    def _usage(self) -> dict:
        return _usage(sum(len(p) for p in self.prompts), self.completion_tokens)

    async def collect(self, events: AsyncIterator[tuple[int, StepEvent]]) -> dict:
        choices: dict[int, dict] = {}
        async for chunk in self.chunks(events):
            for c in chunk["choices"]:
                acc = choices.setdefault(c["index"], {"index": c["index"], "text": "", "logprobs": None,
                                                      "finish_reason": None})
                acc["text"] += c["text"]
                if c["logprobs"] is not None:
                    if acc["logprobs"] is None:
                        acc["logprobs"] = {k: [] for k in c["logprobs"]}
                    for k, v in c["logprobs"].items():
                        acc["logprobs"][k].extend(v)
                acc["finish_reason"] = c["finish_reason"] or acc["finish_reason"]
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choices[i] for i in sorted(choices)], "usage": self._usage()}


class ChatBuilder:
    """/v1/chat/completions chunks (stream) or the whole response, from engine events."""

    def __init__(self, chat: PreparedChat, rid: str, token_text: TokenText) -> None:
        self.req, self.prompt, self.rid = chat.req, chat.prompt, rid
        self.token_text = token_text
        self.model = chat.model
        self.created = int(time.time())
        self.completion_tokens = 0
        self.tools = [ToolCallStream(chat.tools) for _ in range(chat.req.n)]

    def _logprobs(self, ev: StepEvent) -> dict | None:
        if not self.req.logprobs:
            return None
        content = []
        for lp in ev.logprobs or []:
            text = self.token_text(lp.token_id)
            content.append({
                "token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := self.token_text(i)), "logprob": v, "bytes": list(t.encode())}
                                 for i, v in lp.top]})
        return {"content": content}

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices}

    async def choices(self, events: AsyncIterator[tuple[int, StepEvent]]) -> AsyncIterator[dict]:
        """One choice delta per event that has something to say (/v1/responses builds on these)."""
        async for _, ev in events:
            self.completion_tokens += len(ev.token_ids)
            logprobs = self._logprobs(ev)
            delta, finish_reason = self.tools[ev.index].feed(ev.text, ev.finish_reason)
            if not delta and logprobs is None and finish_reason is None:
                continue  # text held back (partial UTF-8 character, possible stop string or tool call)
            yield {"index": ev.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    async def chunks(self, events: AsyncIterator[tuple[int, StepEvent]]) -> AsyncIterator[dict]:
        for i in range(self.req.n):
            yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])
        async for choice in self.choices(events):
            yield self._chunk([choice])
        if self.req.stream_options and self.req.stream_options.include_usage:
            chunk = self._chunk([])
            chunk["usage"] = _usage(len(self.prompt), self.completion_tokens)
            yield chunk

    async def collect(self, events: AsyncIterator[tuple[int, StepEvent]]) -> dict:
        choices: dict[int, dict[str, Any]] = {
            i: {"index": i, "message": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(self.req.n)}
        async for choice in self.choices(events):
            c = choices[choice["index"]]
            message = c["message"]
            message["content"] += choice["delta"].get("content", "")
            for call in choice["delta"].get("tool_calls", []):
                calls = message.setdefault("tool_calls", [])
                if call["index"] == len(calls):  # a call's first delta: id, type, name
                    calls.append({"id": call["id"], "type": call["type"],
                                  "function": {"name": call["function"]["name"], "arguments": ""}})
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
            if (lps := choice["logprobs"]) is not None:
                c["logprobs"] = c["logprobs"] or {"content": []}
                c["logprobs"]["content"].extend(lps["content"])
            c["finish_reason"] = choice["finish_reason"] or c["finish_reason"]
        for c in choices.values():
            if c["message"].get("tool_calls") and not c["message"]["content"]:
                c["message"]["content"] = None  # OpenAI: a message that only calls tools has no content
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": list(choices.values()), "usage": _usage(len(self.prompt), self.completion_tokens)}
