"""`lmfoundry compile CKPT --arch cpu`: the engine's CPU step compiled ahead of time.

Bundle layout (the GPU bundle's, with a compiled step instead of cubins):
    engine.json                   manifest: target cpu, ISA, the package's sha256, toolchain
    weights/                      the checkpoint's files, copied (tokenizer, config, and the
                                  weights the eager fallback serves on another ISA)
    cpu/<isa>/step.pt2            AOTInductor package of the decoder over embedded tokens (see
                                  `runtime.cpu.compiled_step`), the decoder's weights
                                  inside as constants

Build: the checkpoint's manifest is verified first; the model is loaded as `serve` loads it on
this CPU (bfloat16, W4A16/W8A16 packed), traced with torch.export over a dynamic token count, and
compiled by AOTInductor with max-autotune (with AMX, Inductor benchmarks its C++ AMX micro-kernels
against ATen for each distinct GEMM shape on this machine; see `gemm_backends`). Everything is
written into a staging folder moved into place at the end (`compile.bundle`). The runtime loads
it (`runtime.cpu.bundle_loading`) and keeps the bundles `serve` builds in its cache
(`runtime.cpu.step_cache`); this module uses the runtime's model and step, not the other way.
"""

from __future__ import annotations

import platform
import shutil
import time
from pathlib import Path
from typing import Any, Callable, cast

import torch
from torch import nn

from lmfoundry.engine_bundle.engine_manifest import CPU_EMBEDDED_FORMAT, CPU_STEP_FOLDER, own_weights, write_manifest
from lmfoundry.errors import UserError
from lmfoundry.manifest import content_files, sha256_file, verify_artifact
from lmfoundry.model.config import ModelConfig
from lmfoundry.runtime.cpu.step_cache import DEFAULT_MAX_TOKENS, compiler_version
from lmfoundry.staging import sigterm_raises

STEP_FILE = "step.pt2"
DTYPE = "bfloat16"
# what the package's step takes: the tokens' embedding rows, looked up by the engine in the table
# it keeps ("ids": packages built before, which hold a copy of the table and look ids up in it)
STEP_INPUTS = "embeddings"


