"""Issue 16, server side, against live servers on 127.0.0.1 (toy model, byte tokenizer).

| case                                  | before                          | after                          | test                                         |
|---------------------------------------|---------------------------------|--------------------------------|----------------------------------------------|
| temperature NaN / Infinity            | 500 to all in flight / 200      | 400                            | test_bad_values_get_400                      |
| stop_token_ids 99999 / -1             | 500 to all in flight / bans -1  | 400                            | test_bad_values_get_400                      |
| seed 2**64, seed -1                   | plain-text 500 / 200            | 400                            | test_bad_values_get_400                      |
| 100,000-deep JSON, 5000-digit integer | plain-text 500                  | 400                            | test_bad_values_get_400                      |
| top_p NaN (regression guard)          | 400                             | 400                            | test_bad_values_get_400                      |
| temperature 1e-42                     | 500 to all in flight            | 200, the greedy text           | test_tiny_temperature_is_served              |
| 8 streams + 1 poisoned request (NaN   | the 8 streams end in an error   | poisoned: 500 or in-band error;| test_poisoned_request_fails_alone            |
| temperature past validation, or a     | chunk                           | the 8 complete; blocks freed   |                                              |
| sampler raising for it)               |                                 |                                |                                              |
| 100 MB Content-Length, 8 MiB+1 chunked| read whole (accepted)           | 413, OpenAI body, closed       | test_oversized_bodies_get_413                |
| body limit set by create_app / serve  | no limit                        | 413 over it, 200 under         | test_body_limit_is_configurable              |
| 4 MB prompt while a stream runs       | stream stalled 4.6 s of 4.7 s   | longest gap 0.13 s             | test_big_prompt_does_not_stall_other_streams |
| text/plain, form, multipart, none     | text/plain served               | 415                            | test_post_requires_json                      |
| silent connection, partial header,    | held open forever               | closed after the read timeout; | test_half_open_connections_are_closed        |
| partial body, idle keep-alive         |                                 | partial body gets 408          |                                              |
| serve --kv-cache-gb 0 / nan,          | one KV block / accepted         | one-line error, exit 2, before | test_serve_refuses_out_of_range_options,     |
| --max-waiting -5, --port 70000, ...   |                                 | the model loads                | test_serve_kv_cache_gb_zero_is_one_line_...  |
| KV cache below the model's context    | context capped silently         | capped, with a one-line note   | test_capped_context_is_reported              |
"""

from __future__ import annotations

import itertools
import json
import math
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import pytest
from helpers import poison_sampler
from toy import byte_tokenizer, toy_model

from lmfoundry.cli import main as cli_main
from lmfoundry.runtime.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.server.app import create_app
from lmfoundry.runtime.server.background import serve_in_thread

from .test_server import assert_healthy, metric

pytestmark = pytest.mark.timeout(120)


@contextmanager
def own_server(read_timeout: float = 30.0, keep_alive: float = 5.0, **app_kwargs) -> Iterator[str]:
    """A live server whose HTTP limits (body size, read deadlines) the test sets; its engine steps
    take at least 10 ms, so that a 200-token stream outlives a sub-second deadline."""
    cfg = EngineConfig(num_kv_blocks=64, block_size=8, max_model_len=256, max_num_seqs=4)
    engine = AsyncLLMEngine(LLMEngine(toy_model(seed=2), byte_tokenizer(), cfg))
    step = engine.engine.step
    engine.engine.step = lambda: (time.sleep(0.01), step())[1]
    try:
        app = create_app(engine, "toy", read_timeout=read_timeout, **app_kwargs)
        with serve_in_thread(app, read_timeout=read_timeout, keep_alive=keep_alive) as url:
            yield url
    finally:
        engine.shutdown()


