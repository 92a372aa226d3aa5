"""What lmfoundry knows about GPUs, in one place: architectures by compute capability, and the
per-product datasheet table (lmfoundry/gpus.yaml).

- `ARCHITECTURES`: one row per CUDA compute capability (major * 10 + minor) with its family, the
  name its kernels are compiled for, and the GPU names that mean it. `doctor --arch` accepts every
  name here (`ARCH_NAMES`); `compile --arch` only the capabilities it builds kernels for, under the
  names `COMPILE_ARCH_NAMES` lists; compile's tile tables and engine manifests name capabilities
  with `SM_NAME` and `ARCH_OF_CAPABILITY`, size split-K grids with `SM_COUNT`, and the checks on
  compiled kernels read what one SM holds at once from `SM_LIMITS`.
- `load_gpus()` / `resolve_gpu()`: the products `lmfoundry plan` sizes deployments for (memory,
  bandwidth, peak TFLOPS, each with its source). The rows are datasheet figures per product; the
  architecture rows above are per capability, so the two tables are kept apart but live here.

Nothing here imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from lmfoundry.errors import UserError


@dataclass(frozen=True)
class SmLimits:
    """What one SM holds at once, from the CUDA programming guide's table of per-capability limits:
    the checks on compiled kernels (`compile.sass.resident_ctas`) turn a kernel's registers, warps
    and shared memory into the programs an SM runs side by side."""

    shared: int  # bytes of shared memory CTAs may take together
    warps: int  # resident warps
    ctas: int  # resident CTAs
    registers: int = 65536  # 32-bit registers, in four partitions, one per warp scheduler
    register_unit: int = 256  # registers are given to a warp in units of this many
    cta_shared_reserved: int = 1024  # shared memory the system keeps per CTA


@dataclass(frozen=True)
class Arch:
    """One CUDA compute capability."""

    capability: int  # major * 10 + minor
    family: str  # ampere, ada, hopper, ...
    sm: str  # the target kernels are compiled for (sm_90a: Hopper's wgmma/TMA need the arch-specific target)
    names: tuple[str, ...] = ()  # GPU names (and family synonyms) that mean this capability
    compile_target: bool = False  # `lmfoundry compile` builds kernels for it
    compile_names: tuple[str, ...] = ()  # the `names` that `lmfoundry compile --arch` accepts too
    # SMs of the data-centre part compile sizes its grids for (split-K fills this many SMs): A100,
    # L40S, H100/H200 SXM. Other parts of the capability differ (L4: 58, H100 PCIe: 114); a grid sized
    # for more SMs than a part has still runs, in more waves.
    sms: int = 0
    limits: SmLimits | None = None  # per-SM occupancy limits, for the archs compile builds for


# A family's own name means its first (lowest) capability: ampere -> sm_80, blackwell -> sm_100.
ARCHITECTURES: tuple[Arch, ...] = (
    Arch(70, "volta", "sm_70", ("v100",)),
    Arch(75, "turing", "sm_75", ("t4",)),
    Arch(80, "ampere", "sm_80", ("a100",), compile_target=True, compile_names=("a100",), sms=108,
         limits=SmLimits(shared=164 << 10, warps=64, ctas=32)),
    Arch(86, "ampere", "sm_86", ("a10", "a10g", "a40")),
    Arch(87, "ampere", "sm_87"),
    Arch(89, "ada", "sm_89", ("lovelace", "l4", "l40", "l40s", "rtx4090"), compile_target=True,
         compile_names=("l4", "l40s"), sms=142, limits=SmLimits(shared=100 << 10, warps=48, ctas=24)),
    Arch(90, "hopper", "sm_90a", ("h100", "h200", "gh200"), compile_target=True, compile_names=("h100", "h200"),
         sms=132, limits=SmLimits(shared=228 << 10, warps=64, ctas=32)),
    Arch(100, "blackwell", "sm_100", ("b200", "gb200")),
    Arch(120, "blackwell", "sm_120", ("rtx5090",)),
)

# Tensor-core features by capability.
FP8_MIN_CAPABILITY = 89  # FP8 tensor cores: Ada, Hopper, Blackwell


def _arch_names() -> dict[str, int]:
    names: dict[str, int] = {}
    for a in ARCHITECTURES:
        names.setdefault(a.family, a.capability)
        for n in a.names:
            names[n] = a.capability
    return names


def _compile_arch_names() -> dict[str, int]:
    names: dict[str, int] = {}
    for a in ARCHITECTURES:
        if a.compile_target:
            cap = a.capability
            for n in (a.family, f"sm_{cap}", f"sm{cap}", a.sm, *a.compile_names):
                names[n] = cap
    return names


# name -> compute capability, for `doctor --arch` (family names, GPU names)
ARCH_NAMES: dict[str, int] = _arch_names()
# name -> compute capability, for `compile --arch` (family, sm_XY / smXY / the sm target, GPU names)
COMPILE_ARCH_NAMES: dict[str, int] = _compile_arch_names()
SM_NAME: dict[int, str] = {a.capability: a.sm for a in ARCHITECTURES}
ARCH_OF_CAPABILITY: dict[int, str] = {a.capability: a.family for a in ARCHITECTURES}
SM_COUNT: dict[int, int] = {a.capability: a.sms for a in ARCHITECTURES if a.sms}
SM_LIMITS: dict[int, SmLimits] = {a.capability: a.limits for a in ARCHITECTURES if a.limits is not None}


def parse_arch(text: str) -> tuple[str, int]:
    """`doctor --arch`: `hopper`, `h100`, `sm_90`, `sm90a`, `8.9`, `89` -> (name, compute capability)."""
    t = text.strip().lower()
    if t in ARCH_NAMES:
        return t, ARCH_NAMES[t]
    m = re.fullmatch(r"(?:sm_?)?(\d)\.?(\d{1,2})a?", t)
    if m:
        cc = int(m.group(1)) * 10 + int(m.group(2)) if len(m.group(2)) == 1 else int(m.group(1) + m.group(2))
        return f"sm_{cc}", cc
    raise UserError(f"unknown --arch {text!r}; use a name ({', '.join(sorted(ARCH_NAMES))}) or sm_XY")


def parse_compile_arch(name: str) -> int:
    """`compile --arch`: a name of COMPILE_ARCH_NAMES -> the compute capability to build for."""
    try:
        return COMPILE_ARCH_NAMES[name.strip().lower()]
    except KeyError:
        raise UserError(f"unknown arch {name!r}; choose from ampere (sm_80), ada (sm_89), hopper (sm_90a), or cpu alone") from None


# ------------------------------------------------------------------------- products (gpus.yaml)
def load_gpus() -> dict[str, dict[str, Any]]:
    """The GPU table from lmfoundry/gpus.yaml (key -> row)."""
    import yaml

    text = resources.files("lmfoundry").joinpath("gpus.yaml").read_text()
    return yaml.safe_load(text)


def resolve_gpu(name: str, gpus: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    key = name.strip().lower()
    for gpu_key, row in gpus.items():
        if key == gpu_key or key in (row.get("aliases") or []):
            return gpu_key, row
    raise UserError(f"unknown GPU {name!r}; known: {', '.join(gpus)}")
