"""The `--tp` option every verb takes (eval, eval-gate, serve), checked before any model loads.

Torch is imported only on the GPU branch: `serve` checks this in its API process, which never
imports torch on a CPU machine (`runtime.engine.core_client`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from lmfoundry.engine_bundle.engine_manifest import bundle_degree, is_engine_bundle
from lmfoundry.errors import UserError


def check_tensor_parallel(tp: int, device: str, models: Iterable[str | Path]) -> None:
    """Refuse a --tp the runtime cannot honour, before any model is loaded (the split itself is
    checked against each model's heads when its ranks start): an engine bundle runs at the
    degree it was compiled for, and only there. `device` is `check_device`'s answer."""
    if tp < 1:
        raise UserError(f"--tp must be at least 1, got {tp}")
    models = tuple(models)
    for spec in models:
        if is_engine_bundle(spec) and (degree := bundle_degree(spec)) != tp:
            raise UserError(degree_refusal(spec, degree, tp))
    if tp > 1 and device.split(":")[0] != "cpu":
        for spec in models:
            if not is_engine_bundle(spec):
                raise UserError(f"{spec}: on GPUs --tp {tp} runs an engine bundle compiled with `lmfoundry compile "
                                f"{spec} --arch ... --tp {tp}` (or split the checkpoint over CPU processes with "
                                "--device cpu)")
        import torch

        if torch.cuda.device_count() < tp:
            raise UserError(f"--tp {tp} runs one rank per GPU; this machine has {torch.cuda.device_count()}")


def degree_refusal(spec: str | Path, degree: int, tp: int) -> str:
    if degree == 1:
        return (f"{spec}: this engine bundle was compiled for one device; run it without --tp, or compile the "
                f"checkpoint with `lmfoundry compile ... --tp {tp}`")
    return f"{spec}: this engine bundle was compiled for --tp {degree}; run it with --tp {degree}"
