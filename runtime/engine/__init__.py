"""The built-in serving engine (paged KV cache, continuous batching, prefix caching, chunked
prefill, quantized KV). Public API:

    from lmfoundry.runtime.engine import LLMEngine, EngineConfig, SamplingParams
    engine = LLMEngine(model, tokenizer, EngineConfig())      # or LLMEngine.from_pretrained(path)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0))
    scores = engine.loglikelihood([(context_ids, continuation_ids), ...])

and, for servers, an `EngineClient`: `EngineCoreClient(EngineSpec(...))` runs the engine in a
process of its own, `AsyncLLMEngine(engine)` in a thread of this one (client.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the submodule defining it, imported on first use: the API process imports the client,
# the outputs and the sampling parameters from this package, and must not import the model and
# its kernels (torch) with them (see `core_client`)
_EXPORTS = {
    "AsyncLLMEngine": "async_engine",
    "CompletionOutput": "outputs",
    "EngineClient": "client",
    "EngineDead": "client",
    "EngineInfo": "client",
    "EngineRequest": "client",
    "EngineConfig": "engine_config",
    "LLMEngine": "llm_engine",
    "QueueFull": "client",
    "RequestOutput": "outputs",
    "SamplingParams": "sampling_params",
    "StepEvent": "outputs",
    "TokenLogprob": "outputs",
}

if TYPE_CHECKING:
    from lmfoundry.runtime.engine.async_engine import AsyncLLMEngine
    from lmfoundry.runtime.engine.client import EngineClient, EngineDead, EngineInfo, EngineRequest, QueueFull
    from lmfoundry.runtime.engine.engine_config import EngineConfig
    from lmfoundry.runtime.engine.llm_engine import LLMEngine
    from lmfoundry.runtime.engine.outputs import CompletionOutput, RequestOutput, StepEvent, TokenLogprob
    from lmfoundry.runtime.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineClient",
    "EngineDead",
    "EngineInfo",
    "EngineRequest",
    "EngineConfig",
    "LLMEngine",
    "QueueFull",
    "RequestOutput",
    "SamplingParams",
    "StepEvent",
    "TokenLogprob",
]
