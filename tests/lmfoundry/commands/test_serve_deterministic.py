"""`lmfoundry serve --deterministic`: the same greedy request gets the same response bytes (text,
tokens and logprobs) alone, among 2, 7 and 31 concurrent requests, and after a request that
warmed the prefix cache with its prompt, on the real default model in bfloat16 (slow tier); and
where the mode cannot hold, one error line before anything loads."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import assert_one_error, run_cli

from .test_serve import _serve, _wait_for_url  # noqa: TID252

PROMPT = ("The history of the Roman Empire begins with the founding of the city on seven hills, a story told by "
          "poets and historians for centuries. Its early kings, the republic that replaced them, and the long "
          "wars with Carthage shaped")  # several KV blocks: a repeat finds its full blocks in the cache
OTHERS = [f"Write note number {i} about apples, pears and" for i in range(31)]


@pytest.mark.parametrize("extra,needle", [(["--tp", "2"], "--tp"), (["--compile-step"], "--compile-step"),
                                          (["--device", "cuda"], "cuda")])
def test_what_cannot_be_deterministic_is_one_error_line(capsys, extra: list[str], needle: str) -> None:
    code, _, err = run_cli(["serve", "smollm2-135m", "--deterministic", *extra], capsys)
    assert_one_error(code, err, needle)


def cache_hits(url: str) -> float:
    """lmfoundry_prefix_cache_hits_total from /metrics."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics").text
    return float(next(line for line in text.splitlines() if line.startswith("lmfoundry_prefix_cache_hits_total"))
                 .rsplit(" ", 1)[1])


def body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 5, "ignore_eos": True}


def choice_bytes(url: str, prompt: str, others: list[str]) -> bytes:
    """The first request's choice (text, tokens, logprobs) as JSON bytes, sent together with
    `others` from concurrent clients."""
    with httpx.Client(timeout=600) as client, ThreadPoolExecutor(max_workers=1 + len(others)) as pool:
        futures = [pool.submit(client.post, f"{url}/completions", json=body(p)) for p in [prompt, *others]]
        responses = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    return json.dumps(responses[0].json()["choices"], sort_keys=True).encode()


@pytest.mark.slow
def test_one_prompt_gets_the_same_bytes_alone_in_batches_and_after_a_cache_hit() -> None:
    proc = _serve(["smollm2-135m", "--deterministic", "--dtype", "bfloat16", "--port", "0", "--max-model-len",
                   "512", "--kv-cache-gb", "0.2"])
    try:
        url = _wait_for_url(proc, timeout=600)
        alone = choice_bytes(url, PROMPT, [])
        for n in (2, 7, 31):
            assert choice_bytes(url, PROMPT, OTHERS[:n]) == alone, n
        hits = cache_hits(url)
        assert choice_bytes(url, PROMPT, []) == alone  # its prompt's full blocks now come from the cache
        assert cache_hits(url) > hits
        assert len(json.loads(alone)[0]["logprobs"]["token_logprobs"]) == 24
    finally:
        from helpers import stop_serve

        stop_serve(proc)
