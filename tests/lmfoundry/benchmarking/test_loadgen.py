"""The load generator behind `lmfoundry bench`: percentiles and prompts."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from lmfoundry.benchmarking.loadgen import (
    RequestResult,
    is_shared,
    make_prompts,
    one_request,
    percentiles,
    time_per_token,
)


def test_percentiles_interpolate() -> None:
    p = percentiles([4.0, 1.0, 3.0, 2.0])
    assert p["p50"] == pytest.approx(2.5) and p["p95"] == pytest.approx(3.85) and p["mean"] == 2.5
    assert percentiles([])["p50"] is None


def test_prompts_share_a_prefix_and_differ() -> None:
    ps = make_prompts(5, 50)
    assert len(set(ps)) == 5
    common = min(len(p) for p in ps)
    while len({p[:common] for p in ps}) > 1:
        common -= 1
    assert common > 200


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_fraction_mixes_shared_and_distinct_prompts() -> None:
    # the default keeps `lmfoundry bench`'s prompts exactly
    assert make_prompts(6, 50, shared_fraction=1.0) == make_prompts(6, 50)
    ps = make_prompts(16, 300, shared_fraction=0.75)
    shared = [p for k, p in enumerate(ps) if is_shared(k, 0.75)]
    distinct = [p for k, p in enumerate(ps) if not is_shared(k, 0.75)]
    assert len(shared) == 12 and len(distinct) == 4 and len(set(ps)) == 16
    assert ps[:3] == make_prompts(3, 300)  # the shared ones are today's prompts
    # a distinct prompt shares nothing a prefix cache could reuse with the others: at most part of
    # its label ("Request 1" of "Request 13.")
    for d in distinct:
        assert all(_common_prefix(d, p) <= d.index(".") for p in ps if p is not d)
    # of similar length
    words = [len(p.split()) for p in ps]
    assert max(words) - min(words) <= 0.1 * min(words)


def test_shared_fraction_numbers_successive_calls_apart() -> None:
    first, second = make_prompts(8, 50, shared_fraction=0.75), make_prompts(8, 50, shared_fraction=0.75, start=8)
    assert not set(first) & set(second)
    assert sum(is_shared(k, 0.75) for k in range(100)) == 75
    assert not any(is_shared(k, 0.0) for k in range(10)) and all(is_shared(k, 1.0) for k in range(10))


def test_time_per_token_does_not_depend_on_chunking() -> None:
    # 9 tokens over 0.8 s after the first chunk: one token per chunk, or two per chunk after the first
    one = RequestResult(ttft=0.5, itl=[0.1] * 8, output_tokens=9)
    two = RequestResult(ttft=0.5, itl=[0.2] * 4, output_tokens=9)
    assert time_per_token(one) == pytest.approx(0.1) and time_per_token(two) == pytest.approx(0.1)
    assert time_per_token(RequestResult(ttft=0.5, output_tokens=1)) is None
    assert time_per_token(RequestResult(output_tokens=5)) is None


def test_one_request_reads_chunks_whose_text_holds_unicode_line_separators() -> None:
    """A peer that sends U+2028 / U+0085 raw inside a chunk's JSON (valid SSE: lines end at LF/CR
    only), its events split across network reads at arbitrary bytes: every chunk counts, no error."""
    events = [{"choices": [{"index": 0, "text": t}]} for t in ("a\u2028b", "\x85", "c\u2029", "\r")]
    events.append({"choices": [], "usage": {"completion_tokens": 4}})
    body = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\r\n\r\n" for e in events) + "data: [DONE]\n\n"
    raw = body.encode()

    async def pieces():
        for i in range(0, len(raw), 7):  # splits UTF-8 sequences too
            yield raw[i:i + 7]

    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=pieces()))

    async def run() -> RequestResult:
        async with httpx.AsyncClient(transport=transport) as client:
            return await one_request(client, "http://peer/v1", "m", "p", 4, {})

    res = asyncio.run(run())
    assert res.error is None and res.output_tokens == 4 and len(res.itl) == 3 and res.ttft is not None
