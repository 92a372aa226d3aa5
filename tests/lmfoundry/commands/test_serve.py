"""`lmfoundry serve` as a user runs it: a subprocess that prints its URL and serves a checkpoint."""

from __future__ import annotations

import openai
from helpers import start_serve, stop_serve
from helpers import wait_for_url as _wait_for_url
from toy import save_toy_checkpoint

_serve = start_serve


def test_serve_cli_prints_url_and_streams_chat(tmp_path) -> None:
    folder = save_toy_checkpoint(tmp_path / "toy")
    proc = _serve([str(folder), "--port", "0", "--api-key", "k", "--max-model-len", "256", "--kv-cache-gb", "0.01"])
    try:
        url = _wait_for_url(proc)
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        client = openai.OpenAI(base_url=url, api_key="k")
        assert [m.id for m in client.models.list()] == ["toy"]
        stream = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, stream=True, temperature=0)
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    finally:
        stop_serve(proc)


def test_serve_cli_missing_model_is_one_line_error(tmp_path) -> None:
    proc = _serve([str(tmp_path / "nope")])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert out.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in out


def test_the_step_budget_defaults_smaller_on_cpu() -> None:
    """A CPU step's time grows with its rows past the point its matrix units are busy, and every
    running stream waits for the whole step: the CPU default chunk is half vLLM's GPU one."""
    from lmfoundry.commands.serve import default_step_tokens

    assert default_step_tokens("cpu") == 1024
    assert default_step_tokens("cuda") == default_step_tokens("cuda:1") == 2048
