"""lmfoundry: quantize, compile, serve and quality-gate open-weights LLMs.

The Python API (docs/python.md), the same code paths the CLI verbs run:

    import lmfoundry

    ckpt = lmfoundry.quantize("smollm2-135m", method="rtn", scheme="w4a16", group_size=64, output="out/")
    result = lmfoundry.eval_gate(ckpt, baseline="smollm2-135m")
    bundle = lmfoundry.compile(ckpt, arch="hopper", output="engine/")
    with lmfoundry.LLM(ckpt) as llm:
        outs = llm.generate(["Hello"], lmfoundry.SamplingParams(max_tokens=16, temperature=0))

Every name is imported on first use (module `__getattr__`), so `import lmfoundry` costs nothing:
no torch, no stage, and a process that only reads `__version__` stays small. The stages live in
subpackages (`lmfoundry.quantizers`, `.calibration`, `.compile`, `.kernels`, `.runtime`, `.evals`)
that map to the repository's top-level folders; this package holds the CLI and what every stage
shares (model resolution, the manifest, recipes, errors).

`lmfoundry.compile` is both the subpackage of the compile stage and the API call: the package is
callable (compile/__init__.py says why), so the name means the same thing whichever was imported
first.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it; `compile` is the (callable) subpackage itself
_EXPORTS = {
    "LLM": "lmfoundry.api.llm", "Bundle": "lmfoundry.api.artifacts", "Checkpoint": "lmfoundry.api.artifacts",
    "inspect": "lmfoundry.api.artifacts", "quantize": "lmfoundry.api.artifact_builds", "eval_gate": "lmfoundry.api.gating",
    "SamplingParams": "lmfoundry.runtime.engine.sampling_params",
    "RequestOutput": "lmfoundry.runtime.engine.outputs", "CompletionOutput": "lmfoundry.runtime.engine.outputs",
    "TokenLogprob": "lmfoundry.runtime.engine.outputs",
    "GateResult": "lmfoundry.evals.gate", "Recipe": "lmfoundry.recipe", "LmfoundryError": "lmfoundry.errors",
}
__all__ = ["LLM", "Bundle", "Checkpoint", "CompletionOutput", "GateResult", "LmfoundryError", "Recipe",
           "RequestOutput", "SamplingParams", "TokenLogprob", "compile", "eval_gate", "inspect", "quantize"]


def __getattr__(name: str) -> Any:
    import importlib

    if name == "compile":  # the compile stage's package, callable as the API's compile()
        return importlib.import_module("lmfoundry.compile")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lmfoundry' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once: later reads are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
