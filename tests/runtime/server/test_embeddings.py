"""Issue 46: /v1/embeddings shares the engine with generation (toy model, engine in its own
process as under `serve`, a 256-token step budget).

| case                                          | before                              | after                           |
|-----------------------------------------------|-------------------------------------|---------------------------------|
| 600-input embedding while a stream runs       | the stream stalled for the whole    | longest gap between two tokens  |
|                                               | embedding (one engine command)      | under 1 s (one step of budget)  |
| 600-input embedding abandoned by its client,  | ran to its end; the completion      | aborted; the completion answers |
| then a 2-token completion                     | waited for it                       | at once, no blocks left         |
| 2049 inputs, 300,001 tokens, 9 MiB body       | served                              | 400 / 400 / 413                 |

With the real SmolLM2 (slow tier) a step of the budget costs what it costs on the machine: the
test holds the embedding's stalls to those of a long prompt's chunked prefill, measured in the
same run.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time

import httpx
import pytest
from helpers import start_serve, stop_serve, wait_for_url

from lmfoundry.runtime.server.prepare import MAX_EMBEDDING_INPUTS, MAX_EMBEDDING_TOKENS

from .test_server import metric

pytestmark = pytest.mark.timeout(180)

CONFIG = dict(max_model_len=512, num_kv_blocks=512, max_num_batched_tokens=256)


def inputs(n: int, length: int = 400) -> list[str]:
    return [f"{i} " + "lorem ipsum dolor sit amet " * (length // 27) for i in range(n)]


class TokenClock(threading.Thread):
    """A long stream whose token arrival times are kept, to measure the gaps while other work runs."""

    def __init__(self, url: str, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.arrivals: list[float] = []
        self.first = threading.Event()
        self.start()
        assert self.first.wait(120)

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.arrivals.append(time.monotonic())
                    self.first.set()

    def gaps(self, begin: float, end: float) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.arrivals) if begin <= b <= end]


def timed(call) -> tuple[httpx.Response, float, float]:
    begin = time.monotonic()
    r = call()
    return r, begin, time.monotonic()


def test_a_large_embedding_does_not_stall_a_stream(make_server) -> None:
    with make_server(**CONFIG) as live:
        clock = TokenClock(live.url, "hold", 500)
        r, begin, end = timed(lambda: httpx.post(f"{live.url}/v1/embeddings", json={"input": inputs(600)}, timeout=120))
        assert r.status_code == 200 and len(r.json()["data"]) == 600, r.text[:300]
        during = clock.gaps(begin, end)
        assert len(during) > 10, (len(during), end - begin)  # the stream ran beside the embedding
        assert max(during) < 1.0, max(during)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_embedding_stalls_a_stream_no_more_than_a_chunked_prefill() -> None:
    proc = start_serve(["smollm2-135m", "--port", "0", "--max-model-len", "4096", "--threads", "2",
                        "--max-num-batched-tokens", "256"])
    try:
        url = wait_for_url(proc, timeout=600).removesuffix("/v1")
        clock = TokenClock(url, "Once upon a time", 4000)
        story = " ".join(f"Day {i}: the weather in the town was mild and the market was busy." for i in range(150))
        r, begin, end = timed(lambda: httpx.post(f"{url}/v1/completions", json={"prompt": story, "max_tokens": 1},
                                                 timeout=600))
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 2000, r.text[:300]
        prefill = max(clock.gaps(begin, end))
        texts = [f"Sentence {i} is about the weather and the market in the town." for i in range(600)]
        r, begin, end = timed(lambda: httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=600))
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 8000, r.text[:300]
        embedding = max(clock.gaps(begin, end))
        assert embedding <= 2 * prefill + 0.25, (embedding, prefill)
        assert embedding < (end - begin) / 5, (embedding, end - begin)  # cut into many steps, not one
    finally:
        proc.send_signal(signal.SIGINT)  # the clock's stream is still running: the second signal ends it
        time.sleep(0.5)
        stop_serve(proc)


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
