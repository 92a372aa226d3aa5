"""An `--arch cpu` engine bundle on this CPU (`lmfoundry compile --arch cpu` writes it, see
`lmfoundry.compile.cpu_step`).

Every file is checked against engine.json; on a CPU of the bundle's ISA with the same torch the
engine's steps run the package with no JIT compile; otherwise the same weights are served by the
packed eager model, with one log line saying why. The eager layers are loaded beside the package
(whole-window scoring in `eval` runs them, and so do LoRA steps and steps over the package's
size); `serve` drops their linears when its engine can never run them
(`LLMEngine.release_eager_weights`), so the weights are held once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmfoundry.errors import UserError
from lmfoundry.manifest import sha256_file

log = logging.getLogger("lmfoundry.runtime")


def verify_step(engine: Path, entry: dict[str, Any]) -> Path:
    """The compiled step's file, refused unless inside the bundle and matching its sha256."""
    from lmfoundry.engine_bundle.engine_manifest import EngineIntegrityError
    from lmfoundry.manifest import contained_file

    try:
        path = contained_file(engine, entry["step"]["path"])
    except UserError as exc:
        raise EngineIntegrityError(f"{engine}: compiled step {exc}; refusing to load the bundle") from None
    digest = sha256_file(path)
    if digest != entry["step"]["sha256"]:
        raise EngineIntegrityError(f"{entry['step']['path']}: sha256 {digest[:16]}… does not match engine.json "
                                   f"({entry['step']['sha256'][:16]}…); the bundle was modified or corrupted — "
                                   "refusing to load it")
    return path


def load_cpu_bundle(engine: Path, manifest: dict[str, Any], dtype: torch.dtype | None = None) -> nn.Module:
    """The bundle's model on CPU: the compiled step where this CPU and torch match, else (one log
    line) the packed eager model of the same weights."""
    from lmfoundry.checkpoint.folder import CheckpointReader
    from lmfoundry.engine_bundle.engine_manifest import own_weights, verify_weights
    from lmfoundry.runtime.checkpoint_model import load_causal_lm
    from lmfoundry.runtime.cpu.compiled_step import compiled_step_refusal, load_compiled_step, moe_blocks

    entry = manifest["cpu"]
    verify_weights(engine, manifest)
    package = verify_step(engine, entry)
    want = dtype or torch.bfloat16
    reason = compiled_step_refusal(entry)
    if reason is None and want != torch.bfloat16:
        reason = f"the compiled step runs bfloat16 and --dtype {str(want).removeprefix('torch.')} was asked"
    model = load_causal_lm(CheckpointReader(own_weights(engine)), want)
    if reason is not None:
        log.warning("%s: %s; serving the packed eager model instead", engine, reason)
        return model
    # the eager layers stay here: `eval ppl` and eval-gate call the model on whole windows without a
    # paged cache, and a step over more than max_tokens tokens runs them (serve's engine, which can
    # run neither, drops their linears: `LLMEngine.release_eager_weights`)
    embedded = entry["step"].get("inputs") == "embeddings"  # absent: built before, the step takes ids
    model.compiled_step = load_compiled_step(package, moe_blocks(model), embedded)  # type: ignore[assignment]
    model.compiled_max_tokens = int(entry["max_tokens"])  # type: ignore[assignment]
    return model
