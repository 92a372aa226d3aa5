"""`AsyncLLMEngine(start=False).run_here`: the engine stepped in the caller's thread (how `serve`
runs it, in the main thread) while an event loop in another thread submits and streams."""

from __future__ import annotations

import asyncio
import threading

from toy import byte_tokenizer, toy_model

from lmfoundry.runtime.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams


def test_run_here_serves_requests_from_another_threads_loop() -> None:
    engine = LLMEngine(toy_model(seed=2), byte_tokenizer(), EngineConfig(num_kv_blocks=64, block_size=8))
    want = engine.generate(["hello"], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].token_ids
    async_engine = AsyncLLMEngine(engine, start=False)
    assert not async_engine.is_alive
    got: list[int] = []
    stepped_in: set[str] = set()
    real_step = engine.step

    def step():
        stepped_in.add(threading.current_thread().name)
        return real_step()

    engine.step = step  # type: ignore[method-assign]

    async def client() -> None:
        while not async_engine.is_alive:  # a request before run_here starts is refused (EngineDead)
            await asyncio.sleep(0.01)
        async for ev in async_engine.generate("hello", SamplingParams(max_tokens=8, temperature=0)):
            got.extend(ev.token_ids)

    caller = threading.Thread(target=lambda: asyncio.run(client()), name="http")
    caller.start()
    async_engine.run_here(caller.is_alive)  # returns once the client has its whole stream
    caller.join()
    assert got == want
    assert stepped_in == {threading.current_thread().name}
    assert not async_engine.is_alive
