"""The public Python API, re-exported as `lmfoundry.<name>` (docs/python.md).

Each call is what the CLI verb of the same name runs (`lmfoundry quantize` calls `quantize`, and
so on): the commands only parse flags and print. Importing this package imports no torch; each
call imports the stages it drives when it runs.
"""

from lmfoundry.api.artifact_builds import build_recipe, compile, quantize
from lmfoundry.api.artifacts import Bundle, Checkpoint, inspect
from lmfoundry.api.gating import eval_gate
from lmfoundry.api.llm import LLM
from lmfoundry.errors import LmfoundryError
from lmfoundry.recipe import Recipe
from lmfoundry.runtime.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from lmfoundry.runtime.engine.sampling_params import SamplingParams

__all__ = ["LLM", "Bundle", "Checkpoint", "CompletionOutput", "LmfoundryError", "Recipe", "RequestOutput",
           "SamplingParams", "TokenLogprob", "build_recipe", "compile", "eval_gate", "inspect", "quantize"]
