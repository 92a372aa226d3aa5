"""`LLM`: offline generation with the serving engine, in the caller's process, shaped like vLLM's
`LLM` (`generate(prompts, sampling_params)`, `chat(messages, sampling_params)`, `SamplingParams`
and `RequestOutput` with vLLM's field names), so a script written for one reads the other.

The engine runs in this process (`LLMEngine`, the same scheduler, executor and sampler `serve`
runs in its engine process): one call adds every prompt and steps the engine until all have
finished, so the prompts are batched continuously (a finished sequence's slot goes to the next
waiting one) and the results come back in prompt order. In-process rather than a child process
like `serve`'s: a notebook or CI step generates a batch and moves on, without a second
interpreter's start-up or the pickling of every step's tokens. A tensor-parallel engine
(`tensor_parallel_size` > 1) does start one process per extra rank; `close()` stops them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmfoundry.api.artifacts import Bundle, Checkpoint, artifact_path
from lmfoundry.errors import UserError
from lmfoundry.runtime.engine.outputs import RequestOutput
from lmfoundry.runtime.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lmfoundry.runtime.engine.llm_engine import LLMEngine

Prompt = str | list[int]
Message = Mapping[str, Any]


class LLM:
    """A model loaded into the serving engine for offline generation.

    `model` is a checkpoint folder, an engine bundle, a HF folder, a .gguf file or a built-in name
    (or a `Checkpoint` / `Bundle` the API returned). `dtype` is the execution dtype as `serve
    --dtype` takes it ("auto": bfloat16 where this CPU has bf16 arithmetic, float32 elsewhere; a
    GPU bundle its own), `device` where a bundle's kernels run (cpu, cuda[:N]). `engine_options`
    are `EngineConfig`'s fields, named as vLLM names its engine arguments where they mean the
    same: `max_num_seqs`, `max_num_batched_tokens`, `max_model_len`, `block_size`,
    `enable_prefix_caching`, `kv_cache_dtype`, `tensor_parallel_size`, `speculative`, ...

    Threads: `num_threads` sets torch's intra-op threads for this process (the engine runs here);
    the previous setting is put back by `close()`. Without it, the process setting is kept.
    Use it as a context manager, or call `close()`, to release the model and stop any rank
    processes."""

    def __init__(self, model: str | Path | Checkpoint | Bundle, *, dtype: str = "auto", device: str = "cpu",
                 **engine_options: Any) -> None:
        import torch

        from lmfoundry.devices import check_device
        from lmfoundry.runtime.engine.engine_config import EngineConfig, default_step_tokens
        from lmfoundry.runtime.engine.llm_engine import LLMEngine
        from lmfoundry.runtime.loader import resolve_dtype

        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_options) - known)
        if unknown:
            raise UserError(f"LLM: unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        path = artifact_path(model)
        device = check_device(device)
        engine_options.setdefault("max_num_batched_tokens", default_step_tokens(device))  # as serve's default
        self._threads = torch.get_num_threads() if engine_options.get("num_threads") is not None else None
        self.model = path
        self._engine: LLMEngine | None = LLMEngine.from_pretrained(path, resolve_dtype(dtype, path, device),
                                                                   EngineConfig(**engine_options), device=device)

    @property
    def engine(self) -> LLMEngine:
        """The running engine (for what the API does not wrap: `loglikelihood`, `embed`, `stats`)."""
        if self._engine is None:
            raise UserError("this LLM is closed")
        return self._engine

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (a transformers tokenizer), as the engine encodes prompts with it."""
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Complete each prompt (a string, or a list of token ids); one `RequestOutput` per prompt,
        in order, each with `outputs[i].text`, `.token_ids`, `.logprobs` (with
        `SamplingParams(logprobs=N)`) and `.finish_reason` ("stop" or "length"). One
        `sampling_params` for all prompts, or one per prompt; the default is vLLM's (16 tokens,
        temperature 1). A prompt the engine cannot run (too long for the context, a bad sampling
        value) raises `LmfoundryError` naming it before any prompt runs."""
        engine = self.engine
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]  # one prompt: a string or a list of token ids
        batch = list(prompts)  # type: ignore[arg-type]
        params = sampling_params if sampling_params is not None else SamplingParams()
        plist = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(batch):
            raise UserError(f"{len(batch)} prompts but {len(plist)} sampling params")
        encoded: list[Prompt] = []
        for i, (prompt, p) in enumerate(zip(batch, plist, strict=True)):
            try:
                encoded.append(engine.encode(prompt))
                engine.check_request(encoded[-1], p)  # type: ignore[arg-type]
            except ValueError as exc:
                raise UserError(f"prompt {i}: {exc}") from None
        return engine.generate(encoded, plist)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, chat_template_kwargs: Mapping[str, Any] | None = None,
             ) -> list[RequestOutput]:
        """Answer a conversation (a list of {"role", "content"} messages) or a batch of them: each
        goes through the model's chat template as `serve`'s /v1/chat/completions applies it, then
        `generate`. Returns one `RequestOutput` per conversation. A model without a chat
        template raises `LmfoundryError`."""
        tokenizer = self.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{self.model}: this model has no chat template; use generate()")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts: list[Prompt] = []
        for i, conversation in enumerate(conversations):
            try:
                text = tokenizer.apply_chat_template([dict(m) for m in conversation],  # type: ignore[union-attr, arg-type]
                                                     tokenize=False,
                                                     add_generation_prompt=add_generation_prompt,
                                                     **dict(chat_template_kwargs or {}))
            except Exception as exc:  # noqa: BLE001 - a template error is the messages' fault
                raise UserError(f"conversation {i}: the chat template rejected the messages: {exc}") from None
            prompts.append(list(tokenizer(text, add_special_tokens=False).input_ids))
        return self.generate(prompts, sampling_params)

    def close(self) -> None:
        """Release the model and stop the engine's rank processes; restores torch's thread count
        when `num_threads` changed it. Closing twice is harmless."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        try:
            engine.close()
        finally:
            if self._threads is not None:
                import torch

                torch.set_num_threads(self._threads)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # an LLM dropped without close() still stops its rank processes
        if getattr(self, "_engine", None) is not None:
            self.close()
