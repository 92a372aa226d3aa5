"""`quantize` and `compile`: the two API calls that write an artifact, and the one place a recipe
is assembled from keywords (`build_recipe`), shared by the `quantize` and `doctor` commands.

Every keyword is the CLI flag of the same name with dashes as underscores, so a command line
translates to a call one to one, and both run this code: the commands only parse flags and
print what comes back.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from lmfoundry.api.artifacts import Bundle, Checkpoint, artifact_path, open_bundle, open_checkpoint
from lmfoundry.errors import UserError
from lmfoundry.recipe import Recipe


def stderr_log(quiet: bool) -> Callable[[str], None]:
    """Where an API call's log lines go: stderr, or nowhere with `quiet` (stdout is the caller's)."""
    if quiet:
        return lambda message: None
    return lambda message: print(message, file=sys.stderr, flush=True)


def build_recipe(recipe: Recipe | str | Path | None = None, *, calib: str | None = None,
                 per_channel: bool | None = None, options: Mapping[str, Any] | None = None,
                 **fields: Any) -> Recipe:
    """The recipe as applied: `recipe` (a `Recipe`, a YAML path or a built-in recipe's name; None:
    the defaults) with every keyword that is not None overriding it, checked again afterwards (an
    override may be what makes it invalid). `calib` sets the calibration source; `options` adds to
    the recipe's method options rather than replacing them; `fields` are the other keys of the
    recipe's `quantize` and `calibration` sections (method, scheme, group_size, seed, ...)."""
    if isinstance(recipe, Recipe):
        base = recipe.check()
    elif recipe is None or isinstance(recipe, (str, Path)):
        base = Recipe.from_yaml(recipe)
    else:
        raise UserError(f"recipe: expected a Recipe, a YAML path or a recipe name, got {type(recipe).__name__}")
    if options is not None and not isinstance(options, Mapping):
        raise UserError(f"options: expected a mapping of method options, got {type(options).__name__}")
    merged = {**base.quantize.options, **options} if options else None
    return base.with_overrides(source=calib, per_channel=per_channel, options=merged, **fields)


def quantize(model: str | Path, *, output: str | Path, method: str | None = None, scheme: str | None = None,
             group_size: int | None = None, recipe: Recipe | str | Path | None = None, calib: str | None = None,
             num_samples: int | None = None, seq_len: int | None = None, seed: int | None = None,
             per_channel: bool | None = None, symmetric: bool | None = None, observer: str | None = None,
             actorder: str | None = None, kv_cache: str | None = None, lm_head: str | None = None,
             propagate: str | None = None, moe_experts: str | None = None, dtype: str | None = None, options: Mapping[str, Any] | None = None,
             allow_pickle: bool = False, overwrite: bool = False, skip_doctor: bool = False, resume: bool = False,
             device: str = "auto", offload: str = "auto", quiet: bool = False) -> Checkpoint | None:
    """Quantize `model` (a HF folder, a .gguf file or a built-in name such as `smollm2-135m`) into
    a compressed-tensors checkpoint at `output`, as `lmfoundry quantize` does, and return it.

    The recipe is `recipe` (a `Recipe`, a YAML path or a built-in recipe's name; as in
    llm-compressor's `oneshot`) with every other recipe keyword that is not None overriding it
    (None: the recipe's value; see docs/reference/quantize.md for each). Progress bars and the
    summary lines go to stderr, nothing with `quiet`. A bad input raises `LmfoundryError` before
    anything is written; any failure leaves the disk as it was. Under `torchrun`, ranks other
    than 0 share the calibration and write nothing: they return None."""
    checkpoint, summary = run_quantize(
        model, output=output, recipe=build_recipe(
            recipe, calib=calib, per_channel=per_channel, options=options, method=method, scheme=scheme,
            group_size=group_size, num_samples=num_samples, seq_len=seq_len, seed=seed, symmetric=symmetric,
            observer=observer, actorder=actorder, kv_cache=kv_cache, lm_head=lm_head, propagate=propagate,
            moe_experts=moe_experts, dtype=dtype),
        allow_pickle=allow_pickle, overwrite=overwrite, skip_doctor=skip_doctor, resume=resume, device=device,
        offload=offload, quiet=quiet)
    if summary:
        stderr_log(quiet)(summary)
    return checkpoint


