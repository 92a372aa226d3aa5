"""Load an engine bundle for the runtime: `load_engine(path, device) -> KernelSet`.

What runs, by device:
  - a GPU whose arch and driver match the bundle: the shipped cubins, launched through the CUDA
    driver (`cuda_driver.py`) with the recorded metadata — no Triton compile, no Triton version
    dependency; a call whose shape no shipped kernel covers (or that breaks an alignment the build
    assumed) falls back to Triton JIT for that call and says so once;
  - a GPU that does not match (other arch, older driver): one log line, then Triton JIT with the
    per-arch tile tables;
  - CPU: the PyTorch reference of every kernel.
Every kernel file's sha256 is checked against engine.json first; a mismatch refuses the bundle.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from lmfoundry.errors import UserError
from lmfoundry.kernels.dispatch import Executor, JitExecutor, ReferenceExecutor
from lmfoundry.kernels.spec import KernelCall, TileConfig, Variant, compile_grid_rule

log = logging.getLogger("lmfoundry.engine")


class EngineIntegrityError(UserError):
    """A bundle file does not match the hash recorded at build time."""

    exit_code = 4


@dataclass(frozen=True)
class DeviceInfo:
    """What decides cubin vs JIT: compute capability (e.g. 90) and driver CUDA version (12080)."""

    capability: int
    driver_version: int
    name: str = ""


def probe_device(device: torch.device) -> DeviceInfo:
    from lmfoundry.compile.cuda_driver import CudaError, driver

    major, minor = torch.cuda.get_device_capability(device)
    try:
        version = driver().version()
    except CudaError:
        version = 0
    return DeviceInfo(major * 10 + minor, version, torch.cuda.get_device_name(device))


ENGINE_JSON_MAX_BYTES = 64 << 20  # a real engine.json is a few hundred KiB
_KIND_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", bool: "true or false"}


def _malformed(manifest_path: Path, why: str) -> UserError:
    return UserError(f"{manifest_path}: malformed engine.json: {why}")


def _field(obj: dict[str, Any], key: str, kind: type, where: str, manifest_path: Path) -> Any:
    """obj[key], refused unless present and of `kind` (JSON true is not an integer here)."""
    if key not in obj:
        raise _malformed(manifest_path, f"{where} has no {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise _malformed(manifest_path, f"{where}.{key} must be {_KIND_NAMES[kind]}, got {type(value).__name__}")
    return value


def check_manifest(manifest: Any, manifest_path: Path) -> dict[str, Any]:
    """`manifest` if it has every key, with the types, that the loader and the runtime read from
    engine.json. A hand-edited, truncated or foreign engine.json would otherwise surface as a
    KeyError or TypeError deep inside loading; this makes it one line naming the bad field. Paths
    are only checked lexically here (plain names under weights/); `verify` resolves kernel files."""
    if not isinstance(manifest, dict):
        raise _malformed(manifest_path, f"the top level must be an object, got {type(manifest).__name__}")
    if manifest.get("format") != "lmfoundry-engine/1":
        raise UserError(f"{manifest_path}: unknown engine format {manifest.get('format')!r}")
    f = functools.partial(_field, manifest_path=manifest_path)
    model = f(manifest, "model", dict, "engine.json")
    if f(model, "dtype", str, "model") not in ("float16", "bfloat16"):
        raise _malformed(manifest_path, f"model.dtype {model['dtype']!r} is not float16 or bfloat16")
    kv = f(manifest, "kv_cache", dict, "engine.json")
    f(kv, "dtype", str, "kv_cache")
    if f(kv, "block_size", int, "kv_cache") <= 0:
        raise _malformed(manifest_path, "kv_cache.block_size must be positive")
    archs = f(manifest, "archs", dict, "engine.json")
    if manifest.get("target") == "cpu":  # `compile --arch cpu`: a compiled step, no cubins
        cpu = f(manifest, "cpu", dict, "engine.json")
        f(cpu, "isa", str, "cpu")
        f(cpu, "torch", str, "cpu")
        if f(cpu, "max_tokens", int, "cpu") < 1:
            raise _malformed(manifest_path, "cpu.max_tokens must be positive")
        step = f(cpu, "step", dict, "cpu")
        f(step, "path", str, "cpu.step")
        f(step, "sha256", str, "cpu.step")
    elif not archs:
        raise _malformed(manifest_path, "archs is empty")
    for name in archs:
        arch = f(archs, name, dict, "archs")
        f(arch, "capability", int, f"archs.{name}")
        f(arch, "sm", str, f"archs.{name}")
    cuda = f(manifest, "toolchain", dict, "engine.json").get("cuda")
    if cuda is not None and not (isinstance(cuda, str) and re.fullmatch(r"\d+\.\d+(\.\d+)*", cuda)):
        raise _malformed(manifest_path, f"toolchain.cuda must be a version like \"12.8\", got {cuda!r}")
    for i, fusion in enumerate(f(manifest, "fusions", list, "engine.json")):
        if not isinstance(fusion, dict):
            raise _malformed(manifest_path, f"fusions[{i}] must be an object")
        for key, kind in (("name", str), ("kind", str), ("members", list), ("applied", bool)):
            f(fusion, key, kind, f"fusions[{i}]")
    weights = f(manifest, "weights", dict, "engine.json")
    for name in f(weights, "files", dict, "weights"):
        if name in ("", ".", "..") or "/" in name or "\\" in name or "\x00" in name:
            raise UserError(f"{manifest_path}: weights file {name!r} is not a plain file name inside weights/; "
                            "refusing the bundle")
        f(weights["files"], name, dict, "weights.files")
    for i, entry in enumerate(f(manifest, "kernels", list, "engine.json")):
        where = f"kernels[{i}]"
        if not isinstance(entry, dict):
            raise _malformed(manifest_path, f"{where} must be an object")
        for key, kind in (("key", str), ("kernel", str), ("sm", str), ("capability", int), ("types", dict),
                          ("semantics", dict), ("covers", list), ("files", dict), ("sha256", dict)):
            f(entry, key, kind, where)
        for ext in ("cubin", "json"):
            if ext not in entry["files"]:
                raise _malformed(manifest_path, f"{where}.files has no {ext!r}")
        for ext in entry["files"]:
            f(entry["files"], ext, str, f"{where}.files")
            f(entry["sha256"], ext, str, f"{where}.sha256")
    return manifest


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The bundle's engine.json, parsed and checked by `check_manifest`: every way it can be wrong
    (missing, not a regular file, not JSON, not an object, missing keys, wrong types) is one
    `UserError` line, never a traceback."""
    from lmfoundry.manifest import contained_file

    engine = Path(path)
    manifest_path = engine / "engine.json"
    if not os.path.lexists(manifest_path):
        raise UserError(f"{engine}: no engine.json (not an engine bundle; build one with `lmfoundry compile`)")
    try:
        st = os.stat(contained_file(engine, manifest_path.name))  # inside the bundle, a regular file
    except UserError as exc:
        raise UserError(f"{engine}: {exc}") from None
    if st.st_size > ENGINE_JSON_MAX_BYTES:
        raise _malformed(manifest_path, f"{st.st_size} bytes, larger than any engine.json lmfoundry writes")
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _malformed(manifest_path, f"not valid JSON ({exc})") from None
    except OSError as exc:
        raise UserError(f"{manifest_path}: cannot read it ({exc.strerror})") from None
    return check_manifest(manifest, manifest_path)


