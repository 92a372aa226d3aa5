"""Build the CPU runtime's C kernels on the machine that serves, once, and load them with ctypes.

Why C and not a PyTorch composition: decode attention over a paged cache has no PyTorch op that
reads blocks in place; composing one (gather the blocks, then SDPA) copies every sequence's whole
context once per layer and step, which is most of a decode step's time at high concurrency.

Why built here and not shipped: the loops are written plainly and compiled with `-march=native`,
so they vectorize for this CPU (AVX-512 where it has it) without per-ISA intrinsics. A build takes
about a second; the shared object is cached under the lmfoundry cache, keyed by the source (and
the headers it includes), the compiler's version, the flags and this CPU's feature flags, so a
server pays it once per machine. Beside each object a record holds its full key and sha256, and an
object is loaded only when both match (`_is_built_for`): a swapped, copied or damaged one is built
again, never loaded.
The objects link OpenMP through `-fopenmp`, which resolves to the libgomp.so.1 torch has already
loaded, so our loops and torch's ops share one thread pool.

A path forced with `LMFOUNDRY_CPU_ISA` (`isa.py`) adds flags that switch off the extensions above
it (-mno-avx512f for avx2, -mno-amx-* below amx), so the kernels' `#if`s take that path's code, and
every object reports the path it was compiled for (`compiled_isa.h`), checked against a forced one
below the CPU's own.

No compiler, a failed build or `LMFOUNDRY_NATIVE_KERNELS=0`: `load` returns None with the reason,
and callers keep their PyTorch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Callable, TypeVar

from lmfoundry.errors import UserError
from lmfoundry.manifest import parse_json_object, read_bounded, sha256_file
from lmfoundry.runtime.cpu import isa as cpu_isa

T = TypeVar("T")

HERE = Path(__file__).resolve().parent
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared", "-std=c11")
DISABLE_ENV = "LMFOUNDRY_NATIVE_KERNELS"
PROBE = "compiled_isa.h"  # included in every kernel: `lmf_compiled_isa()`, the path it was compiled for


class NativeUnavailable(RuntimeError):
    """Why a native kernel cannot be used on this machine (the caller falls back)."""


def compiler() -> str | None:
    """The C compiler to use: $CC, else cc or gcc on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@lru_cache(maxsize=4)
def _native_extensions(cc: str) -> frozenset[str]:
    """The AVX-512 and AMX macros `cc -march=native` defines here."""
    done = subprocess.run([cc, "-march=native", "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True,
                          timeout=60)
    names = (line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define "))
    return frozenset(n for n in names if n.startswith(("__AVX512", "__AMX_")))


def forced_flags(cc: str) -> tuple[str, ...]:
    """The flags after -march=native that take the kernels down to the forced path: the extensions
    above it that the compiler turns on here switched off (only those: a flag the compiler does
    not know would fail the build)."""
    path = cpu_isa.forced()
    if path is None or path == "amx":
        return ()
    on = _native_extensions(cc)
    flags = [f"-mno-{m.strip('_').lower().replace('_', '-')}" for m in sorted(on) if m.startswith("__AMX_")]
    if path == "avx2" and "__AVX512F__" in on:
        flags.append("-mno-avx512f")  # and with it every AVX-512 extension
    return tuple(flags)


def _build(name: str, cc: str) -> Path:
    from lmfoundry.resources import cache_dir
    from lmfoundry.staging import stage_path, sweep_dead_stages

    source = HERE / f"{name}.c"
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    headers = [h.read_text() for h in sorted(HERE.glob("*.h"))]  # what the sources include
    flags = (*FLAGS, *forced_flags(cc))
    key = hashlib.sha256("\0".join([source.read_text(), *headers, version, " ".join(flags), _cpu_flags()])
                         .encode()).hexdigest()
    target = cache_dir() / "native" / f"{name}-{key[:16]}.so"
    if _is_built_for(target, key):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_dead_stages(target.parent)  # objects and records of builds that were killed
    stage, record = stage_path(target), stage_path(_record(target))  # then atomic renames: nothing half-written
    try:
        done = subprocess.run([cc, *flags, "-include", str(HERE / PROBE), f"-I{HERE}", str(source), "-o", str(stage),
                               "-lm"], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise NativeUnavailable(f"{cc} could not build {source.name}: {done.stderr.strip()[-400:]}")
        record.write_text(json.dumps({"key": key, "sha256": sha256_file(stage)}))
        os.replace(stage, target)
        os.replace(record, _record(target))
    finally:
        for leftover in (stage, record):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
    return target


def _record(target: Path) -> Path:
    """The record beside a built object: the full key it was built for and its sha256."""
    return target.with_name(target.name + ".json")


def _is_built_for(target: Path, key: str) -> bool:
    """Whether `target` is the object built for `key`: its record names that key and its bytes
    hash to the record's sha256. Its file name carries only a prefix of the key and proves nothing:
    two cached objects swapped with each other, one copied from another machine, or truncated bytes
    would otherwise be loaded (and fail on a missing symbol mid-start, or compute with another
    kernel); any of those is built again instead."""
    try:
        record = parse_json_object(read_bounded(_record(target), 4096, "build record"), _record(target), "record")
        return record.get("key") == key and record.get("sha256") == sha256_file(target)
    except (UserError, OSError):
        return False


_LOADED: dict[str, ctypes.CDLL | NativeUnavailable] = {}  # failures too: a failed build is not retried


def _load(name: str) -> ctypes.CDLL:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        raise NativeUnavailable(f"{DISABLE_ENV}=0")
    if name not in _LOADED:
        try:
            _LOADED[name] = _open(name)
        except NativeUnavailable as exc:
            _LOADED[name] = exc
    found = _LOADED[name]
    if isinstance(found, NativeUnavailable):
        raise found
    return found


def _open(name: str) -> ctypes.CDLL:
    cc = compiler()
    if cc is None:
        raise NativeUnavailable("no C compiler (cc, gcc or $CC) on PATH")
    import torch  # noqa: F401  (torch's libgomp.so.1 must be loaded before ours resolves it)

    try:
        lib = ctypes.CDLL(str(_build(name, cc)))
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"{name}: {exc}") from None
    path = cpu_isa.forced()
    if path is not None and path != cpu_isa.supported()[0] and compiled_path(lib) != path:  # forced below the CPU's
        raise NativeUnavailable(f"{name}: compiled for {compiled_path(lib)}, but {cpu_isa.ENV}={path}")
    return lib


def compiled_path(lib: ctypes.CDLL) -> str:
    """The path (one of `isa.ISAS`) a built library was compiled for."""
    return cpu_isa.ISAS[3 - int(lib.lmf_compiled_isa())]


def load(name: str) -> ctypes.CDLL | None:
    """The built library `name` (a `<name>.c` beside this file), or None where it cannot be built."""
    try:
        return _load(name)
    except NativeUnavailable:
        return None


def unavailable_reason(name: str) -> str | None:
    """Why `load(name)` returns None (None when it loads)."""
    try:
        _load(name)
        return None
    except NativeUnavailable as exc:
        return str(exc)


_BOUND: dict[tuple[str, Callable], object] = {}  # one binding per library (bindings hold workspaces)


def bound(name: str, binding: Callable[[ctypes.CDLL], T]) -> T | None:
    """`binding(library)` for the built library `name`, made once; None where it cannot be built
    or native kernels are turned off."""
    lib = load(name)
    if lib is None:
        return None
    if (name, binding) not in _BOUND:
        _BOUND[(name, binding)] = binding(lib)
    return _BOUND[(name, binding)]  # type: ignore[return-value]
