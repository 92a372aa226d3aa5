"""The unmodified `openai` client streams chat completions from `lmfoundry serve` on the default
model and on its W4A16 checkpoint (slow tier)."""

from __future__ import annotations

import openai
import pytest
from helpers import w4a16_checkpoint

from .test_serve import _serve, _wait_for_url  # noqa: TID252

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("which", ["float", "w4a16"])
def test_openai_client_streams_chat(which: str) -> None:
    model = "smollm2-135m" if which == "float" else str(w4a16_checkpoint())
    proc = _serve([model, "--port", "0", "--max-model-len", "1024", "--kv-cache-gb", "0.1"])
    try:
        url = _wait_for_url(proc, timeout=600)
        client = openai.OpenAI(base_url=url, api_key="unused")
        name = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Name the largest planet in the solar system."}]
        stream = client.chat.completions.create(model=name, messages=messages, max_tokens=48, temperature=0,
                                                stream=True)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        whole = client.chat.completions.create(model=name, messages=messages, max_tokens=48, temperature=0)
        assert text == whole.choices[0].message.content and "planet" in text.lower()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