def _kernel_file(engine: Path, rel: str) -> Path:
    """engine/rel for a kernel file named by engine.json: inside the bundle after resolving
    symlinks, present, and a regular file — else the bundle is refused (EngineIntegrityError)."""
    from lmfoundry.manifest import contained_file

    try:
        return contained_file(engine, rel)
    except UserError as exc:
        raise EngineIntegrityError(f"{engine}: kernel file {exc}; refusing to load the bundle") from None


def verify(path: str | Path, manifest: dict[str, Any]) -> None:
    """Raise EngineIntegrityError unless every kernel file is a regular file inside the bundle
    (no `..`, absolute path or symlink out: engine.json may come with an untrusted download) and
    hashes to its recorded sha256."""
    engine = Path(path)
    for entry in manifest["kernels"]:
        for ext, rel in entry["files"].items():
            f = _kernel_file(engine, rel)
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            if digest != entry["sha256"][ext]:
                raise EngineIntegrityError(
                    f"{rel}: sha256 {digest[:16]}… does not match engine.json ({entry['sha256'][ext][:16]}…); "
                    "the bundle was modified or corrupted — refusing to load it"
                )


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
            if not p["assume_multiple_of_16"]:
                continue
            value = call.args[p["name"]]
            v = value.data_ptr() if p["ctype"] == "ptr" else int(value)
            if v % 16:
                return f"{p['name']}={'0x%x' % v if p['ctype'] == 'ptr' else v} is not a multiple of 16"
        return None

    def load(self) -> None:
        """Load the cubin into the driver once; on refusal remember why (the caller falls back)."""
        from lmfoundry.compile.cuda_driver import CudaError, driver

        if self.function is not None or self.unusable:
            return
        drv = driver()
        try:
            drv.ensure_context(self.device_index)
            _, self.function = drv.load_function(self.cubin_path.read_bytes(), self.meta["entry"], self.meta["shared"])
        except CudaError as exc:
            self.unusable = f"the driver refused {self.cubin_path.name}: {exc}"

    def launch(self, call: KernelCall) -> None:
        from lmfoundry.compile.cuda_driver import driver

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
        driver().launch(self.function, grid, self.block, self.meta["shared"], stream, args)


