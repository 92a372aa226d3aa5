"""The kernels of an engine bundle for the runtime: `load_engine(path, device) -> KernelSet`.

What runs, by device:
  - a GPU whose arch and driver match the bundle: the shipped cubins, launched through the CUDA
    driver (`cuda_driver.py`) with the recorded metadata — no Triton compile, no Triton version
    dependency; a call whose shape no shipped kernel covers (or that breaks an alignment the build
    assumed) falls back to Triton JIT for that call and says so once;
  - a GPU that does not match (other arch, older driver): one log line, then Triton JIT with the
    per-arch tile tables (`kernels/tiles.py`);
  - CPU: the PyTorch reference of every kernel (or Triton's interpreter).
Every kernel file's sha256 is checked against engine.json first (`engine_manifest.verify`); a
mismatch refuses the bundle.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from lmfoundry.engine_bundle.engine_manifest import read_manifest, verify
from lmfoundry.errors import UserError
from lmfoundry.kernels import registry, tiles
from lmfoundry.kernels.dispatch import JitLauncher, Launcher, ReferenceLauncher
from lmfoundry.kernels.spec import DIVISIBILITY, KernelCall, TileConfig, Variant, compile_grid_rule

log = logging.getLogger("lmfoundry.engine")


@dataclass(frozen=True)
class DeviceInfo:
    """What decides cubin vs JIT: compute capability (e.g. 90) and driver CUDA version (12080)."""

    capability: int
    driver_version: int
    name: str = ""


def probe_device(device: torch.device) -> DeviceInfo:
    from lmfoundry.runtime.cuda_driver import CudaError, driver

    major, minor = torch.cuda.get_device_capability(device)
    try:
        version = driver().version()
    except CudaError:
        version = 0
    return DeviceInfo(major * 10 + minor, version, torch.cuda.get_device_name(device))


def _cuda_version_int(text: str | None) -> int:
    if not text:
        return 0
    major, minor = (int(x) for x in text.split(".")[:2])
    return major * 1000 + minor * 10


def match_arch(manifest: dict[str, Any], info: DeviceInfo) -> tuple[int | None, str]:
    """(bundle capability to use, reason) — None with the reason when nothing in the bundle fits."""
    built = {v["capability"]: v["sm"] for v in manifest["archs"].values()}
    dev_sm = f"sm_{info.capability}"
    names = ", ".join(sorted(built.values()))
    if info.capability in built:
        cap = info.capability
    else:
        # sm_8x cubins run on later minors of the same major; sm_90a is arch-specific.
        same_major = [c for c in built if c // 10 == info.capability // 10 and c < info.capability and c != 90]
        if not same_major:
            return None, f"engine built for {names} but this GPU is {dev_sm}{f' ({info.name})' if info.name else ''}"
        cap = max(same_major)
    need = _cuda_version_int(manifest["toolchain"].get("cuda"))
    if info.driver_version < need:
        have = f"{info.driver_version // 1000}.{info.driver_version % 1000 // 10}" if info.driver_version else "none"
        return None, (f"engine cubins come from ptxas {manifest['toolchain'].get('ptxas')} (CUDA "
                      f"{manifest['toolchain'].get('cuda')}) but the driver supports CUDA {have}")
    return cap, f"{built[cap]} cubins on {dev_sm}"


def current_stream(device: torch.device) -> int:
    """The CUDA stream handle torch is using on `device` (kernels are ordered with torch's work)."""
    return torch.cuda.current_stream(device).cuda_stream


def divisibility(param: dict[str, Any]) -> int:
    """What the cubin assumed of a parameter, as its kernel JSON records it (bytes for a pointer):
    `divisibility`, or for bundles that only flag it, the one value builds have used."""
    if "divisibility" in param:
        return int(param["divisibility"])
    return DIVISIBILITY if param["assume_multiple_of_16"] else 1


class ShippedKernel:
    """One cubin with its launch metadata; loaded into the driver on first use."""

    def __init__(self, engine: Path, entry: dict[str, Any], device_index: int) -> None:
        self.entry = entry
        self.meta = json.loads((engine / entry["files"]["json"]).read_text())
        self.cubin_path = engine / entry["files"]["cubin"]
        self.device_index = device_index
        self.config = TileConfig.from_dict(self.meta["config"])
        self.function: int | None = None
        self.covers = entry["covers"]
        self.unusable = ""  # set when the driver refused the cubin (e.g. too much shared memory)
        # Launch arguments prepared once: grid rules compiled, parameter kinds resolved, constexprs
        # and scratch sizes read; a launch only fills in values.
        self.grid_rules = [compile_grid_rule(rule) for rule in self.meta["grid"]]
        self.params = [(p["name"], p["ctype"]) for p in self.meta["params"]]
        self.constexprs = dict(self.config.constexprs)
        self.block = 32 * self.meta["num_warps"]
        self.scratch = [(self.meta[f"{kind}_scratch_size"], self.meta[f"{kind}_scratch_align"])
                        for kind in ("global", "profile")[: self.meta["scratch_params"]]]

    def check_device(self, call: KernelCall) -> None:
        """Every tensor must live on this set's GPU: a host pointer would fault the kernel."""
        for name, v in call.args.items():
            if isinstance(v, torch.Tensor) and not (v.is_cuda and v.device.index == self.device_index):
                raise ValueError(f"{call.kernel.name}: {name} is on {v.device}, the engine runs on cuda:{self.device_index}")

    def covers_call(self, call: KernelCall) -> bool:
        rows = call.shape.get(call.kernel.rows, 1) if call.kernel.rows else 1
        for cover in self.covers:
            lo, hi = cover["rows"]
            if lo <= rows <= hi and all(call.shape.get(k) == v for k, v in cover["shape"].items()):
                return True
        return False

    def assumptions_hold(self, call: KernelCall) -> str | None:
        """None when this cubin can take the call (launch features we drive, every divisibility
        the build assumed), else the reason."""
        if self.meta["num_ctas"] != 1 or self.meta["launch_cooperative_grid"] or self.meta["launch_pdl"]:
            return "cluster/cooperative/PDL launches are not supported by the driver launcher"
        if self.unusable:
            return self.unusable
        for p in self.meta["params"]:
            divisor = divisibility(p)
            if divisor == 1:
                continue
            value = call.args[p["name"]]
            v = value.data_ptr() if p["ctype"] == "ptr" else int(value)
            if v % divisor:
                return f"{p['name']}={'0x%x' % v if p['ctype'] == 'ptr' else v} is not a multiple of {divisor}"
        return None

    def load(self) -> None:
        """Load the cubin into the driver once; on refusal remember why (the caller falls back)."""
        from lmfoundry.runtime.cuda_driver import CudaError, driver

        if self.function is not None or self.unusable:
            return
        drv = driver()
        try:
            drv.ensure_context(self.device_index)
            _, self.function = drv.load_function(self.cubin_path.read_bytes(), self.meta["entry"], self.meta["shared"])
        except CudaError as exc:
            self.unusable = f"the driver refused {self.cubin_path.name}: {exc}"

    def launch(self, call: KernelCall) -> None:
        from lmfoundry.runtime.cuda_driver import driver

        names: dict[str, Any] = {k: v for k, v in call.args.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        names.update(call.shape)
        names.update(call.semantics)
        names.update(self.constexprs)
        grid = [rule(names) for rule in self.grid_rules]
        if grid[0] * grid[1] * grid[2] == 0:
            return
        args: list[tuple[str, Any]] = []
        for name, ctype in self.params:
            v = call.args[name]
            args.append(("ptr", v.data_ptr()) if ctype == "ptr" else (ctype, float(v) if ctype == "f32" else int(v)))
        device = torch.device("cuda", self.device_index)
        scratch = []
        for size, align in self.scratch:
            if size > 0:
                buf = torch.empty(grid[0] * grid[1] * grid[2] * self.meta["num_ctas"] * size + align,
                                  dtype=torch.uint8, device=device)
                scratch.append(buf)
                args.append(("ptr", (buf.data_ptr() + align - 1) // align * align))
            else:
                args.append(("ptr", 0))
        stream = current_stream(device)
        assert self.function is not None, "load() first"
        driver().launch(self.function, grid, self.block, self.meta["shared"], stream, args)


class CubinLauncher:
    """Runs calls on shipped cubins; anything they do not cover goes to `fallback` (logged once)."""

    name = "cubin"

    def __init__(self, engine: Path, entries: list[dict[str, Any]], device_index: int, fallback: Launcher) -> None:
        self.fallback = fallback
        self.index: dict[Variant, list[ShippedKernel]] = {}
        for entry in entries:
            variant = Variant.from_dict({"kernel": entry["kernel"], "types": entry["types"], "semantics": entry["semantics"]})
            self.index.setdefault(variant, []).append(ShippedKernel(engine, entry, device_index))
        self.stats: Counter = Counter()
        self._warned: set[tuple] = set()

    def find(self, call: KernelCall) -> ShippedKernel | None:
        for k in self.index.get(call.variant(), []):
            if k.covers_call(call):
                return k
        return None

    def run(self, call: KernelCall) -> None:
        kernel = self.find(call)
        if kernel is not None:
            kernel.check_device(call)
            kernel.load()
        reason = "no shipped kernel covers this call" if kernel is None else kernel.assumptions_hold(call)
        if reason is None:
            assert kernel is not None  # a missing kernel has a reason
            kernel.launch(call)
            self.stats["cubin"] += 1
            return
        key = (call.variant(), reason)
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s %s: %s; using Triton JIT", call.kernel.name,
                        {k: v for k, v in call.shape.items()}, reason)
        self.stats["jit"] += 1
        self.fallback.run(call)


class CountingLauncher:
    """Wraps an launcher to count calls (JIT and reference modes report the same stats)."""

    def __init__(self, inner: Launcher, label: str) -> None:
        self.inner, self.label = inner, label
        self.stats: Counter = Counter()

    def run(self, call: KernelCall) -> None:
        self.stats[self.label] += 1
        self.inner.run(call)


class KernelSet:
    """The kernels of one engine on one device. Ops are the `lmfoundry.kernels` op functions bound
    to this set's launcher: `ks.w4a16_linear(x, w)`, `ks.paged_decode(q, cache, table, lens)`, ..."""

    OPS = tuple(registry.OPS)

    def __init__(self, mode: str, launcher: Any, manifest: dict[str, Any], path: Path, reason: str = "") -> None:
        self.mode = mode  # "cubin" | "jit" | "interpret" | "reference"
        self.launcher = launcher
        self.manifest = manifest
        self.path = path
        self.reason = reason

    @property
    def stats(self) -> dict[str, int]:
        """Calls run per path: {"cubin": n, "jit": n} or {"reference": n}."""
        return dict(self.launcher.stats)

    @property
    def fusions(self) -> list[dict[str, Any]]:
        return [f for f in self.manifest["fusions"] if f["applied"]]

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name in registry.OPS:
            return functools.partial(registry.OPS[name], launcher=self.launcher)
        raise AttributeError(name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.OPS))


def load_engine(path: str | Path, device: str | torch.device = "cuda", *, device_info: DeviceInfo | None = None,
                interpret: bool | None = None) -> KernelSet:
    """Verify and load the bundle at `path` for `device` (see the module docstring for the paths).

    `device_info` overrides what is probed from the GPU (tests use it to pretend another arch).
    On CPU, `interpret` runs the Triton kernels through Triton's interpreter instead of their
    PyTorch references (default: when TRITON_INTERPRET=1 is set).
    """
    engine = Path(path)
    manifest = read_manifest(engine)
    verify(engine, manifest)
    device = torch.device(device)
    if device.type == "cpu":
        from lmfoundry.kernels.dispatch import is_interpreter

        if interpret if interpret is not None else is_interpreter():
            return KernelSet("interpret", CountingLauncher(JitLauncher(), "interpret"), manifest, engine,
                             "CPU: Triton interpreter")
        return KernelSet("reference", CountingLauncher(ReferenceLauncher(), "reference"), manifest, engine,
                         "CPU: PyTorch reference kernels")
    if device.type != "cuda":
        raise UserError(f"engine kernels run on cuda or cpu, not {device.type}")
    if device_info is None and not torch.cuda.is_available():
        raise UserError(f"{engine}: {device} requested but this machine has no CUDA GPU; load with device='cpu' "
                        "for the PyTorch reference kernels")
    info = device_info or probe_device(device)
    jit = JitLauncher(pick_config=lambda call: tiles.pick(info.capability, call))
    cap, reason = match_arch(manifest, info)
    if cap is None:
        log.warning("%s: %s; falling back to Triton JIT", engine, reason)
        return KernelSet("jit", CountingLauncher(jit, "jit"), manifest, engine, reason)
    entries = [e for e in manifest["kernels"] if e["capability"] == cap]
    index = device.index if device.index is not None else torch.cuda.current_device()
    return KernelSet("cubin", CubinLauncher(engine, entries, index, jit), manifest, engine, reason)
