"""The command line, environment and import path of the Python processes lmfoundry starts (compile
workers, the engine core; tensor-parallel ranks are spawned with the engine core's path).

`python -m M` and `python -c CODE` put the working directory first on sys.path. Started from a
source checkout's root, two of its folders would then be imported instead of installed packages:
`lmfoundry/`, which holds only the CLI and the shared modules (`lmfoundry.compile` and the other
stages are top-level folders that only an install maps in), and `kernels/`, which shadows Hugging
Face's `kernels` package that transformers imports. So a child of lmfoundry never has the working
directory on its path, whatever directory it was started from: `-P` on its command line,
PYTHONSAFEPATH=1 in its environment (its own children inherit that), and a parent's sys.path handed
to it (`importable_path`) loses every checkout root.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path


def python_command(module: str, *args: str) -> list[str]:
    """argv of `python -m module args` that never imports from the working directory."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module, *args]
    # Python 3.10 has no -P: run the module through runpy once -c's '' entry is dropped.
    code = ("import runpy, sys; sys.path[:] = [p for p in sys.path if p]; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", code, *args]


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) with PYTHONSAFEPATH=1, so that no Python
    process started under it, by lmfoundry or by a library, puts its working directory on sys.path."""
    out = dict(os.environ if env is None else env)
    out["PYTHONSAFEPATH"] = "1"
    return out


def is_checkout_root(entry: str) -> bool:
    """A source tree of lmfoundry (pyproject.toml beside the bare `lmfoundry/` and `kernels/`)."""
    root = Path(entry or ".")
    return all((root / f).is_file() for f in ("pyproject.toml", "lmfoundry/__init__.py", "kernels/__init__.py"))


def importable_path(entries: Iterable[str]) -> list[str]:
    """A parent's sys.path for a child to extend its own with: '' made absolute (the child may
    start elsewhere), checkout roots dropped."""
    out: list[str] = []
    for entry in entries:
        entry = entry or os.getcwd()
        if not is_checkout_root(entry) and entry not in out:
            out.append(entry)
    return out