class CubinExecutor:
    """Runs calls on shipped cubins; anything they do not cover goes to `fallback` (logged once)."""

    name = "cubin"

    def __init__(self, engine: Path, entries: list[dict[str, Any]], device_index: int, fallback: Executor) -> None:
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


class CountingExecutor:
    """Wraps an executor to count calls (JIT and reference modes report the same stats)."""

    def __init__(self, inner: Executor, label: str) -> None:
        self.inner, self.label = inner, label
        self.stats: Counter = Counter()

    def run(self, call: KernelCall) -> None:
        self.stats[self.label] += 1
        self.inner.run(call)


def _ops() -> dict[str, Callable[..., Any]]:
    from lmfoundry.kernels import (
        activation,
        fp8,
        kv_cache,
        norm_quant,
        paged_attention,
        rotary,
        w4a16,
        w4a16_tiled,
        w8a8,
    )

    return {
        "w4a16_linear": w4a16.w4a16_linear,
        "w4a16_tiled_linear": w4a16_tiled.w4a16_tiled_linear,
        "w8a8_gemm": w8a8.w8a8_gemm,
        "w8a8_linear": w8a8.w8a8_linear,
        "fp8_gemm": fp8.fp8_gemm,
        "fp8_linear": fp8.fp8_linear,
        "rmsnorm_quant": norm_quant.rmsnorm_quant,
        "silu_mul": activation.silu_mul,
        "apply_rotary": rotary.apply_rotary,
        "store_kv": kv_cache.store_kv,
        "paged_prefill": paged_attention.paged_prefill,
        "paged_decode": paged_attention.paged_decode,
    }


class KernelSet:
    """The kernels of one engine on one device. Ops are the `lmfoundry.kernels` op functions bound
    to this set's executor: `ks.w4a16_linear(x, w)`, `ks.paged_decode(q, cache, table, lens)`, ..."""

    OPS = tuple(_ops())

    def __init__(self, mode: str, executor: Any, manifest: dict[str, Any], path: Path, reason: str = "") -> None:
        self.mode = mode  # "cubin" | "jit" | "interpret" | "reference"
        self.executor = executor
        self.manifest = manifest
        self.path = path
        self.reason = reason

    @property
    def stats(self) -> dict[str, int]:
        """Calls run per path: {"cubin": n, "jit": n} or {"reference": n}."""
        return dict(self.executor.stats)

    @property
    def fusions(self) -> list[dict[str, Any]]:
        return [f for f in self.manifest["fusions"] if f["applied"]]

    def __getattr__(self, name: str) -> Callable[..., Any]:
        ops = _ops()
        if name in ops:
            return functools.partial(ops[name], executor=self.executor)
        raise AttributeError(name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.OPS))


