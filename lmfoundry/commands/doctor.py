"""`lmfoundry doctor MODEL`: the quantize pre-flight checks as a table and a verdict.

Takes the same method/scheme/recipe options as `quantize` (so a command line can be checked by
replacing `quantize` with `doctor`), plus the serving target (--arch, --gpu-mem, --ctx). On an
already-quantized checkpoint it checks what a runtime will find (fused schemes, KV scales, arch).
Exits non-zero when a check blocks.
"""

from __future__ import annotations

import json
from typing import Any

import click

from lmfoundry.commands.quantize import WholeNumber, recipe_from_cli, recipe_options
from lmfoundry.errors import UserError


@click.command("doctor")
@click.argument("model")
@recipe_options
@click.option("--arch", default=None, help="Target GPU: ampere, ada, hopper, blackwell, a GPU name (h100) or sm_XY.")
@click.option("--gpu-mem", default=None, help="GPU memory to check serving against, e.g. 80GiB.")
@click.option("--ctx", type=WholeNumber(1), default=None, help="Context length for the KV estimate. [model maximum]")
@click.option("--tp", type=WholeNumber(1), default=None,
              help="Tensor-parallel degree to serve with (vLLM --tensor-parallel-size): checks that heads, "
                   "quantization groups and kernel tiles split evenly over that many GPUs.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def doctor(model: str, arch: str | None, gpu_mem: str | None, ctx: int | None, tp: int | None, as_json: bool,
           **flags: Any) -> None:
    """Check that quantizing MODEL this way will work and be servable on the target GPU, before
    spending any time on calibration (or check an existing checkpoint). Takes the same options as
    `quantize`."""
    from lmfoundry.preflight import diagnose, parse_arch, parse_bytes

    if arch is not None:
        parse_arch(arch)  # refuse a typo before any work
    mem = parse_bytes(gpu_mem) if gpu_mem is not None else None
    rec = recipe_from_cli(**flags)
    allow_pickle = flags["allow_pickle"]
    report = diagnose(model, rec, arch=arch, gpu_mem=mem, ctx=ctx, allow_pickle=allow_pickle, tp=tp)
    click.echo(json.dumps(report.to_dict(), indent=2, default=str) if as_json else report.table())
    if report.blocking:
        raise UserError(f"{len(report.blocking)} blocking problem(s): "
                        + ", ".join(dict.fromkeys(c.name for c in report.blocking)))
