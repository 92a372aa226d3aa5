"""`lmfoundry eval ...`: quality measurements on the reference execution path."""

from __future__ import annotations

import json

import click

from lmfoundry.errors import UserError


@click.group(name="eval")
def eval_group() -> None:
    """Evaluate models or checkpoints (perplexity)."""


@eval_group.command("ppl")
@click.argument("models", nargs=-1, required=True)
@click.option("--text", default=None, help="Text file, JSONL, datasets folder or built-in name "
              "(c4, wiki, ...). Default: the tail of wiki.utf8, held out from calibration.")
@click.option("--ctx", default=512, show_default=True, help="Window length in tokens.")
@click.option("--max-windows", type=int, default=None, help="Evaluate at most this many windows.")
@click.option("--batch-size", default=4, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per model (for scripts and CI).")
def ppl_cmd(models: tuple[str, ...], text: str | None, ctx: int, max_windows: int | None, batch_size: int,
            as_json: bool) -> None:
    """Perplexity of each of MODELS (folder, GGUF, built-in name or quantized checkpoint) on the
    same non-overlapping windows of --ctx tokens, token-weighted. With several models, the first
    is the baseline of the printed ratios."""
    from lmfoundry.calibration.data import eval_token_stream
    from lmfoundry.evals.perplexity import perplexity
    from lmfoundry.runtime.loader import load_model

    if max_windows is not None and max_windows <= 0:
        raise UserError("--max-windows must be positive")
    base = None
    for spec in models:
        lm, tokenizer = load_model(spec)
        stream, source, digest = eval_token_stream(text, tokenizer)
        res = perplexity(lm, stream, ctx=ctx, max_windows=max_windows, batch_size=batch_size, progress=not as_json)
        del lm
        base = base or res
        if as_json:
            click.echo(json.dumps({"model": spec, **res.to_dict(), "ratio_to_first": res.ppl / base.ppl,
                                   "text": source, "text_sha256": digest}))
        else:
            ratio = f"  (x{res.ppl / base.ppl:.4f} vs {models[0]})" if spec != models[0] else ""
            click.echo(f"{spec}: perplexity {res.ppl:.4f} over {res.tokens} tokens "
                       f"({res.windows} windows x {ctx}) of {source}{ratio}")
