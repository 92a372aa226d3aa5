"""Which x86 vector path the CPU's kernels take, and `LMFOUNDRY_CPU_ISA`, the switch that forces one.

Three paths, richest first: `amx` (AMX bf16/int8 tiles beside AVX-512), `avx512` (AVX-512 F/BW/VL,
with AVX512-BF16 where the CPU has it) and `avx2` (AVX2 + FMA). A CPU runs its richest path and
every poorer one. Each library below picks a path per process, and the bytes of any float work (a
calibration's sums, a served logit) depend on what they picked:
- ATen's vectorized kernels: `ATEN_CPU_CAPABILITY`;
- oneDNN, torch's bf16 matmuls: `ONEDNN_MAX_CPU_ISA` (below AVX512_CORE_BF16 it has no bf16
  kernels, and torch takes its float32 routes, as on an AVX2 CPU);
- MKL, torch's float32 BLAS and LAPACK: `MKL_ENABLE_INSTRUCTIONS`, which MKL honours on Intel CPUs
  only (elsewhere it keeps the path it picked for the vendor);
- OpenBLAS, numpy's and scipy's BLAS (GPTQ's column updates): `OPENBLAS_CORETYPE`;
- the runtime's C kernels (`runtime/cpu/native/*.c`): built with -march=native, so a forced path builds
  them with the richer extensions switched off and their `#if`s take the poorer code
  (`build.py`, which checks what each object was compiled for).

`LMFOUNDRY_CPU_ISA=avx2|avx512|amx` sets those variables for the process and every process it
starts, and the C kernels' flags; a path this CPU lacks is refused. The libraries fix their choice
as they load (OpenBLAS, with numpy) or at torch's first operation (ATen, oneDNN), so the switch is
applied as a process starts (`apply`: the CLI and the test suite call it first) and refused, not
half-applied, when it comes too late. It reproduces on a rich CPU what a poorer one computes, and
lets one machine test every path it has.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache
from pathlib import Path

from lmfoundry.errors import UserError

ENV = "LMFOUNDRY_CPU_ISA"
ISAS = ("amx", "avx512", "avx2", "default")  # richest first; also an ahead-of-time artifact's ISA key
FORCEABLE = ISAS[:3]
# what a forced path tells the libraries torch runs (apply() sets these and removes the others)
LIBRARY_ENV: dict[str, dict[str, str]] = {
    "amx": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "ALL"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3", "OPENBLAS_CORETYPE": "SkylakeX"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "OPENBLAS_CORETYPE": "Haswell"},
}
LIBRARY_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "OPENBLAS_CORETYPE")


@lru_cache(maxsize=1)
def detected_features() -> dict[str, bool]:
    """The feature flags PyTorch's cpuinfo reads from this CPU, as booleans (no torch op runs)."""
    import torch

    try:
        caps = torch._C._cpu._get_cpu_capability()
    except AttributeError:  # older torch: only the dispatch level is known
        level = torch.backends.cpu.get_cpu_capability().lower()
        return {"avx512_f": level.startswith("avx512"), "avx2": level in ("avx2", "avx512")}
    return {k: bool(v) for k, v in caps.items() if isinstance(v, bool)}


def richest(features: dict[str, bool]) -> str:
    """The richest of ISAS that CPU features allow (AMX needs its tiles, bf16 and int8)."""
    f = features
    if f.get("amx_tile") and f.get("amx_bf16") and f.get("amx_int8"):
        return "amx"
    if f.get("avx512_f") and f.get("avx512_bw") and f.get("avx512_vl"):
        return "avx512"
    if f.get("avx2"):
        return "avx2"
    return "default"


def supported() -> tuple[str, ...]:
    """The paths this CPU runs, richest first (none on a CPU without AVX2)."""
    return FORCEABLE[ISAS.index(richest(detected_features())):]


def _named() -> str | None:
    name = os.environ.get(ENV, "").strip().lower()
    if not name:
        return None
    if name not in FORCEABLE:
        raise UserError(f"{ENV}={name!r}: expected one of {', '.join(FORCEABLE)}")
    return name


def forced() -> str | None:
    """The path `LMFOUNDRY_CPU_ISA` forces, None when unset; an unknown path or one this CPU
    lacks is a UserError."""
    name = _named()
    if name is None:
        return None
    here = supported()
    if name not in here:
        runs = f"it runs {', '.join(here)}" if here else "it has none of them"
        raise UserError(f"{ENV}={name}: this CPU has no {name} path ({runs})")
    return name


def isa() -> str:
    """The path the CPU kernels take in this process: the forced one, else the CPU's richest."""
    return forced() or richest(detected_features())


def features() -> dict[str, bool]:
    """This CPU's feature flags, less the extensions above a forced path (forced to avx2, an
    AVX-512 CPU reports what an AVX2 one does)."""
    found, path = detected_features(), forced()
    if path is None or path == "amx":
        return found
    above = ("amx",) if path == "avx512" else ("amx", "avx512")
    return {k: v and not k.startswith(above) for k, v in found.items()}


def apply() -> str | None:
    """Force the path `LMFOUNDRY_CPU_ISA` names on the libraries torch, numpy and scipy run, in this
    process and the ones it starts; returns it (None when unset). Refuses a path the CPU lacks, and
    a switch that comes after a library has already picked its kernels in this process."""
    name = _named()
    if name is None:
        return None
    wanted = {var: LIBRARY_ENV[name].get(var) for var in LIBRARY_VARS}
    # set before checking the CPU, which loads torch (and numpy, whose OpenBLAS reads its variable then)
    late = "numpy" in sys.modules and wanted != {var: os.environ.get(var) for var in LIBRARY_VARS}
    for var, value in wanted.items():
        os.environ.pop(var, None)
        if value is not None:
            os.environ[var] = value
    path = forced()
    import torch

    late = late or torch.backends.cpu.get_cpu_capability().lower() != wanted["ATEN_CPU_CAPABILITY"]
    if path == "avx2" and torch.backends.mkldnn.is_available():
        late = late or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # oneDNN kept its bf16 kernels
    if late:
        raise UserError(f"{ENV}={path} came too late: torch or numpy had already picked their kernels in this "
                        "process; set it in the environment the process starts with")
    return path


@lru_cache(maxsize=1)
def machine() -> str:
    """The CPU model as its vendor, family and model numbers (/proc/cpuinfo). Two CPUs of one
    path can still round differently: BLAS libraries pick kernels and block sizes per vendor,
    model and cache."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor's block is enough
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    except OSError:
        pass
    if "vendor_id" in info:
        return f"{info['vendor_id']} family {info.get('cpu family', '?')} model {info.get('model', '?')}"
    import platform

    return platform.processor() or platform.machine()
