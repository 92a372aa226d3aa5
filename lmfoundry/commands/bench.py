"""`lmfoundry bench`: load-test an OpenAI-compatible server at several concurrency levels.

Prints TTFT, inter-token latency and end-to-end percentiles and output tokens/s per level, and
writes them as JSON ({"url", "model", "levels": [{"concurrency", "output_tokens_per_s", "ttft_s",
"itl_s", "e2e_s", "requests"}, ...]}, read by `lmfoundry plan --bench`) and as a PNG plot.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import click

from lmfoundry.errors import UserError


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--concurrency takes comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise UserError("--concurrency levels must be positive integers")
    return sorted(set(levels))


@click.command("bench")
@click.argument("url")
@click.option("--model", default=None, help="Model id to request (default: the first of GET /v1/models).")
@click.option("--concurrency", default="1,4,16", show_default=True, help="Comma-separated concurrency levels.")
@click.option("--requests", "requests_per_level", type=int, default=None,
              help="Requests per level (default: max(2 x concurrency, 8)).")
@click.option("--max-tokens", type=int, default=64, show_default=True, help="Output tokens per request.")
@click.option("--prefix-words", type=int, default=300, show_default=True,
              help="Length of the prompt prefix all requests share, in words.")
@click.option("--api-key", default=None, envvar="LMFOUNDRY_API_KEY")
@click.option("--warmup", type=int, default=1, show_default=True, help="Requests sent before measuring.")
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False, path_type=Path), default=Path("bench.json"),
              show_default=True, help="JSON results; the plot goes next to it (.png).")
def bench(url: str, model: str | None, concurrency: str, requests_per_level: int | None, max_tokens: int,
          prefix_words: int, api_key: str | None, warmup: int, out: Path) -> None:
    """Load-test the OpenAI-compatible server at URL (e.g. http://127.0.0.1:8000)."""
    import httpx

    from lmfoundry.benchmarking.bench_plot import plot
    from lmfoundry.benchmarking.loadgen import run_bench

    levels = parse_levels(concurrency)
    if max_tokens < 1:
        raise UserError("--max-tokens must be at least 1")
    click.echo(f"benchmarking {url}: concurrency {levels}, {max_tokens} output tokens, "
               f"{prefix_words}-word shared prefix")
    try:
        result = asyncio.run(run_bench(url, levels, max_tokens, prefix_words, requests_per_level, model, api_key,
                                       warmup, log=click.echo))
    except httpx.HTTPStatusError as exc:
        raise UserError(f"{url}: {exc.response.status_code} from {exc.request.url}") from None
    except httpx.HTTPError as exc:
        raise UserError(f"{url}: cannot reach the server ({exc})") from None
    if all(lv["requests"] == 0 for lv in result["levels"]):
        raise UserError(f"every request failed; first error: {result['levels'][0]['first_error']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    png = out.with_suffix(".png")
    plot([result], png)
    click.echo(f"wrote {out} and {png}")
