"""Speculative decoding behind the server: the same completions as without it, its counters and
acceptance rate on /metrics, and the `lmfoundry serve` flags that turn it on."""

from __future__ import annotations

import json

import httpx
from click.testing import CliRunner
from helpers import start_serve, stop_serve, wait_for_url
from toy import save_toy_checkpoint

from lmfoundry.commands.serve import serve

from .test_server import metric

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("


def complete(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 48, "temperature": 0, **body},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_speculative_server_matches_plain_and_exports_acceptance(make_server) -> None:
    with make_server() as plain:
        want = complete(plain.url)["choices"][0]["text"]
        assert metric(plain.url, "lmfoundry_spec_decode_draft_tokens_total") == 0  # exported, zero, when off
    with make_server(speculative="ngram", num_speculative_tokens=4) as live:
        assert complete(live.url)["choices"][0]["text"] == want
        sse = httpx.post(f"{live.url}/v1/completions", timeout=60,
                         json={"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stream": True}).text
        chunks = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
        drafts = metric(live.url, "lmfoundry_spec_decode_draft_tokens_total", '{model_name="toy"}')
        accepted = metric(live.url, "lmfoundry_spec_decode_accepted_tokens_total", '{model_name="toy"}')
        rate = metric(live.url, "lmfoundry_spec_decode_acceptance_rate", '{model_name="toy"}')
        stats = live.engine.stats()
        assert drafts == stats["spec_draft_tokens"] > 0 and accepted == stats["spec_accepted_tokens"] > 0
        assert rate == accepted / drafts
        assert stats["kv_blocks_used"] == 0  # nothing left behind by rejected drafts


def test_serve_refuses_draft_without_draft_model() -> None:
    result = CliRunner().invoke(serve, ["toy", "--speculative", "draft"])
    assert result.exit_code != 0 and "--draft-model" in str(result.exception or result.output)
    result = CliRunner().invoke(serve, ["toy", "--speculative", "ngram", "--num-speculative-tokens", "0"])
    assert result.exit_code != 0 and "--num-speculative-tokens" in str(result.exception or result.output)
    helptext = CliRunner().invoke(serve, ["--help"]).output
    assert "--speculative [ngram|draft]" in helptext and "--draft-model" in helptext


def test_serve_cli_with_a_draft_model(tmp_path) -> None:
    target = save_toy_checkpoint(tmp_path / "toy", seed=0)
    draft = save_toy_checkpoint(tmp_path / "draft", seed=1)
    proc = start_serve([str(target), "--port", "0", "--max-model-len", "256", "--kv-cache-gb", "0.01",
                        "--speculative", "draft", "--draft-model", str(draft), "--num-speculative-tokens", "3"])
    try:
        url = wait_for_url(proc)
        base = url.removesuffix("/v1")
        assert len(complete(base, max_tokens=16)["choices"][0]["text"]) > 0
        assert metric(base, "lmfoundry_spec_decode_draft_tokens_total") > 0
    finally:
        stop_serve(proc)
