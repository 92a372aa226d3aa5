"""`lmfoundry compile`: cross-compile a checkpoint's kernels per GPU architecture, without a GPU.

checkpoint (schemes, shapes) -> kernel selection (specializations, fusions, per-arch tiles) -> worker processes
(Triton AOT, SASS checks) -> bundle (engine.json, kernels/<sm>/, weights/) -> loader (cubins through
the CUDA driver, Triton JIT on a mismatch, PyTorch reference on CPU).

This package is also the API call `lmfoundry.compile(checkpoint, arch=..., output=...)`
(`lmfoundry.api.artifact_builds.compile`). Python binds a subpackage as an attribute of its parent when it
is imported, so after any `import lmfoundry.compile.bundle` the name `lmfoundry.compile` is this
module, whatever `lmfoundry` defined under that name before; a function there would silently
become a module that cannot be called. Making the module itself callable (its class swapped for
a `ModuleType` subclass with `__call__`) gives the name one meaning in every import order. The
call imports the API when it runs, so importing a compile submodule costs nothing more.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, checkpoint: Any, **options: Any) -> Any:
        """`lmfoundry.api.artifact_builds.compile`: compile `checkpoint` into an engine bundle."""
        from lmfoundry.api.artifact_builds import compile as compile_bundle

        return compile_bundle(checkpoint, **options)


sys.modules[__name__].__class__ = _CallablePackage
