"""Text and stop strings on the caller's side (vLLM V1's output processor): the engine streams
token ids (`SamplingParams.detokenize` off) and the API process turns them into text with the
same `Detokenizer` the engine uses offline, so that detokenizing never takes the engine's cores.

A stop string found here ends its choice here: the tokens after it in the same event are
dropped, and once every choice of the request has ended the engine stream is closed, which
aborts the request in the engine (it may have computed a token or two past the stop; nobody
sees them). The result is the text, tokens and finish reasons the engine produces offline.
"""

from __future__ import annotations

import dataclasses
from contextlib import aclosing
from typing import Any, AsyncIterator

from lmfoundry.runtime.engine.detokenizer import Detokenizer
from lmfoundry.runtime.engine.outputs import StepEvent
from lmfoundry.runtime.engine.sampling_params import SamplingParams


@dataclasses.dataclass
class _Choice:
    """The fields of a `Sequence` the Detokenizer reads and writes, for one choice."""

    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    output_text: str = ""
    num_emitted_chars: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    is_finished: bool = False

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


async def detokenize(events: AsyncIterator[StepEvent], prompt_ids: list[int], params: SamplingParams,
                     tokenizer: Any, eos_token_ids: frozenset[int]) -> AsyncIterator[StepEvent]:
    """`events` of one request with their text filled in and stop strings applied."""
    detok = Detokenizer(tokenizer)
    choices: dict[int, _Choice] = {}
    num_finished = 0
    async with aclosing(events):  # type: ignore[type-var]
        async for ev in events:
            choice = choices.get(ev.index)
            if choice is None:
                choice = choices[ev.index] = _Choice(list(prompt_ids), len(prompt_ids), params)
                detok.start(choice)  # type: ignore[arg-type]
            if choice.is_finished:
                continue  # ended here by a stop string; the engine is still finishing its other choices
            ev = _process(detok, choice, ev, eos_token_ids)
            if choice.is_finished:
                num_finished += 1
            ev.request_finished = num_finished == params.n
            yield ev
            if ev.request_finished:
                return


def _process(detok: Detokenizer, choice: _Choice, ev: StepEvent, eos_token_ids: frozenset[int]) -> StepEvent:
    """Detokenize one event's tokens one by one, as `LLMEngine._accept_token` does offline."""
    p = choice.params
    reason: str | None = None
    kept = 0
    decoded_last = False
    for k, token in enumerate(ev.token_ids):
        choice.token_ids.append(token)
        kept = k + 1
        stop_token = token in p.stop_token_ids or (token in eos_token_ids and not p.ignore_eos)
        if stop_token and ev.finish_reason == "stop" and kept == len(ev.token_ids):
            decoded_last = False  # the engine stopped on it: a stop token's text is never shown
            break
        checked = len(choice.output_text)
        detok.update(choice)  # type: ignore[arg-type]
        decoded_last = True
        if choice.num_output_tokens >= p.min_tokens and detok.find_stop(choice, checked):  # type: ignore[arg-type]
            reason = "stop"
            break
    if reason is None:
        reason = ev.finish_reason
        if reason in ("stop", "length") and decoded_last:
            detok.flush(choice)  # type: ignore[arg-type]
    choice.is_finished = reason is not None
    logprobs = ev.logprobs[:kept] if ev.logprobs is not None else None
    return dataclasses.replace(ev, token_ids=ev.token_ids[:kept], logprobs=logprobs, finish_reason=reason,
                               text=Detokenizer.take_new_text(choice))  # type: ignore[arg-type]
