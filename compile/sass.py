"""Disassembly checks with the cuobjdump that ships inside the Triton wheel.

A kernel that was meant to run on tensor cores but came out as FMA loops is still correct, just an
order of magnitude slower — the kind of regression nobody sees until a GPU benchmark. `compile`
therefore reads the SASS of every cubin and fails when a kernel lacks the MMA instruction its arch
and tile should produce (HMMA/IMMA on sm_80, QMMA for fp8 on sm_89, HGMMA/IGMMA/QGMMA wgmma on
sm_90a). It also records each kernel's registers and spill (local-memory) bytes per thread.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from lmfoundry.errors import UserError

# An opcode is the first token of an instruction: "HGMMA.64x128x16.F32.BF16 ...". The lookbehind
# keeps modifiers such as the ".MMA" of "HFMA2.MMA" (an FMA issued on the MMA pipe) out.
_MMA = re.compile(r"(?<![.\w])([A-Z]*MMA)(?=[.\s])")


class BuildCheckError(UserError):
    """A compiled kernel does not contain the instructions its arch should use."""

    exit_code = 3


def tool(name: str) -> Path:
    """Path of a CUDA tool bundled with Triton (ptxas, cuobjdump, nvdisasm)."""
    import triton

    path = Path(os.path.dirname(triton.__file__)) / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise UserError(f"{path}: missing from the triton wheel (needed to check compiled kernels)")
    return path


def disassemble(cubin: Path) -> str:
    """The cubin's SASS, preceded by its resource usage (one cuobjdump run gives both)."""
    out = subprocess.run([str(tool("cuobjdump")), "-sass", "--dump-resource-usage", str(cubin)], capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise BuildCheckError(f"{cubin.name}: cuobjdump failed: {out.stderr.strip()[:200]}")
    return out.stdout


_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def resource_usage(disassembly: str) -> dict[str, int]:
    """Registers per thread and the stack / local-memory bytes per thread of the kernel, read from
    `disassemble`'s output. Either in a Triton kernel means register spills (ptxas puts them on the
    stack frame, in local memory): each spilled value is a round trip to L1/L2 inside the hot loop
    (the H200 run measured a W4A16 GEMV at 255 registers with 1 KB of spills 4x slower than its
    spill-free tile)."""
    match = _USAGE.search(disassembly)
    if match is None:
        raise BuildCheckError("cuobjdump printed no resource usage (REG/STACK/LOCAL) for the kernel")
    regs, stack, _, local = (int(g) for g in match.groups())
    return {"registers": regs, "stack_bytes": stack, "local_bytes": local}


def mma_opcodes(sass: str) -> list[str]:
    """Distinct tensor-core opcodes (HMMA, IMMA, QMMA, HGMMA, IGMMA, QGMMA, ...) in a disassembly."""
    return sorted(set(_MMA.findall(sass)))


def check(kernel: str, sm: str, expected: tuple[str, ...], found: list[str]) -> None:
    """Raise BuildCheckError unless one of `expected` is among `found` (no expectation: no check)."""
    if expected and not any(e in found for e in expected):
        what = " or ".join(expected)
        wgmma = " (no wgmma: Hopper would run it on the slower mma.sync path)" if "GMMA" in what else ""
        raise BuildCheckError(
            f"{kernel} for {sm} has no {what} instruction{wgmma}; found {', '.join(found) or 'no MMA at all'}"
        )
