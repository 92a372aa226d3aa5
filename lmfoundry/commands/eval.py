"""`lmfoundry eval ...`: quality measurements on the reference execution path."""

from __future__ import annotations

import json

import click

from lmfoundry.commands.run_options import device_option, dtype_option, tp_option
from lmfoundry.errors import UserError


@click.group(name="eval")
def eval_group() -> None:
    """Evaluate models or checkpoints (perplexity)."""


@eval_group.command("harness", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                                 "help_option_names": []})
@click.argument("lm_eval_args", nargs=-1, type=click.UNPROCESSED)
def harness_cmd(lm_eval_args: tuple[str, ...]) -> None:
    """Run lm-eval's own CLI with lmfoundry's model registered as `--model lmfoundry`
    (model_args: pretrained=FOLDER|GGUF|NAME|ENGINE, dtype=auto|bfloat16|float32, add_bos, max_length,
    serving=true: score through the serving engine as `serve` runs the model, deterministic=true: as
    `serve --deterministic` runs it, bit for bit).
    Every argument goes to lm-eval unchanged (`lmfoundry eval harness --help` is lm-eval's help).

    \b
    Example:
      lmfoundry eval harness --model lmfoundry --model_args pretrained=out/ --tasks arc_easy --limit 100
    """
    import os
    import sys

    from lm_eval.__main__ import cli_evaluate

    import lmfoundry.evals.lm_adapter  # noqa: F401 - registers the model with lm-eval

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched from a hub here
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    sys.argv = ["lm_eval", *lm_eval_args]
    cli_evaluate()


@eval_group.command("ppl")
@click.argument("models", nargs=-1, required=True)
@click.option("--text", default=None, help="Text file, JSONL, datasets folder or built-in name "
              "(c4, wiki, ...). Default: the tail of wiki.utf8, held out from calibration.")
@click.option("--ctx", default=512, show_default=True,
              help="Window length in tokens (2 to the model's max_position_embeddings).")
@click.option("--max-windows", type=int, default=None, help="Evaluate at most this many windows.")
@click.option("--batch-size", default=4, show_default=True, help="Windows per forward pass (at least 1).")
@tp_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per model (for scripts and CI).")
@device_option
@dtype_option
@click.option("--deterministic", is_flag=True,
              help="Score the windows through the serving engine as `serve --deterministic` runs the model "
                   "(batch-invariant: the same numbers whatever --batch-size; CPU, one process).")
def ppl_cmd(models: tuple[str, ...], text: str | None, ctx: int, max_windows: int | None, batch_size: int,
            tp: int, as_json: bool, device: str, dtype: str, deterministic: bool) -> None:
    """Perplexity of each of MODELS (folder, GGUF, built-in name or quantized checkpoint) on the
    same non-overlapping windows of --ctx tokens, token-weighted: by the reference forward, or
    through the serving engine with --deterministic. With several models, the first is the
    baseline of the printed ratios."""
    from lmfoundry.calibration.data import eval_token_stream
    from lmfoundry.devices import check_device
    from lmfoundry.evals.checked_model import check_context, check_model
    from lmfoundry.evals.perplexity import perplexity
    from lmfoundry.runtime.loader import load_model, resolve_dtype
    from lmfoundry.runtime.placement import check_tensor_parallel

    device = check_device(device)
    check_tensor_parallel(tp, device, models)
    if deterministic and (device != "cpu" or tp > 1):
        raise UserError("--deterministic runs the CPU engine in one process; drop --device / --tp")
    # Option bounds and every model's config, before loading any weights: a bad option or a bad
    # second model must not cost a whole evaluation of the first.
    if ctx < 2:
        raise UserError(f"--ctx must be at least 2 (each window predicts its next tokens), got {ctx}")
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    if max_windows is not None and max_windows <= 0:
        raise UserError("--max-windows must be positive")
    for spec in models:
        check_context(ctx, check_model(spec, allow_bundle=True), "--ctx")
    base = None
    for spec in models:
        run_dtype = resolve_dtype(dtype, spec, device)
        if tp > 1:
            import torch

            from lmfoundry.runtime.engine.ranks import ShardSpec, load_sharded

            lm, tokenizer = load_sharded(ShardSpec.on(spec, run_dtype, tp, max(1, torch.get_num_threads() // tp), device))
        else:
            lm, tokenizer = load_model(spec, dtype=run_dtype, device=device)
        try:
            stream, source, digest = eval_token_stream(text, tokenizer)
            scorer = lm
            if deterministic:
                from lmfoundry.evals.lm_adapter import RuntimeLM

                scorer = RuntimeLM(lm, tokenizer, deterministic=True)
            res = perplexity(scorer, stream, ctx=ctx, max_windows=max_windows, batch_size=batch_size,
                             progress=not as_json)
        finally:
            if tp > 1:
                lm.close()
        del lm
        base = base or res
        if as_json:
            click.echo(json.dumps({"model": spec, **res.to_dict(), "ratio_to_first": res.ppl / base.ppl,
                                   "text": source, "text_sha256": digest}))
        else:
            ratio = f"  (x{res.ppl / base.ppl:.4f} vs {models[0]})" if spec != models[0] else ""
            click.echo(f"{spec}: perplexity {res.ppl:.4f} over {res.tokens} tokens "
                       f"({res.windows} windows x {ctx}) of {source}{ratio}")
