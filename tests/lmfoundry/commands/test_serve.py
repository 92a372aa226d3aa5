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
    from lmfoundry.runtime.engine.engine_config import default_step_tokens

    assert default_step_tokens("cpu") == 1024
    assert default_step_tokens("cuda") == default_step_tokens("cuda:1") == 2048


def test_serve_prints_and_exports_what_runs_and_takes_its_http_flags(tmp_path) -> None:
    """`--dtype float32` used to print `--dtype auto -> bfloat16`; the line now says what was given,
    and, once loaded, what runs: dtype, CPU path, weight format (W4A16 kept dense and dequantized in
    float32), as /v1/models and /metrics report it. The HTTP flags reach the app."""
    import re

    import httpx
    from click.testing import CliRunner

    from lmfoundry.cli import cli
    from lmfoundry.runtime.cpu.isa import isa

    folder = save_toy_checkpoint(tmp_path / "toy", num_key_value_heads=4)
    quantized = tmp_path / "w4a16"
    result = CliRunner().invoke(cli, ["quantize", str(folder), "-o", str(quantized), "--method", "rtn", "--scheme",
                                      "w4a16", "--group-size", "32", "--num-samples", "4", "--seq-len", "64", "--quiet",
                                      "--skip-doctor"])
    assert result.exit_code == 0, result.output
    proc = _serve([str(quantized), "--port", "0", "--max-model-len", "256", "--kv-cache-gb", "0.01", "--dtype",
                   "float32", "--metrics-names", "ours", "--allowed-origins", '["http://localhost:3000"]',
                   "--enable-openapi", "--lenient-request-fields"])
    try:
        start = []  # what serve prints until it listens
        while not (m := re.search(r"serving on (http://\S+)/v1", line := proc.stdout.readline())):
            assert line or proc.poll() is None, "".join(start)
            start.append(line)
        url = m.group(1)
        want = {"dtype": "float32", "device": "cpu", "cpu_isa": isa(), "weight_format": "w4a16 g32 (dequantized to fp32 dense)"}
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["lmfoundry"] == want
        metrics = httpx.get(f"{url}/metrics").text
        assert "vllm:" not in metrics and 'dtype="float32"' in re.search(r"lmfoundry_model_info\{.*", metrics)[0]
        pre = httpx.options(f"{url}/v1/completions", headers={"Origin": "http://localhost:3000",
                                                               "Access-Control-Request-Method": "POST"})
        assert pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert httpx.get(f"{url}/openapi.json").status_code == 200
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2, "max_token": 9}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        stop_serve(proc)
    printed = "".join(start)
    assert "; --dtype float32 (as given; auto would be" in printed and "--dtype auto ->" not in printed, printed
    assert f"w4a16: float32 on cpu, {isa()} path; weights w4a16 g32 (dequantized to fp32 dense)" in printed, printed
    assert "ignored unknown request field: max_token" in proc.stdout.read()


def test_serve_refuses_bad_http_flags_in_one_line(capsys) -> None:
    from helpers import assert_one_error, run_cli

    for args, needle in ((["--allowed-origins", "[bad"], "--allowed-origins"),
                         (["--allowed-origins", "localhost:3000"], "scheme://host"),
                         (["--allowed-methods", "GET"], "need --allowed-origins"),
                         (["--allowed-origins", "*", "--allow-credentials"], "list the origins explicitly"),
                         (["--allowed-origins", '["http://a.example", "*"]', "--allow-credentials"], "--allow-credentials"),
                         (["--metrics-names", "all"], "--metrics-names")):
        code, _, err = run_cli(["serve", "never-loaded", *args], capsys)
        if needle == "--metrics-names":  # click's own usage error
            assert code == 2 and needle in err and "Traceback" not in err, err
        else:
            assert code == 2
            assert_one_error(code, err, needle)
