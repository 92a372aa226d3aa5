"""`lmfoundry quantize`: calibrate a model layer by layer and write a compressed-tensors checkpoint.

This module only parses the command line: the recipe is built (the YAML with the flags applied,
once) and the job run by the Python API's `quantize` path (`lmfoundry.api.artifact_builds`), the same
code `lmfoundry.quantize(...)` runs, output-folder checks included; the summary is printed here.
The recipe options are shared with `lmfoundry doctor`, so a command line can be checked by
replacing `quantize` with `doctor`.
"""

from __future__ import annotations

import json
from typing import Any

import click

from lmfoundry.api.artifact_builds import build_recipe, run_quantize
from lmfoundry.calibration.job import OFFLOAD_CHOICES
from lmfoundry.errors import UserError
from lmfoundry.quantizers.from_recipe import KV_CHOICES
from lmfoundry.recipe import LM_HEAD_CHOICES, Recipe


class WholeNumber(click.ParamType):
    """An integer option within [low, high], refused with one `error:` line (a UserError) rather
    than click's usage block: `--seed 1e23` or `--num-samples 1.5` are user mistakes like any
    other, and a seed beyond 64 bits used to pass parsing and crash in torch."""

    name = "integer"

    def __init__(self, low: int, high: int | None = None) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        flag = param.opts[0] if param is not None and param.opts else "value"
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = int(str(value).strip(), 10)
            except ValueError:
                number = None
        if number is None or number < self.low or (self.high is not None and number > self.high):
            bound = f"from {self.low} to {self.high}" if self.high is not None else f">= {self.low}"
            raise UserError(f"{flag} {value}: expected a whole number {bound}")
        return number


RECIPE_OPTIONS = [
    click.option("--recipe", default=None, help="Recipe YAML (path, or name of one in recipes/). Flags override it."),
    click.option("--method", type=click.Choice(["rtn", "gptq", "awq", "smoothquant", "fp8"]), default=None,
                 help="Quantization algorithm. [recipe default: rtn]"),
    click.option("--scheme", default=None, help="wNa16 (N=2..8: w4a16, w8a16), w8a8 (dynamic per-token int8 "
                 "activations), w8a8-static, fp8-dynamic, fp8-static. [w4a16]"),
    click.option("--group-size", type=WholeNumber(1), default=None, help="Weight group size for wNa16 (default 128)."),
    click.option("--per-channel", is_flag=True, default=None, help="One scale per output channel instead of groups."),
    click.option("--sym/--asym", "symmetric", default=None, help="Symmetric (default) or asymmetric weights."),
    click.option("--observer", type=click.Choice(["minmax", "mse"]), default=None, help="Weight range statistic."),
    click.option("--actorder", type=click.Choice(["static", "dynamic"]), default=None, help="GPTQ activation order."),
    click.option("--kv-cache", type=click.Choice(KV_CHOICES), default=None, help="Also quantize the KV cache."),
    click.option("--lm-head", type=click.Choice(LM_HEAD_CHOICES), default=None,
                 help="Also quantize the LM head (read in full every decode step): w8a16 = int8 per output "
                      "channel, w4a16 = int4 in --group-size groups. A tied head is stored apart from the "
                      "embedding. transformers and lmfoundry read it; keep float for vLLM/SGLang. [float]"),
    click.option("--calib", default=None, help="Calibration text/JSONL/datasets folder or built-in name. [c4]"),
    click.option("--num-samples", type=WholeNumber(1), default=None, help="Calibration samples. [128]"),
    click.option("--seq-len", type=WholeNumber(1), default=None, help="Tokens per calibration sample. [512]"),
    click.option("--seed", type=WholeNumber(0, 2**64 - 1), default=None, help="Sampling seed. [0]"),
    click.option("--propagate", type=click.Choice(["quantized", "float"]), default=None,
                 help="Feed the next layer the quantized (default) or the float layer's outputs."),
    click.option("--moe-experts", type=click.Choice(["all", "routed"]), default=None,
                 help="MoE models: every expert calibrates on all tokens (default; rarely chosen experts get "
                      "statistics) or on the tokens routed to it (an expert no token chose still sees all)."),
    click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None,
                 help="Storage dtype of scales and unquantized tensors (auto = the source's)."),
    click.option("--option", "options", multiple=True, metavar="KEY=VALUE",
                 help="Method option, e.g. dampening_frac=0.01 (gptq) or alpha=0.5 (smoothquant)."),
    click.option("--allow-pickle", is_flag=True, help="Convert pickle (*.bin) weights; pickle can run code."),
]


def recipe_options(f: Any) -> Any:
    """The recipe-shaping options shared by `quantize` and `doctor`."""
    for opt in reversed(RECIPE_OPTIONS):
        f = opt(f)
    return f


def recipe_from_cli(recipe: str | None, calib: str | None = None, per_channel: bool | None = None,
                    options: tuple[str, ...] = (), allow_pickle: bool = False, **flags: Any) -> Recipe:
    """The recipe as applied (`build_recipe`): the YAML (or the defaults) with every given flag
    overriding it. `--per-channel` can only turn per-channel on (absent, the recipe decides), and
    `--option` adds to the recipe's options rather than replacing them."""
    return build_recipe(recipe, calib=calib, per_channel=per_channel or None,
                        options=parse_options(options) if options else None, **flags)


@click.command("quantize")
@click.argument("model")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="Output folder.")
@recipe_options
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output folder.")
@click.option("--skip-doctor", is_flag=True, help="Do not run the pre-flight checks.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--resume", is_flag=True,
              help="Continue a run of the same inputs that was killed (SIGKILL, out of memory, preemption) "
                   "from the last layer it finished, writing the same bytes; its journal lives in the hidden "
                   "`.OUTPUT.partial-PID` folder next to the output.")
@click.option("--device", default="auto", show_default=True,
              help="Where layers, calibration activations and statistics (Hessians) live: cpu, cuda[:N], or "
                   "auto (the GPU if there is one). Weights stream from the safetensors to the device one layer "
                   "at a time; shards stream back to disk.")
@click.option("--offload", type=click.Choice(OFFLOAD_CHOICES), default="auto", show_default=True,
              help="Keep calibration activations in pinned host memory between uses (GPU runs whose activations "
                   "do not fit beside a layer); auto decides from free GPU memory, as `doctor` reports.")
def quantize(model: str, output: str, overwrite: bool, skip_doctor: bool, quiet: bool, resume: bool,
             device: str, offload: str, **flags: Any) -> None:
    """Quantize MODEL (a HF folder, a .gguf file, or `smollm2-135m`) into a checkpoint that vLLM,
    SGLang and transformers load (compressed-tensors), plus lmfoundry.json (recipe, versions,
    hashes, per-layer errors; no local paths) and lmfoundry-run.json (time, memory, device; not
    hashed). Prints the peak RSS at the end.

    Data-parallel calibration: `torchrun --nproc-per-node N --no-python lmfoundry quantize ...`
    shares the calibration samples among N processes (gloo on CPU, NCCL on GPU, one GPU each),
    sums their statistics before every quantization step, and rank 0 writes the checkpoint."""
    _, summary = run_quantize(model, output=output, recipe=recipe_from_cli(**flags), allow_pickle=flags["allow_pickle"],
                              overwrite=overwrite, skip_doctor=skip_doctor, resume=resume, device=device,
                              offload=offload, quiet=quiet)
    if summary:
        click.echo(summary)


def parse_options(items: tuple[str, ...]) -> dict[str, Any]:
    """`--option KEY=VALUE` items as a mapping; a value is JSON when it parses as JSON (numbers,
    booleans), else the string."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--option {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out
