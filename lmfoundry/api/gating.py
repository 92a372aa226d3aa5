"""`eval_gate`: the eval-gate of `lmfoundry eval-gate` as a call that returns its result, and
`plan_eval_gate`, its `--dry-run`.

`run_gate` (lmfoundry/evals/gate.py) does the work and returns a `GateResult`; this adds what
must hold before it (the device, the tensor-parallel degree and the flags that exclude each other
checked, every checkpoint's files verified against their sha256) and never exits: the verdict is
data, `exit_code` the code the command would exit with. The command parses its flags, calls
these and prints what comes back, so both give the same verdict and the same one-line errors.

The gate itself (torch, lm-eval, the engine) is imported when a call runs: importing the API
imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lmfoundry.api.artifacts import Bundle, Checkpoint, artifact_path
from lmfoundry.devices import check_device
from lmfoundry.engine_bundle.engine_manifest import is_engine_bundle
from lmfoundry.errors import UserError
from lmfoundry.manifest import verify_artifact
from lmfoundry.runtime.placement import check_tensor_parallel

if TYPE_CHECKING:
    from lmfoundry.evals.gate import GateResult
    from lmfoundry.evals.gate_memory import MemoryPlan

ModelSpec = str | Path | Checkpoint | Bundle  # what a model argument may be


def eval_gate(candidate: ModelSpec, *, baseline: ModelSpec, gate: str | Path | None = None, tier: str = "quick",
              output: str | Path = "eval-gate", tasks: Sequence[str] = (), include_paths: Sequence[str] = (),
              use_cache: bool = True, inconclusive_exit: int | None = None, write_promotion: bool = True,
              device: str = "cpu", dtype: str = "auto", tp: int = 1, deterministic: bool = False,
              skip_verify: bool = False, quiet: bool = False, lora: tuple[str, str] | None = None) -> GateResult:
    """Gate `candidate` against `baseline` (each a folder, a GGUF file, a built-in name, or what
    `quantize` / `compile` returned) on the same documents through the serving engine, as
    `lmfoundry eval-gate` does, and return the `GateResult`:

    - `verdict`: "pass", "fail" or "inconclusive"; `exit_code`: what the command exits with;
    - `report["metrics"]`: each statistic with its point estimate, interval (`low`, `high`),
      threshold, verdict and whether it is gated; `report["failing"]`: the failing ones;
    - `json_path`, `markdown_path`, `plot_path`: the reports written under `output`;
    - `promotion_written`: whether the verdict went into the candidate's manifest.

    `gate` is a gate YAML (a path, a name in recipes/gates/, or a recipe with a `gate` section;
    None: the default gate). `lora` is a PEFT adapter (name, folder) both models run. The
    baseline's results are cached, so gating several candidates evaluates it once. Progress goes
    to stderr, nothing with `quiet`. A bad input raises `LmfoundryError`; a failing verdict is a
    result, not an exception."""
    from lmfoundry.evals.gate import run_gate

    cand, base = artifact_path(candidate), artifact_path(baseline)
    device = check_device(device)
    check_tensor_parallel(tp, device, (cand, base))
    if deterministic and (device != "cpu" or tp > 1):
        raise UserError("--deterministic runs the CPU engine in one process; drop --device / --tp")
    if not skip_verify:  # before either model is evaluated (a bundle is checked against engine.json at load)
        for spec in (cand, base):
            if Path(spec).is_dir() and not is_engine_bundle(spec):
                verify_artifact(Path(spec), "evaluate")
    return run_gate(cand, base, None if gate is None else str(gate), tier, output, tuple(tasks), tuple(include_paths),
                    use_cache=use_cache, inconclusive_exit=inconclusive_exit, write_promotion=write_promotion,
                    progress=not quiet, device=device, dtype=dtype, tp=tp, deterministic=deterministic, lora=lora)


def plan_eval_gate(candidate: ModelSpec, *, baseline: ModelSpec, gate: str | Path | None = None, tier: str = "quick",
                   device: str = "cpu", dtype: str = "auto", tp: int = 1,
                   lora: tuple[str, str] | None = None) -> MemoryPlan:
    """What `eval_gate` with these arguments will hold in memory at its peak (weights, KV cache,
    activations, logits, the process), from the models' configs and safetensors headers, without
    loading either; `.lines()` says it. Plans the CPU engine in one process without an adapter:
    other arguments raise `LmfoundryError`."""
    from lmfoundry.evals.gate import plan_gate

    device = check_device(device)
    if tp > 1 or lora is not None or device != "cpu":
        raise UserError("--dry-run plans the CPU engine in one process without --lora; drop --tp / --lora / --device")
    return plan_gate(artifact_path(candidate), artifact_path(baseline), None if gate is None else str(gate), tier,
                     device, dtype)
