"""Issue 46: /v1/embeddings shares the engine with generation (toy model, engine in its own
process as under `serve`, a 256-token step budget).

| case                                          | before                              | after                           |
|-----------------------------------------------|-------------------------------------|---------------------------------|
| 600-input embedding while a stream runs       | the stream stalled for the whole    | longest gap between two tokens  |
|                                               | embedding (one engine command)      | under 1 s (one step of budget)  |
| 600-input embedding abandoned by its client,  | ran to its end; the completion      | aborted; the completion answers |
| then a 2-token completion                     | waited for it                       | at once, no blocks left         |
| 2049 inputs, 300,001 tokens, 9 MiB body       | served                              | 400 / 400 / 413                 |
"""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import pytest

from lmfoundry.runtime.server.app import MAX_EMBEDDING_INPUTS, MAX_EMBEDDING_TOKENS

from .test_server import metric

pytestmark = pytest.mark.timeout(180)

CONFIG = dict(max_model_len=512, num_kv_blocks=512, max_num_batched_tokens=256)


def inputs(n: int, length: int = 400) -> list[str]:
    return [f"{i} " + "lorem ipsum dolor sit amet " * (length // 27) for i in range(n)]


def test_a_large_embedding_does_not_stall_a_stream(make_server) -> None:
    with make_server(**CONFIG) as live:
        arrivals: list[float] = []
        first = threading.Event()

        def stream() -> None:
            body = {"prompt": "hold", "max_tokens": 500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(30)
        begin = time.monotonic()
        r = httpx.post(f"{live.url}/v1/embeddings", json={"input": inputs(600)}, timeout=120)
        end = time.monotonic()
        t.join(120)
        assert r.status_code == 200 and len(r.json()["data"]) == 600, r.text[:300]
        during = [b - a for a, b in itertools.pairwise(arrivals) if begin <= b <= end]
        assert len(during) > 10, (len(during), end - begin)  # the stream ran beside the embedding
        assert max(during) < 1.0, max(during)


def test_an_abandoned_embedding_is_cancelled(make_server) -> None:
    with make_server(**CONFIG) as live:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{live.url}/v1/embeddings", json={"input": inputs(600)}, timeout=0.5)
        start = time.monotonic()
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and time.monotonic() - start < 2.0, time.monotonic() - start
        deadline = time.monotonic() + 10
        while metric(live.url, "lmfoundry_kv_cache_blocks_used") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(live.url, "lmfoundry_kv_cache_blocks_used") == 0
        assert metric(live.url, "lmfoundry_num_requests_waiting") == 0


def test_embedding_request_limits(server) -> None:
    many = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)})
    assert many.status_code == 400 and many.json()["error"]["param"] == "input", many.text
    per_input = MAX_EMBEDDING_TOKENS // 1000 + 1  # byte tokens: 1000 inputs just over the total
    long = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["b" * per_input] * 1000}, timeout=60)
    assert long.status_code == 400 and "tokens in all" in long.json()["error"]["message"], long.text
    huge = httpx.post(f"{server.url}/v1/embeddings", json={"input": "c" * (9 * 2**20)}, timeout=60)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    ok = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["a"] * MAX_EMBEDDING_INPUTS}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["data"]) == MAX_EMBEDDING_INPUTS
