"""Memory of an eval-gate run: what it will hold (`plan`, printed by `eval-gate --dry-run`) and
what it held (`Phases`, recorded per model in the report).

The gate evaluates one model at a time: the baseline is loaded, scored and freed (its heap handed
back to the system) before the candidate is loaded, and all the candidate keeps of the baseline is
its reference (top-k next-token distributions, a few MB). So the run's peak is the process's own
footprint plus the larger of the two models' evaluations, and one evaluation is:

    weights as run          stored tensors, floats at the execution dtype (W4A16/W8A16 codes stay
                            packed in bfloat16; in float32 every linear is dequantized at load)
  + KV cache                the engine's block pool (EngineConfig.kv_cache_memory_gb), allocated whole
  + step activations        one engine step of max_num_batched_tokens tokens through the widest
                            layer (MLP gate/up/act + a few hidden-size buffers), float32
  + perplexity logits       one window's float32 logits [ctx - 1, vocab] (the engine's row buffer)
                            plus two row chunks of full-vocabulary temporaries (the engine's logits
                            and log-softmax, or the scorer's log-softmax and masked copy)
  + the reference           (candidate only) windows x (ctx - 1) x (top_k x 8 + 8) bytes

The logits are the term that grows with the vocabulary: scored a batch of windows at a time and
without chunking, a 152k vocabulary made GBs of them, more than a 1.5B model's weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmfoundry.evals.gate_spec import Tier

GIB = 2**30
# safetensors dtype names of floating tensors (converted to the execution dtype at load)
FLOATS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def process_memory() -> tuple[int, int]:
    """(resident bytes now, peak resident bytes so far) of this process, from /proc (0, 0 where
    there is none)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0, 0
    values = {}
    for line in status.splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            values[name] = int(rest.split()[0]) * 1024
    return values.get("VmRSS", 0), values.get("VmHWM", 0)


@dataclass
class Phases:
    """Resident memory at the boundaries of one model's evaluation: `rss` is what is held at the
    boundary, `peak` the process's high-water mark so far, so the phase whose `peak` rose is the one
    that set it (the kernel keeps one high-water mark per process; resetting it per phase would hide
    the run's peak from `time -v` and the parent's rusage)."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    def mark(self, phase: str) -> None:
        rss, peak = process_memory()
        self.rows.append({"phase": phase, "rss_bytes": rss, "peak_bytes": peak})


@dataclass
class ModelMemory:
    """One model's evaluation, term by term (bytes; see the module doc)."""

    spec: str
    weights: int
    kv_cache: int
    activations: int
    logits: int
    reference: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.logits + self.reference


@dataclass
class MemoryPlan:
    process: int  # this process's resident bytes with torch, lm-eval and the engine imported
    models: list[ModelMemory]

    @property
    def peak(self) -> int:
        """One model at a time: the process plus the larger evaluation."""
        return self.process + max(m.total for m in self.models)

    def lines(self) -> list[str]:
        out = [f"plan: process {self.process / GIB:.2f} GiB (torch, lm-eval and the engine imported, measured now)"]
        for m in self.models:
            out.append(f"plan: {m.spec}: weights {m.weights / GIB:.2f} + KV cache {m.kv_cache / GIB:.2f} + "
                       f"step activations {m.activations / GIB:.2f} + logits {m.logits / GIB:.2f}"
                       + (f" + reference {m.reference / GIB:.3f}" if m.reference else "")
                       + f" = {m.total / GIB:.2f} GiB")
        out.append(f"plan: predicted peak resident memory {self.peak / GIB:.2f} GiB "
                   "(one model at a time: the process plus the larger evaluation)")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"process_bytes": self.process, "peak_bytes": self.peak,
                "models": [{**m.__dict__, "total": m.total} for m in self.models]}


def weight_bytes(folder: Path, config: Any, element_bytes: int, packed: bool) -> int:
    """Bytes of a checkpoint's weights as the runtime holds them: floating tensors at
    `element_bytes`, quantized codes as stored when they stay `packed`; otherwise every parameter
    dense at `element_bytes` (quantized linears are dequantized at load)."""
    from lmfoundry.checkpoint.headers import read_safetensors_header
    from lmfoundry.checkpoint.sources import safetensors_files
    from lmfoundry.model.params import param_counts

    total, quantized = 0, False
    for file in safetensors_files(folder):
        for info in read_safetensors_header(file).values():  # __metadata__ left out
            numel = 1
            for d in info["shape"]:
                numel *= d
            if info["dtype"] in FLOATS:
                total += numel * element_bytes
            else:
                quantized = True
                total += numel * SAFETENSORS_BYTES.get(info["dtype"], 4)
    if quantized and not packed:
        return param_counts(config)["total"] * element_bytes
    return total


def model_memory(spec: str, folder: Path, config: Any, tier: Tier, run_dtype: Any, device: str,
                 baseline: bool) -> ModelMemory:
    """`ModelMemory` of one model of the gate run in `run_dtype` on the CPU engine."""
    import torch

    from lmfoundry.evals.divergence import ROWS_AT_ONCE
    from lmfoundry.runtime.checkpoint_model import packs_weights
    from lmfoundry.runtime.engine.engine_config import EngineConfig, default_step_tokens

    dtype = run_dtype or torch.bfloat16
    element = torch.empty(0, dtype=dtype).element_size()
    vocab = config.vocab_size
    step = default_step_tokens(device)
    ppl = tier.perplexity
    logits = 0
    if ppl is not None:
        logits = (ppl.ctx - 1) * vocab * 4 + 2 * ROWS_AT_ONCE * vocab * 4
    # prompt logprobs of lm-eval's requests: the engine's row chunk of logits and its log-softmax
    from lmfoundry.runtime.engine.model_runner import PROMPT_LOGPROB_ROWS

    logits = max(logits, 2 * PROMPT_LOGPROB_ROWS * vocab * 4)
    activations = step * (3 * config.intermediate_size + 4 * config.hidden_size) * 4
    reference = 0
    if ppl is not None and not baseline:
        reference = ppl.windows * (ppl.ctx - 1) * (min(ppl.top_k, vocab) * 8 + 8)
    return ModelMemory(spec, weight_bytes(folder, config, element, packs_weights(dtype)),
                       int(EngineConfig.kv_cache_memory_gb * GIB), activations, logits, reference)


def imported_process_bytes() -> int:
    """This process's resident bytes once what an evaluation imports is imported (what every
    evaluation starts from; measured, as it depends on the installed libraries)."""
    import lm_eval.evaluator  # noqa: F401
    import torch  # noqa: F401

    import lmfoundry.runtime.engine.llm_engine  # noqa: F401

    return process_memory()[0]