def run_quantize(model: str | Path, *, output: str | Path, recipe: Recipe, allow_pickle: bool = False,
                 overwrite: bool = False, skip_doctor: bool = False, resume: bool = False, device: str = "auto",
                 offload: str = "auto", quiet: bool = False) -> tuple[Checkpoint | None, str]:
    """`quantize` with the recipe built: (the checkpoint, the summary text). The command prints
    the summary on stdout, the API on stderr; everything else is this one path."""
    from lmfoundry.calibration.job import QuantizeJob, run_job

    job = QuantizeJob(str(model), Path(output), recipe, overwrite=overwrite, allow_pickle=allow_pickle,
                      doctor=not skip_doctor, progress=not quiet, resume=resume, device=device, offload=offload)
    summary = run_job(job)
    if not summary:  # a data-parallel rank other than 0: rank 0 writes the checkpoint
        return None, ""
    return open_checkpoint(Path(output).expanduser().resolve(), verify=False), summary


def compile(checkpoint: str | Path | Checkpoint, *, arch: str | Sequence[str], output: str | Path | None = None,
            weights: str = "repack", jobs: int = 2, block_size: int = 16, dtype: str = "auto", tune: bool = False,
            max_tokens: int | None = None, tp: int = 1, max_loras: int | None = None, max_lora_rank: int = 16,
            quiet: bool = False) -> Bundle:
    """Compile `checkpoint` into an engine bundle at `output` (default: CHECKPOINT-engine beside
    it), as `lmfoundry compile` does, and return it.

    `arch` is one GPU architecture or several (ampere, ada, hopper: Triton kernels cross-compiled
    without a GPU), or "cpu" alone (the engine's step compiled ahead of time with AOTInductor for
    this machine's ISA). The other keywords are the command's flags (docs/reference/compile.md).
    Progress and log lines go to stderr, nothing with `quiet`. A refused input raises
    `LmfoundryError`; a failed or interrupted build leaves neither a half-written bundle nor a
    damaged old one.

    Signals: while the bundle is staged, a SIGTERM ends the build through its cleanup (a
    `SystemExit(143)`, so the stage is removed) instead of killing the process where it stands;
    this handler is set only on the main thread and only when the caller has none of its own,
    and the default is put back when the build returns."""
    archs = [arch] if isinstance(arch, str) else list(arch)
    src = artifact_path(checkpoint)
    log = stderr_log(quiet)
    if not archs:
        raise UserError("name at least one --arch (ampere, ada, hopper, or cpu)")
    if any(a.strip().lower() == "cpu" for a in archs):
        if len(archs) > 1:
            raise UserError("--arch cpu builds a bundle of its own (a compiled CPU step, no cubins): "
                            "run it separately from the GPU archs")
        if tp > 1:
            raise UserError(f"--arch cpu compiles one process's step; --tp {tp} serves the checkpoint (or a GPU "
                            "arch's bundle) split over CPU processes without a compiled step")
        if max_loras is not None:
            raise UserError("--max-loras builds GPU kernels; an --arch cpu bundle serves adapters without them "
                            "(`serve ENGINE --lora ...` runs steps with adapter rows on its eager layers)")
        from lmfoundry.compile.cpu_step import DEFAULT_MAX_TOKENS, build_cpu_engine

        out, _, seconds = build_cpu_engine(src, output, block_size=block_size,
                                           max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                                           log_line=log)
        return _built(out, seconds)
    if max_tokens is not None:
        raise UserError("--max-tokens applies to --arch cpu only")
    from lmfoundry.compile.bundle import build_engine

    result = build_engine(src, archs, output, weights=weights, workers=jobs, block_size=block_size,
                          dtype=None if dtype == "auto" else dtype, tune=tune, progress=not quiet, log=log, tp=tp,
                          lora=(max_loras, max_lora_rank) if max_loras is not None else None)
    return _built(result.output, result.seconds)


def _built(out: Path, seconds: float) -> Bundle:
    """The bundle just written, opened without hashing it again (compile hashed what it wrote)."""
    return replace(open_bundle(Path(out), verify=False), seconds=seconds)