def bundle_problems(path: str | Path, manifest: dict[str, Any]) -> list[str]:
    """Every way the bundle's files differ from engine.json (empty: verified), for `inspect`:
    each kernel file, each weights file (listed, present, hash, nothing unlisted) and an
    `--arch cpu` bundle's compiled step. The loaders stop at the first of these."""
    from lmfoundry.compile.bundle import sha256_file
    from lmfoundry.manifest import contained_file

    engine = Path(path)
    problems = []
    files = [(rel, digest) for e in manifest["kernels"] for ext, rel in e["files"].items()
             for digest in [e["sha256"].get(ext)]]
    step = manifest.get("cpu", {}).get("step")
    if isinstance(step, dict):
        files.append((step["path"], step["sha256"]))
    listed = manifest["weights"]["files"]
    files += [(f"weights/{name}", entry.get("sha256")) for name, entry in sorted(listed.items())]
    for rel, digest in files:
        try:
            f = contained_file(engine, rel)
        except UserError as exc:
            problems.append(str(exc))
            continue
        if digest is None or sha256_file(f) != digest:
            problems.append(f"{rel}: sha256 mismatch" if digest else f"{rel}: no sha256 recorded")
    weights = engine / "weights"
    if weights.is_dir():
        problems += [f"weights/{p.name}: not listed in engine.json" for p in sorted(weights.iterdir())
                     if p.name not in listed]
    else:
        problems.append("weights/: missing")
    return problems


def verify_weights(path: str | Path, manifest: dict[str, Any]) -> None:
    """Raise EngineIntegrityError unless the bundle's weights folder holds exactly the files
    engine.json lists, each hashing to its recorded sha256 (config.json included). A file that
    is not listed is refused too: the loader would otherwise read a planted shard."""
    from lmfoundry.compile.bundle import sha256_file

    engine = Path(path)
    folder = engine / "weights"
    listed = manifest.get("weights", {}).get("files", {})
    if not folder.is_dir():
        raise EngineIntegrityError(f"{engine}: no weights/ folder in the engine bundle")
    linked = sorted(n for n, e in listed.items() if "link" in e)
    if linked:
        raise UserError(f"{engine}: built with --weights link (weights/{linked[0]} points into "
                        f"{Path(listed[linked[0]]['link']).parent}); the runtime serves self-contained bundles: "
                        "rebuild with `lmfoundry compile ... --weights repack` (the default) or `--weights copy`")
    present = {p.name for p in folder.iterdir()}
    extra = sorted(present - set(listed))
    if extra:
        raise EngineIntegrityError(f"{folder / extra[0]}: not listed in engine.json; refusing to load the bundle")
    for name, entry in sorted(listed.items()):
        f = folder / name
        if not f.is_file():
            raise EngineIntegrityError(f"{f}: missing from the engine bundle")
        if "sha256" not in entry:
            raise EngineIntegrityError(f"{f}: engine.json records no sha256 for it (a bundle from an older "
                                       "lmfoundry); rebuild it with `lmfoundry compile`")
        digest = sha256_file(f)
        if digest != entry["sha256"]:
            raise EngineIntegrityError(
                f"weights/{name}: sha256 {digest[:16]}… does not match engine.json ({entry['sha256'][:16]}…); "
                "the bundle was modified or corrupted — refusing to load it")


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
            return KernelSet("interpret", CountingExecutor(JitExecutor(), "interpret"), manifest, engine,
                             "CPU: Triton interpreter")
        return KernelSet("reference", CountingExecutor(ReferenceExecutor(), "reference"), manifest, engine,
                         "CPU: PyTorch reference kernels")
    if device.type != "cuda":
        raise UserError(f"engine kernels run on cuda or cpu, not {device.type}")
    if device_info is None and not torch.cuda.is_available():
        raise UserError(f"{engine}: {device} requested but this machine has no CUDA GPU; load with device='cpu' "
                        "for the PyTorch reference kernels")
    info = device_info or probe_device(device)
    from lmfoundry.compile import tiles

    jit = JitExecutor(pick_config=lambda call: tiles.pick(info.capability, call))
    cap, reason = match_arch(manifest, info)
    if cap is None:
        log.warning("%s: %s; falling back to Triton JIT", engine, reason)
        return KernelSet("jit", CountingExecutor(jit, "jit"), manifest, engine, reason)
    entries = [e for e in manifest["kernels"] if e["capability"] == cap]
    index = device.index if device.index is not None else torch.cuda.current_device()
    return KernelSet("cubin", CubinExecutor(engine, entries, index, jit), manifest, engine, reason)