class _Step(nn.Module):
    """The decoder over a flat batch of embedded tokens: every attention an `lmfoundry::attend`
    op, every mixture-of-experts block an `lmfoundry::moe` op (see `runtime.cpu.compiled_step`).
    It holds the rotary table, the layers and the final norm, not the model: the embedding table
    (and an LM head) would otherwise be traced in as the package's constants, a copy of a table the
    engine keeps anyway to look a step's rows up and to apply the head."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        from lmfoundry.runtime.cpu.compiled_step import ExportedMoE, moe_blocks

        for layer in moe_blocks(model):  # the experts stay the eager model's, outside the package
            model.model.layers[layer].mlp = ExportedMoE(layer)
        self.rotary_emb, self.layers, self.norm = model.model.rotary_emb, model.model.layers, model.model.norm

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from lmfoundry.model.reference import run_decoder
        from lmfoundry.runtime.cpu.compiled_step import ExportedAttention

        return run_decoder(self, embeds, positions, ExportedAttention())


def gemm_backends(target: str) -> str:
    """The GEMM implementations Inductor's max-autotune chooses among for a CPU of ISA `target`.
    With AMX, its C++ templates (AMX micro-kernels) beside ATen's. Without, ATen's alone: on
    AVX-512 the C++ int4 template was slower than ATen's int4 kernel at every step size measured
    (`benchmarks/cpu_step_gemm.py`), yet timing at the export's example size could pick it for
    every linear of a package."""
    return "CPP,ATEN" if target == "amx" else "ATEN"  # W8A16 and dense linears freeze into oneDNN's either way


def compile_step(model: nn.Module, package: Path, max_tokens: int, backends: str) -> None:
    """Export `model`'s step with a dynamic token count and AOT-compile it into `package`, its GEMMs
    chosen among `backends` (`gemm_backends`)."""
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    step = _Step(model).eval()
    config = cast(Any, model).config
    embeds = torch.randn(8, config.hidden_size, dtype=cast(Any, model).dtype)
    tokens = torch.export.Dim("tokens", min=1, max=max_tokens)
    # a step of one token must not be specialized away: the same graph serves 1..max_tokens
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
        exported = torch.export.export(step, (embeds, torch.arange(8, dtype=torch.long)),
                                       dynamic_shapes={"embeds": {0: tokens}, "positions": {0: tokens}})
        package.parent.mkdir(parents=True, exist_ok=True)
        options = {"max_autotune": True, "max_autotune_gemm_backends": backends, "freezing": True}
        with inductor_config.patch({"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}):
            torch._inductor.aoti_compile_and_package(exported, package_path=str(package),
                                                     inductor_configs=options)


def build_cpu_engine(checkpoint: str | Path, output: str | Path | None = None, *, block_size: int = 16,
                     max_tokens: int = DEFAULT_MAX_TOKENS, log_line: Callable[[str], None] = lambda m: None,
                     backends: str | None = None) -> tuple[Path, dict[str, Any], float]:
    """Write the `--arch cpu` bundle of `checkpoint`; (bundle folder, engine.json, seconds).
    `backends`: the GEMMs autotuning chooses among (None: `gemm_backends` of this CPU)."""
    from lmfoundry.checkpoint.folder import CheckpointReader
    from lmfoundry.checkpoint.sources import resolve_model

    # imported here, not above: compile.bundle imports the GPU kernel selection (Triton), which a
    # serving process that only looks its compiled step up in the cache must not keep resident
    from lmfoundry.compile.bundle import (
        _check_output,
        _install,
        _remove_dirs,
        _staging,
        default_output,
        place_files,
        source_record,
    )
    from lmfoundry.runtime.checkpoint_model import load_causal_lm
    from lmfoundry.runtime.cpu.features import cpu_features, isa, native_bf16

    t0 = time.perf_counter()
    if max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1, got {max_tokens}")
    if block_size < 1:
        raise UserError(f"--block-size must be at least 1, got {block_size}")
    folder = resolve_model(checkpoint)
    final = Path(output) if output is not None else default_output(Path(checkpoint))
    _check_output(final, folder)
    cfg = ModelConfig.from_file(folder)
    if not native_bf16():
        raise UserError("--arch cpu compiles the bfloat16 step, and this CPU has no bf16 arithmetic "
                        "(AVX512-BF16 or AMX); serve the checkpoint folder itself (float32)")
    verify_artifact(folder, "compile")
    target = isa()
    log_line(f"loading {folder} in {DTYPE} (packed weights) for {target}")
    model = load_causal_lm(CheckpointReader(folder), torch.bfloat16)
    with sigterm_raises():  # a SIGTERM'd build (serve stopping while it builds) removes its stage below
        stage, created = _staging(final)
        try:
            rel = Path(CPU_STEP_FOLDER) / target / STEP_FILE
            backends = backends or gemm_backends(target)
            log_line(f"exporting the step (1..{max_tokens} tokens) and compiling it with AOTInductor "
                     f"(GEMMs: {backends}, timed on this CPU; minutes)")
            tc = time.perf_counter()
            compile_step(model, stage / rel, max_tokens, backends)
            compile_seconds = time.perf_counter() - tc
            own_weights(stage).mkdir()
            files = place_files(content_files(folder), own_weights(stage), "copy")
            features = cpu_features()
            manifest = {
                "format": CPU_EMBEDDED_FORMAT,
                "target": "cpu",
                "source": source_record(folder),
                "model": {"model_type": cfg.model_type, "dtype": DTYPE, "hidden_size": cfg.hidden_size,
                          "num_layers": cfg.num_layers, "vocab_size": cfg.vocab_size,
                          "context_limit": cfg.max_position_embeddings},
                "kv_cache": {"dtype": "auto", "block_size": block_size},
                "archs": {},
                "cpu": {"isa": target, "features": sorted(k for k, v in features.items() if v),
                        "step": {"path": rel.as_posix(), "sha256": sha256_file(stage / rel),
                                 "bytes": (stage / rel).stat().st_size, "inputs": STEP_INPUTS},
                        "max_tokens": max_tokens, "torch": torch.__version__, "compile_seconds": round(compile_seconds, 1),
                        "gemm_backends": backends},
                "toolchain": {"torch": torch.__version__, "compiler": compiler_version(), "machine": platform.machine()},
                "fusions": [],
                "weights": {"mode": "copy", "files": files},
                "kernels": [],
            }
            write_manifest(stage, manifest)
            _install(stage, final)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            _remove_dirs(created)  # the parents made for -o, only while empty
            raise
    return final, manifest, time.perf_counter() - t0
