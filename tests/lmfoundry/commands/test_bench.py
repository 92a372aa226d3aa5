"""`lmfoundry bench` against a live toy server: schema, numbers that add up, the plot."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from toy import byte_tokenizer, toy_model

from lmfoundry.commands.bench import bench
from lmfoundry.runtime.engine import AsyncLLMEngine, EngineConfig, LLMEngine
from lmfoundry.runtime.server.app import create_app
from lmfoundry.runtime.server.background import serve_in_thread


def test_bench_cli_against_live_server(tmp_path) -> None:
    out = tmp_path / "b.json"
    engine = AsyncLLMEngine(LLMEngine(toy_model(), byte_tokenizer(), EngineConfig(num_kv_blocks=256, block_size=8,
                                                                                  max_model_len=512)))
    with serve_in_thread(create_app(engine, "toy")) as url:
        result = CliRunner().invoke(bench, [url, "--concurrency", "1,4", "--requests", "6", "--max-tokens", "5",
                                            "--prefix-words", "20", "-o", str(out)])
        assert result.exit_code == 0, result.output
    engine.shutdown()
    data = json.loads(out.read_text())
    assert data["model"] == "toy" and data["url"] == url + "/v1"
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 4]
    for lv in data["levels"]:
        assert lv["requests"] == 6 and lv["errors"] == 0
        assert lv["output_tokens"] == 6 * 5
        assert lv["output_tokens_per_s"] == pytest.approx(lv["output_tokens"] / lv["duration_s"])
        for key in ("ttft_s", "itl_s", "e2e_s"):
            assert set(lv[key]) >= {"p50", "p95", "p99"}
            assert 0 < lv[key]["p50"] <= lv[key]["p95"] <= lv[key]["p99"]
        assert lv["ttft_s"]["p50"] <= lv["e2e_s"]["p50"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "c=4" in result.output


def test_bench_cli_unreachable_server_is_a_user_error(tmp_path) -> None:
    from lmfoundry.errors import UserError

    result = CliRunner().invoke(bench, ["http://127.0.0.1:9", "-o", str(tmp_path / "x.json")])
    assert isinstance(result.exception, UserError)
