"""The built-in serving engine (paged KV cache, continuous batching, prefix caching, chunked
prefill, quantized KV). Public API:

    from lmfoundry.runtime.engine import LLMEngine, EngineConfig, SamplingParams
    engine = LLMEngine(model, tokenizer, EngineConfig())      # or LLMEngine.from_pretrained(path)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0))
    scores = engine.loglikelihood([(context_ids, continuation_ids), ...])

and, for servers, an `EngineClient`: `EngineCoreClient(EngineSpec(...))` runs the engine in a
process of its own, `AsyncLLMEngine(engine)` in a thread of this one (client.py).
"""

from lmfoundry.runtime.engine.async_engine import AsyncLLMEngine
from lmfoundry.runtime.engine.client import EngineClient, EngineDead, EngineInfo, EngineRequest, QueueFull
from lmfoundry.runtime.engine.engine_config import EngineConfig
from lmfoundry.runtime.engine.llm_engine import LLMEngine
from lmfoundry.runtime.engine.outputs import CompletionOutput, RequestOutput, StepEvent
from lmfoundry.runtime.engine.sampling_params import SamplingParams
from lmfoundry.runtime.engine.sequence import TokenLogprob

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
