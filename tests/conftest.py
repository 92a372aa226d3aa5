"""Test-wide settings.

- Threads: 2-core CI machines slow down by orders of magnitude when several OpenMP pools
  oversubscribe them, so tests use OMP_NUM_THREADS (default 1).
- Triton runs kernels through its interpreter on machines without a GPU; the variable must be set
  before any kernel module is imported.
- Nothing is downloaded from a model hub.
- The CPU path: `LMFOUNDRY_CPU_ISA` (see `lmfoundry.runtime.cpu.isa`) is applied before torch runs
  anything, and the run's first line says which path it took (`cpu: amx|avx512|avx2`), so that a
  red run on another CPU reads as one.
- Quantized CPU linears run one product at every row count (no timed crossover).
- Imports never come from the checkout's root: `python -m pytest` puts the working directory first
  on sys.path, where the bare `lmfoundry/` folder (no stage subpackages) and `kernels/` (which
  shadows Hugging Face's `kernels`, imported by transformers) would win over the installed
  packages. The root is dropped from this process's path before anything imports them, and
  PYTHONSAFEPATH=1 keeps it off the path of every Python process a test starts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
os.environ["PYTHONSAFEPATH"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
# quantized linears: the C product at every row count, not a crossover timed on whatever the test
# machine is doing (tests/runtime/cpu/test_crossover.py covers the measured one)
os.environ.setdefault("LMFOUNDRY_CPU_DENSE_ROWS", "never")
# and the one-pass SiLU(gate) * up from the fixed default size, for the same reason
os.environ.setdefault("LMFOUNDRY_CPU_SILU_FROM", "8192")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from lmfoundry.errors import UserError  # noqa: E402
from lmfoundry.runtime.cpu.isa import apply as apply_cpu_isa  # noqa: E402

try:
    apply_cpu_isa()
    _isa_refused: str | None = None
except UserError as exc:  # said as a usage error once pytest can (pytest_configure)
    _isa_refused = str(exc)
try:
    import torch  # noqa: E402

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Triton 3.7's interpreter converts bf16/fp8 and computes bf16 dots wrongly (triton#11584);
    # patch it once for every suite that runs kernels.
    from lmfoundry.kernels.interpreter import patch_interpreter  # noqa: E402

    patch_interpreter()
if "torch" in globals():
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `from helpers import ...`


def _real_package_first() -> None:
    """A process spawned by a test (multiprocessing: tensor-parallel ranks, collectives) starts with
    this path, on which tests/lmfoundry/ (the tests of lmfoundry/, no __init__.py) is a namespace
    package `lmfoundry`. An editable install is found by its meta-path finder only after every path
    entry, so in such a child the namespace package would win and `lmfoundry.model` would be the
    tests' folder. A path entry holding only a link to the package this process imported comes first."""
    import atexit
    import shutil
    import tempfile

    import lmfoundry

    entry = Path(tempfile.mkdtemp(prefix="lmfoundry-test-path-"))
    atexit.register(shutil.rmtree, entry, True)
    (entry / "lmfoundry").symlink_to(Path(lmfoundry.__file__).resolve().parent, target_is_directory=True)
    sys.path.insert(0, str(entry))


_real_package_first()


def pytest_configure(config) -> None:
    if _isa_refused is not None:
        raise pytest.UsageError(_isa_refused)


def cpu_line() -> str:
    from lmfoundry.runtime.cpu.features import describe, machine

    return f"{describe()}; {machine()}"


def pytest_report_header(config) -> str:
    return cpu_line()


def pytest_sessionstart(session) -> None:
    """`-q` (make test) hides the header: the CPU line is written anyway."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and session.config.get_verbosity() < 0:
        reporter.write_line(cpu_line())
