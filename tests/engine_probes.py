"""Engine factories for tests that look inside a real engine process. Module-level and outside
the package, so an `EngineSpec` can name them: the engine process finds them on the caller's
sys.path."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def modules_after_build(spec: Any, path: str) -> Any:
    """Build the engine `spec` describes, as the engine process would, then write the names of
    every module the process has imported by then to `path`, one a line."""
    engine = spec.build()
    Path(path).write_text("\n".join(sorted(sys.modules)) + "\n")
    return engine
