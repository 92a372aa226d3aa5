"""Test-wide settings.

- Threads: 2-core CI machines slow down by orders of magnitude when several OpenMP pools
  oversubscribe them, so tests use OMP_NUM_THREADS (default 1).
- Triton runs kernels through its interpreter on machines without a GPU; the variable must be set
  before any kernel module is imported.
- Nothing is downloaded from a model hub.
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
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `from helpers import ...`
