"""A load generator for any OpenAI-compatible server (`lmfoundry bench`, benchmarks/serve_peers.py).

Each concurrency level sends a fixed number of streaming /v1/completions requests with at most
`concurrency` in flight, greedy, with a fixed `max_tokens` (and `ignore_eos`, so every server
produces the same amount of work). Prompts share a long prefix and differ in a short suffix, the
shape of chat traffic with a common system prompt, which is what prefix caching is for. With
`shared_fraction` below 1, only that fraction shares the prefix; the others are distinct prompts of
the same length that share nothing from their first token on (traffic a prefix cache cannot serve
entirely: benchmarks/serve_peers.py uses 0.75).

Per request: time to first token (TTFT), the gaps between streamed chunks (inter-token latency,
ITL) and end-to-end latency; per level: percentiles and output tokens per second of wall time.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx

_SENTENCES = (
    "The committee reviewed the quarterly report and asked for a clearer account of the costs.",
    "Rivers carry sediment from the mountains to the plains, where it settles and forms rich soil.",
    "A careful engineer measures twice before changing anything that already works in production.",
    "The library opens at nine, closes at six, and keeps a quiet reading room on the second floor.",
    "Most of the heat in a house escapes through the roof, the windows and the gaps around doors.",
    "She wrote the results in a notebook, then checked each number against the original data.",
    "Trains leave the central station every twenty minutes during the morning and evening rush.",
    "The recipe calls for flour, butter, a pinch of salt and enough cold water to bind the dough.",
)


def _body(prefix_words: int, seed: int) -> str:
    """About `prefix_words` words of plain notes, starting at sentence `seed` of the pool."""
    words: list[str] = []
    i = seed
    while len(words) < prefix_words:
        words.extend(_SENTENCES[i % len(_SENTENCES)].split())
        i += 3
    return " ".join(words[:prefix_words])


def is_shared(k: int, shared_fraction: float) -> bool:
    """Whether request number `k` uses the shared prefix: the distinct ones are spread evenly
    (0.75: every 4th is distinct), so any run of requests holds about the same mix."""
    if shared_fraction >= 1.0:
        return True
    rest = 1.0 - max(shared_fraction, 0.0)
    return math.floor((k + 1) * rest + 1e-9) == math.floor(k * rest + 1e-9)


def make_prompts(num: int, prefix_words: int, seed: int = 0, shared_fraction: float = 1.0,
                 start: int = 0) -> list[str]:
    """`num` prompts: one shared prefix of about `prefix_words` words, then a distinct question.

    With `shared_fraction` < 1, only that fraction of the prompts carries the shared prefix; each
    of the others opens with its own number and notes of the same length, so a prefix cache has
    nothing to reuse for it. `start` numbers the prompts from there, so that successive calls
    (one per concurrency level) never repeat a prompt a server may hold in its cache.
    """
    prefix = "You are a helpful assistant. Read the notes below and answer the question.\n\n"
    prefix += _body(prefix_words, seed)
    out = []
    for k in range(start, start + num):
        question = f"Question {k}: in one paragraph, what does note {k % 8 + 1} say about step {k}?\nAnswer:"
        if is_shared(k, shared_fraction):
            out.append(f"{prefix}\n\n{question}")
        else:
            own = f"Request {k}. You are a careful reader. Study these notes, then answer the question.\n\n"
            out.append(f"{own}{_body(prefix_words, seed + 1 + k % 7)}\n\n{question}")
    return out


@dataclass
class RequestResult:
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    error: str | None = None


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    xs = sorted(values)

    def q(p: float) -> float:  # linear interpolation between order statistics
        pos = p * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"p50": q(0.50), "p95": q(0.95), "p99": q(0.99), "mean": sum(xs) / len(xs)}


async def sse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """The lines of an event stream, ended at LF (a CR before it dropped) as SSE ends them. Not
    httpx's aiter_lines: it also ends lines at U+0085, U+2028 and U+2029, which a peer server may
    send raw inside a chunk's JSON text."""
    pending = ""
    async for text in resp.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


async def one_request(client: httpx.AsyncClient, base_url: str, model: str, prompt: str, max_tokens: int,
                      headers: dict[str, str]) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    res = RequestResult()
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", f"{base_url}/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in sse_lines(resp):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    res.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.e2e = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks
    return res