def raw_exchange(url: str, *parts: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes and return all the server sends until it closes the connection (a
    socket.timeout if it keeps it open)."""
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=timeout) as sock:
        for part in parts:
            sock.sendall(part)
        received = []
        while chunk := sock.recv(65536):
            received.append(chunk)
    return b"".join(received)


def completion_body(**fields) -> str:
    return json.dumps({"prompt": "x", "max_tokens": 3, **fields})


BAD_VALUES = [
    '{"prompt": "x", "max_tokens": 3, "temperature": NaN}',
    '{"prompt": "x", "max_tokens": 3, "temperature": Infinity}',
    '{"prompt": "x", "max_tokens": 3, "top_p": NaN}',
    completion_body(stop_token_ids=[99999], min_tokens=2),
    completion_body(stop_token_ids=[-1]),
    completion_body(seed=2**64),
    completion_body(seed=-1),
    '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}",
]


@pytest.mark.parametrize("body", BAD_VALUES, ids=lambda b: b[:60])
def test_bad_values_get_400(server, body: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert_healthy(server.url)


def test_tiny_temperature_is_served(server) -> None:
    def text(temperature: float) -> str:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "abc", "max_tokens": 8, "temperature": temperature})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert text(1e-42) == text(0)


def _poison(kind: str, monkeypatch) -> dict:
    """A request that reaches the engine and fails there, even with validation in place."""
    if kind == "nan_temperature":
        validate = SamplingParams.validate
        monkeypatch.setattr(SamplingParams, "validate",
                            lambda self: None if math.isnan(self.temperature) else validate(self))
        return {"content": '{"prompt": "poison", "max_tokens": 100, "temperature": NaN}'}
    poison_sampler(monkeypatch)
    body = {"prompt": "poison", "max_tokens": 100, "temperature": 0.7, "seed": 666, "stream": True}
    return {"content": json.dumps(body)}


@pytest.mark.parametrize("kind", ["nan_temperature", "sampler_raises"])
def test_poisoned_request_fails_alone(make_server, monkeypatch, kind: str) -> None:
    with make_server(max_num_seqs=16, max_waiting_requests=16, in_process=True, step_delay=0.01) as live:
        started = threading.Barrier(9)
        results: list[dict] = [{} for _ in range(8)]

        def stream(i: int) -> None:
            body = {"prompt": f"stream {i}", "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                chunks = []
                for line in lines:
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        if len(chunks) == 1:
                            started.wait()
                    elif line == "data: [DONE]":
                        results[i] = {"chunks": chunks, "done_at": time.monotonic()}

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        started.wait(timeout=30)
        r = httpx.post(f"{live.url}/v1/completions", headers={"Content-Type": "application/json"},
                       timeout=60, **_poison(kind, monkeypatch))
        failed_at = time.monotonic()
        if kind == "nan_temperature":
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        else:
            assert r.status_code == 200 and "poisoned sampler row" in r.text and r.text.endswith("data: [DONE]\n\n")
        for t in threads:
            t.join(timeout=60)
        for res in results:
            assert res["done_at"] > failed_at  # the 8 streams were still running when the poison failed
            assert not any("error" in c for c in res["chunks"])
            assert res["chunks"][-1]["choices"][0]["finish_reason"] == "length"
        assert metric(live.url, "lmfoundry_generation_tokens_total") >= 8 * 100
        assert metric(live.url, "lmfoundry_requests_total", '{finish_reason="error"}') == 1
        assert metric(live.url, "lmfoundry_kv_cache_blocks_used") == 0
        assert_healthy(live.url)


def _assert_413(response: bytes) -> None:
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), response[:300]
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_oversized_bodies_get_413(server) -> None:
    start = time.monotonic()
    declared = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000000\r\n\r\n")
    _assert_413(raw_exchange(server.url, declared, b'{"prompt": "' + b"a" * 1000))
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    mib = b"%x\r\n" % 2**20 + b"a" * 2**20 + b"\r\n"
    _assert_413(raw_exchange(server.url, chunked, *[mib] * 8, b"1\r\na\r\n"))  # 8 MiB + 1 byte
    assert time.monotonic() - start < 20
    assert_healthy(server.url)


def test_refused_upload_is_drained_not_reset(server) -> None:
    """The server answers 413 from the declared length while the client is still uploading: with
    unread bytes in its socket an outright close is a reset, which the client can see before the
    413. The server half-closes and discards the rest instead, so the client's upload completes
    and it reads the whole response and a clean end of stream (lingering close)."""
    declared = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(declared + b"a" * 2**23)  # more than the socket buffers hold: arrives after the 413
        received = []
        while chunk := sock.recv(65536):
            received.append(chunk)
    _assert_413(b"".join(received))
    assert_healthy(server.url)


def test_body_limit_is_configurable() -> None:
    with own_server(max_body_bytes=2000) as url:
        # `user` pads the body: a field the server accepts and ignores (an unknown one would be a 400)
        under = httpx.post(f"{url}/v1/completions", json={"prompt": "a" * 100, "max_tokens": 2, "user": "b" * 1500})
        assert under.status_code == 200, under.text
        over = httpx.post(f"{url}/v1/completions", json={"prompt": "a" * 100, "max_tokens": 2, "user": "b" * 2000})
        assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"


def test_big_prompt_does_not_stall_other_streams(make_server) -> None:
    with make_server(step_delay=0.02) as live:
        arrivals: list[float] = []
        stop = threading.Event()
        first = threading.Event()

        def stream() -> None:
            body = {"prompt": "hold", "max_tokens": 250, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    arrivals.append(time.monotonic())
                    first.set()
                    if stop.is_set():
                        return

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(timeout=30)
        begin = time.monotonic()
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "a" * 4_000_000, "max_tokens": 1}, timeout=120)
        end = time.monotonic()
        stop.set()
        t.join(timeout=60)
        assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]  # longer than the context
        during = [b - a for a, b in itertools.pairwise(arrivals) if begin <= b <= end]
        assert end - begin > 1.0 and len(during) > 10, (end - begin, len(during))
        assert max(during) < min(1.0, (end - begin) / 3), (max(during), end - begin)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_post_requires_json(server, path: str, content_type: str | None) -> None:
    field = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    body = json.dumps({**field, "max_tokens": 2})
    headers = {"Content-Type": content_type} if content_type else {}
    r = httpx.post(f"{server.url}{path}", content=body, headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    ok = httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_half_open_connections_are_closed() -> None:
    with own_server(read_timeout=0.5, keep_alive=0.5) as url:
        start = time.monotonic()
        assert raw_exchange(url, b"", timeout=5) == b""  # connected, sent nothing
        assert raw_exchange(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", timeout=5) == b""
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n")
        stalled = raw_exchange(url, head, b'{"prompt": ', timeout=5)
        assert stalled.startswith(b"HTTP/1.1 408"), stalled[:200]
        assert json.loads(stalled.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        body = completion_body().encode()
        ok = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body)) + body
        kept = raw_exchange(url, ok, timeout=5)  # served, then closed once idle past keep-alive
        assert kept.startswith(b"HTTP/1.1 200") and b'"finish_reason"' in kept
        assert time.monotonic() - start < 15
        # A request in flight is not cut by the deadlines: a stream 4x longer than them completes.
        body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
        begin = time.monotonic()
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line]
        assert time.monotonic() - begin > 1.5 and lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


BAD_OPTIONS = [
    (["--kv-cache-gb", "0"], "--kv-cache-gb"),
    (["--kv-cache-gb", "nan"], "--kv-cache-gb"),
    (["--max-waiting", "-5"], "--max-waiting"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--threads", "-1"], "--threads"),
    (["--port", "70000"], "--port"),
    (["--max-request-mb", "0"], "--max-request-mb"),
    (["--timeout-read", "-1"], "--timeout-read"),
    (["--timeout-keep-alive", "inf"], "--timeout-keep-alive"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout"),
]


@pytest.mark.parametrize("args,name", BAD_OPTIONS, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_serve_refuses_out_of_range_options(tmp_path, capsys, args: list[str], name: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", str(tmp_path / "never-loaded"), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith(f"error: {name} must be") and err.count("\n") == 1, err


def test_serve_kv_cache_gb_zero_is_one_line_in_a_subprocess(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "lmfoundry.cli", "serve", str(tmp_path), "--kv-cache-gb", "0"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: --kv-cache-gb must be a positive number, got 0.0"]


def test_capped_context_is_reported(capsys) -> None:
    from lmfoundry.runtime.server.api_process import note_capped_context

    engine = LLMEngine(toy_model(seed=2), byte_tokenizer(), EngineConfig(num_kv_blocks=4, block_size=8))
    note_capped_context(engine.info, None, 0.001)
    err = capsys.readouterr().err
    assert "holds 32 tokens" in err and "context of 512" in err and err.count("\n") == 1
    note_capped_context(engine.info, 32, 0.001)  # asked for explicitly: nothing to report
    assert capsys.readouterr().err == ""
