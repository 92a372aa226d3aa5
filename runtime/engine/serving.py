"""The engine `serve` runs, built in its engine process (`EngineSpec(serving_engine, ...)`).

Everything that reads the CPU or needs torch is decided here, in the engine process, and not in
the API process, which then never imports torch (on a CPU machine): the CPU's line, --dtype auto,
the compiled step (`runtime.cpu.step_policy`: the default's choice, and the build in a child
process), then the model, less the eager weights a compiled step makes unused. The engine
process imports neither the CLI nor click to build it. What can be refused before it starts is
refused in the API process first (`check_serving`, `bundle_block_size`), before a model loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lmfoundry.errors import UserError

if TYPE_CHECKING:  # imported where the engine is built: the API process that names the factory imports no torch
    from lmfoundry.runtime.engine.engine_config import EngineConfig
    from lmfoundry.runtime.engine.llm_engine import LLMEngine


def serving_engine(model: str, dtype: str, config: EngineConfig, *, device: str, compile_step: bool | None,
                   draft_model: str | None = None, verified: bool = False) -> LLMEngine:
    """The engine of `serve MODEL`: `dtype` as --dtype gives it, `compile_step` as
    --compile-step/--no-compile-step (None: the default, `step_policy.compiled_step_by_default`),
    `verified` when serve has checked the checkpoint against its manifest. Its lines go to the
    terminal the engine process shares with serve, its UserErrors to serve through the engine's
    start-up (`core_client`)."""
    from lmfoundry.runtime.cpu import step_policy
    from lmfoundry.runtime.cpu.features import describe
    from lmfoundry.runtime.engine.llm_engine import LLMEngine
    from lmfoundry.runtime.loader import resolve_dtype

    if device == "cpu":
        step_policy.say(describe(dtype))
    run_dtype = resolve_dtype(dtype, model, device)
    if compile_step:
        model = step_policy.compiled_step_bundle(model, config.block_size, verified)
    elif compile_step is None:
        reason = step_policy.compiled_step_by_default(model, device, config.tensor_parallel_size, config.deterministic,
                                                      run_dtype, config.max_loras, config.speculative)
        model = step_policy.default_compiled_step(model, config.block_size, reason, verified)
    engine = LLMEngine.from_pretrained(model, run_dtype, config, device=device, draft_model=draft_model)
    engine.release_eager_weights()  # a compiled step's package holds the weights: not twice
    return engine


def check_serving(model: str, device: str, tp: int, compile_step: bool | None, deterministic: bool) -> None:
    """Refuse what cannot hold before anything loads: --deterministic off the one-process CPU
    engine or with a compiled step (the engine refuses the rest: a model, an --arch cpu bundle or
    a KV cache without batch-invariant kernels), --compile-step on a GPU, with --tp or for a
    bundle (the engine process builds the step after every check)."""
    from lmfoundry.engine_bundle.engine_manifest import is_engine_bundle

    if deterministic:
        if device != "cpu":
            raise UserError(f"--deterministic runs the CPU engine, not --device {device}")
        if tp > 1:
            raise UserError("--deterministic runs one process; drop --tp")
        if compile_step:
            raise UserError("--deterministic runs the eager model: a compiled step chooses its kernels by the "
                            "step's size; drop --compile-step")
    if compile_step:
        if device != "cpu":
            raise UserError("--compile-step compiles the CPU step; on a GPU serve a `lmfoundry compile` bundle")
        if tp > 1:
            raise UserError("--compile-step compiles one process's step; drop it with --tp")
        if is_engine_bundle(model):
            raise UserError(f"{model} is an engine bundle already: serve it without --compile-step")


def bundle_block_size(model: str, block_size: int | None) -> int:
    """The KV block size to serve `model` with: an engine bundle's paged-attention kernels were
    specialized for the one it was compiled for (a different --block-size is refused); a
    checkpoint takes `block_size`, 16 by default."""
    from lmfoundry.engine_bundle.engine_manifest import bundle_degree, is_engine_bundle, rank_folder, read_manifest

    if not is_engine_bundle(model):
        return 16 if block_size is None else block_size
    folder = Path(model) / rank_folder(0) if bundle_degree(model) > 1 else Path(model)
    compiled = int(read_manifest(folder)["kv_cache"]["block_size"])
    if block_size is not None and block_size != compiled:
        raise UserError(f"{model}: the bundle was compiled for --block-size {compiled}; serve it with "
                        f"that (or leave --block-size out), or compile again with --block-size {block_size}")
    return compiled
