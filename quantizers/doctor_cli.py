"""`lmfoundry doctor MODEL`: the quantize pre-flight checks as a table and a verdict.

Takes the same method/scheme/recipe options as `quantize` (so a command line can be checked by
replacing `quantize` with `doctor`), plus the serving target (--arch, --gpu-mem, --ctx). On an
already-quantized checkpoint it checks what a runtime will find (fused schemes, KV scales, arch).
Exits non-zero when a check blocks.
"""

from __future__ import annotations

import json

import click

from lmfoundry.errors import UserError


@click.command("doctor")
@click.argument("model")
@click.option("--recipe", default=None, help="Recipe YAML (path, or name of one in recipes/). Flags override it.")
@click.option("--method", type=click.Choice(["rtn", "gptq", "awq", "smoothquant", "fp8"]), default=None,
              help="Quantization algorithm. [recipe default: rtn]")
@click.option("--scheme", default=None, help="wNa16 (N=2..8: w4a16, w8a16), w8a8, fp8-dynamic, fp8-static. [w4a16]")
@click.option("--group-size", type=int, default=None, help="Weight group size for wNa16 (default 128).")
@click.option("--per-channel", is_flag=True, default=None, help="One scale per output channel instead of groups.")
@click.option("--sym/--asym", "symmetric", default=None, help="Symmetric (default) or asymmetric weights.")
@click.option("--observer", type=click.Choice(["minmax", "mse"]), default=None, help="Weight range statistic.")
@click.option("--actorder", type=click.Choice(["static", "dynamic"]), default=None, help="GPTQ activation order.")
@click.option("--kv-cache", type=click.Choice(["int8", "fp8"]), default=None, help="Also quantize the KV cache.")
@click.option("--calib", default=None, help="Calibration source (only its sample counts matter here).")
@click.option("--num-samples", type=int, default=None, help="Calibration samples. [128]")
@click.option("--seq-len", type=int, default=None, help="Tokens per calibration sample. [512]")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None,
              help="Storage dtype of scales and unquantized tensors.")
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE", help="Method option, e.g. alpha=0.6.")
@click.option("--arch", default=None, help="Target GPU: ampere, ada, hopper, blackwell, a GPU name (h100) or sm_XY.")
@click.option("--gpu-mem", default=None, help="GPU memory to check serving against, e.g. 80GiB.")
@click.option("--ctx", type=int, default=None, help="Context length for the KV estimate. [model maximum]")
@click.option("--allow-pickle", is_flag=True, help="Convert pickle (*.bin) weights; pickle can run code.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def doctor(model: str, recipe: str | None, method: str | None, scheme: str | None, group_size: int | None,
           per_channel: bool | None, symmetric: bool | None, observer: str | None, actorder: str | None,
           kv_cache: str | None, calib: str | None, num_samples: int | None, seq_len: int | None,
           dtype: str | None, options: tuple[str, ...], arch: str | None, gpu_mem: str | None,
           ctx: int | None, allow_pickle: bool, as_json: bool) -> None:
    """Check that quantizing MODEL this way will work and be servable on the target GPU, before
    spending any time on calibration (or check an existing checkpoint)."""
    from lmfoundry.commands.quantize import parse_options
    from lmfoundry.quantizers.doctor import diagnose, parse_arch, parse_bytes
    from lmfoundry.recipe import apply_overrides, load_recipe

    if arch is not None:
        parse_arch(arch)  # refuse a typo before any work
    mem = parse_bytes(gpu_mem) if gpu_mem is not None else None
    if ctx is not None and ctx <= 0:
        raise UserError("--ctx must be positive")
    rec = load_recipe(recipe)
    apply_overrides(rec, "quantize", method=method, scheme=scheme, group_size=group_size,
                    per_channel=per_channel or None, symmetric=symmetric, observer=observer,
                    actorder=actorder, kv_cache=kv_cache, dtype=dtype)
    if options:
        rec["quantize"]["options"] = {**rec["quantize"]["options"], **parse_options(options)}
    apply_overrides(rec, "calibration", source=calib, num_samples=num_samples, seq_len=seq_len)
    report = diagnose(model, rec, arch=arch, gpu_mem=mem, ctx=ctx, allow_pickle=allow_pickle)
    click.echo(json.dumps(report.to_dict(), indent=2, default=str) if as_json else report.table())
    if report.blocking:
        raise UserError(f"{len(report.blocking)} blocking problem(s): "
                        + ", ".join(dict.fromkeys(c.name for c in report.blocking)))