def time_per_token(r: RequestResult) -> float | None:
    """Seconds per output token after the first chunk: (last chunk - first chunk) / (tokens - 1).
    Unlike ITL (the gaps between chunks) it does not depend on how many tokens a server puts in one
    streamed chunk, so it compares servers that chunk differently."""
    if r.ttft is None or r.output_tokens < 2:
        return None
    return sum(r.itl) / (r.output_tokens - 1)


async def run_level(base_url: str, model: str, prompts: list[str], concurrency: int, num_requests: int,
                    max_tokens: int, api_key: str | None = None, timeout: float = 600.0,
                    per_token: bool = False) -> dict[str, Any]:
    """One level: `num_requests` requests, at most `concurrency` in flight. `per_token` adds
    "tpot_s" (percentiles over requests of `time_per_token`) and "chunks" (streamed chunks with text)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def worker(i: int) -> RequestResult:
            async with sem:
                return await one_request(client, base_url, model, prompts[i % len(prompts)], max_tokens, headers)

        start = time.perf_counter()
        results = await asyncio.gather(*(worker(i) for i in range(num_requests)))
        wall = time.perf_counter() - start
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    level = {
        "concurrency": concurrency,
        "requests": len(ok),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "duration_s": wall,
        "output_tokens": sum(r.output_tokens for r in ok),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall if wall > 0 else 0.0,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in ok]),
    }
    if per_token:
        level["tpot_s"] = percentiles([t for r in ok if (t := time_per_token(r)) is not None])
        level["chunks"] = sum(len(r.itl) + 1 for r in ok if r.ttft is not None)
    return level


def normalize_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def served_model(base_url: str, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.get(f"{base_url}/models", headers=headers)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]


async def run_bench(url: str, concurrency: list[int], max_tokens: int, prefix_words: int,
                    requests_per_level: int | None = None, model: str | None = None, api_key: str | None = None,
                    warmup: int = 1, log: Any = None, shared_fraction: float = 1.0) -> dict[str, Any]:
    """The whole benchmark: levels in increasing concurrency, results in the documented schema.

    `shared_fraction` 1 (the default, `lmfoundry bench`) sends every level the same prompts, all
    sharing one prefix. Below 1 it sends the mix of `make_prompts` and numbers each level's prompts
    past the previous level's, so no level finds its distinct prompts already cached.
    """
    base = normalize_url(url)
    model = model or await served_model(base, api_key)
    n_max = max(requests_per_level or 0, 2 * max(concurrency))
    prompts = make_prompts(n_max, prefix_words)
    if warmup:
        await run_level(base, model, make_prompts(1, prefix_words, seed=1), 1, warmup, max_tokens, api_key)
    levels = []
    start = 0
    for c in concurrency:
        n = requests_per_level or max(2 * c, 8)
        if shared_fraction < 1.0:
            prompts = make_prompts(n, prefix_words, shared_fraction=shared_fraction, start=start)
            start += n
        level = await run_level(base, model, prompts, c, n, max_tokens, api_key)
        levels.append(level)
        if log:
            log(format_level(level))
    out = {"url": base, "model": model, "max_tokens": max_tokens, "prefix_words": prefix_words, "levels": levels}
    return out if shared_fraction >= 1.0 else out | {"shared_fraction": shared_fraction}


def _ms(d: dict[str, float | None], key: str) -> str:
    v = d.get(key)
    return "   -   " if v is None else f"{v * 1000:7.0f}"


def format_level(level: dict[str, Any]) -> str:
    t, i, e = level["ttft_s"], level["itl_s"], level["e2e_s"]
    err = f"  errors {level['errors']}: {level['first_error']}" if level["errors"] else ""
    return (f"c={level['concurrency']:<3} {level['output_tokens_per_s']:8.1f} tok/s  "
            f"TTFT ms p50/p95/p99 {_ms(t, 'p50')}{_ms(t, 'p95')}{_ms(t, 'p99')}  "
            f"ITL ms {_ms(i, 'p50')}{_ms(i, 'p95')}{_ms(i, 'p99')}  "
            f"E2E ms {_ms(e, 'p50')}{_ms(e, 'p95')}{_ms(e, 'p99')}  n={level['requests']}{err}")
