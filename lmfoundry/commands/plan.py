"""`lmfoundry plan`: GPU memory, KV-cache and cost arithmetic before anyone rents a GPU.

Reads only a model's config.json (never its weights, never torch), so it answers in well under a
second: how many bytes the weights take at each precision, how many bytes one token of KV cache
costs, how many full-context sequences fit on the chosen GPU, and, given a throughput and prices,
what a million output tokens costs and when self-hosting beats an API. This module parses the
flags; the inputs are read in `lmfoundry.capacity.inputs`, the arithmetic is
`lmfoundry.capacity.arithmetic`, and `lmfoundry.capacity.report` builds and renders the answer.
"""

from __future__ import annotations

import json
import math
from typing import Any

import click

from lmfoundry.capacity.inputs import CapacityInputs
from lmfoundry.capacity.report import build_report, render, render_gpus
from lmfoundry.errors import UserError
from lmfoundry.gpus import load_gpus


class _Number(click.ParamType):
    """int/float option whose parse errors are one-line UserErrors like every other plan error."""

    def __init__(self, kind: type) -> None:
        self.kind = kind
        self.name = kind.__name__

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, self.kind):
            return value
        flag = param.opts[0] if param is not None and param.opts else "value"
        noun = "an integer" if self.kind is int else "a finite number"
        try:
            number = self.kind(value)
        except (TypeError, ValueError, OverflowError):
            raise UserError(f"{flag} must be {noun}, got {value!r}") from None
        if not math.isfinite(number):  # nan and inf reached int() and the arithmetic as tracebacks
            raise UserError(f"{flag} must be {noun}, got {value!r}")
        return number


INT, FLOAT = _Number(int), _Number(float)


@click.command("plan")
@click.argument("model_or_checkpoint", required=False)
@click.option("--gpu", metavar="NAME", default="h100-80gb", show_default=True, help="GPU from lmfoundry/gpus.yaml (--list-gpus).")
@click.option("--context", type=INT, default=8192, show_default=True, help="Tokens per sequence (prompt + output).")
@click.option("--weights", metavar="bf16|fp8|int8|int4", default=None, help="Weight precision of the headline plan [default: the checkpoint's, else bf16].")
@click.option("--kv", metavar="bf16|fp8|int8", default="bf16", show_default=True, help="KV-cache dtype of the headline plan.")
@click.option("--tp", type=INT, default=1, show_default=True, help="Tensor-parallel GPUs.")
@click.option("--gpu-util", type=FLOAT, default=0.9, show_default=True, help="Fraction of GPU memory the engine may use.")
@click.option("--group-size", metavar="N|channel", default=None, help="int4/int8 group size or 'channel' [default: int4 128, int8 channel, or the checkpoint's].")
@click.option("--asymmetric", is_flag=True, help="Count a zero point per int4/int8 scale.")
@click.option("--batch-tokens", type=INT, default=8192, show_default=True, help="Tokens per forward step (sizes the activation workspace).")
@click.option("--overhead-gib", type=FLOAT, default=1.0, show_default=True, help="CUDA context, CUDA graphs, NCCL and allocator slack per GPU.")
@click.option("--throughput", metavar="TOK_S", type=FLOAT, default=None, help="Measured output tokens/s of the whole deployment (all --tp GPUs).")
@click.option("--bench", metavar="FILE", default=None, help="JSON from `lmfoundry bench` (uses its best level).")
@click.option("--concurrency", type=INT, default=None, help="Use this concurrency level of --bench.")
@click.option("--gpu-hour-price", metavar="USD", type=FLOAT, default=None, help="Price of one GPU-hour (the deployment pays for --tp of them).")
@click.option("--api-price", metavar="USD", type=FLOAT, default=None, help="API price per million output tokens.")
@click.option("--max-loras", type=INT, default=None,
              help="LoRA adapter slots the server holds (serve --max-loras): their stacked weights count with the "
                   "weights.")
@click.option("--max-lora-rank", type=INT, default=16, show_default=True, help="Largest adapter rank (serve --max-lora-rank).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--list-gpus", is_flag=True, help="Print the GPU table and exit.")
def plan(model_or_checkpoint: str | None, as_json: bool, list_gpus: bool, **options: Any) -> None:
    """Memory, KV-cache and cost arithmetic for MODEL_OR_CHECKPOINT (a model folder, a config.json,
    or smollm2-135m), from its config alone.

    \b
    Counts: weights per precision (int4/int8 include 16-bit group scales and, if asymmetric, zero
    points; embeddings, norms and lm_head stay 16-bit); KV bytes per token = 2 x layers x KV heads x
    head_dim x bytes; sequences that fit in memory x --gpu-util after weights, an activation
    workspace and --overhead-gib. --tp splits weights and KV heads (a KV head is replicated when
    tp > KV heads). With --throughput or --bench plus --gpu-hour-price: cost per million output
    tokens, and with --api-price the monthly break-even volume. With --max-loras N: N LoRA slots of
    rank --max-lora-rank, A [r, in] and B [out, r] of every linear in 16 bits, count with the weights.
    """
    if list_gpus:
        gpus = load_gpus()
        click.echo(json.dumps(gpus, indent=2) if as_json else render_gpus(gpus))
        return
    if not model_or_checkpoint:
        raise UserError("missing MODEL_OR_CHECKPOINT (a model folder, a config.json, or smollm2-135m)")
    report = build_report(CapacityInputs(model=model_or_checkpoint, **options))
    click.echo(json.dumps(report, indent=2) if as_json else render(report))
