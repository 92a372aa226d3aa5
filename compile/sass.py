"""Disassembly checks with the cuobjdump that ships inside the Triton wheel.

A kernel that was meant to run on tensor cores but came out as FMA loops is still correct, just an
order of magnitude slower — the kind of regression nobody sees until a GPU benchmark. `compile`
therefore reads the SASS of every cubin and fails when a kernel lacks the MMA instruction its arch
and tile should produce (HMMA/IMMA on sm_80, QMMA for fp8 on sm_89, HGMMA/IGMMA/QGMMA wgmma on
sm_90a). It also records each kernel's registers and spill (local-memory) bytes per thread.

The readers below the check give the tests what a memory-bound kernel's speed rests on, with no
GPU: each instruction's opcode (`opcodes`), the width of the global loads that read one kernel
argument (`pointer_loads`, from the PTX the cubin was assembled from) and how many programs of a
kernel an SM holds at once (`resident_ctas`).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections import Counter
from pathlib import Path

from lmfoundry.errors import UserError
from lmfoundry.gpus import SM_LIMITS

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
    (benchmarks/results/gpu_kernels_h200.md has a spilling GEMV tile beside its spill-free one)."""
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


# ---- what the tests read off a compiled kernel ---------------------------------------------------

# "        /*0900*/   @!P0 LDGSTS.E.BYPASS.128 [R51], desc[UR20][R6.64], P6 ;  /* 0x... */": the opcode
# with its modifiers, after the address and an optional predicate.
_SASS_OP = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)", re.M)


def opcodes(sass: str) -> Counter[str]:
    """How often each opcode, modifiers included ("LDGSTS.E.BYPASS.128"), appears in a disassembly."""
    return Counter(_SASS_OP.findall(sass))


def global_load_bits(opcode: str) -> int | None:
    """Bits per thread of a global load opcode (LDG: to registers; LDGSTS: cp.async, global to
    shared memory), None for anything else. Without a width suffix a load is 32 bits."""
    parts = opcode.split(".")
    if parts[0] not in ("LDG", "LDGSTS"):
        return None
    for p in parts[1:]:
        if p in ("64", "128"):
            return int(p)
        if p in ("U8", "S8", "U16", "S16"):
            return int(p[1:])
    return 32


# One PTX instruction: optional predicate, opcode, operands up to the semicolon.
_PTX_INSTR = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)\s+([^;]*);", re.M)
_PTX_REG = re.compile(r"%[a-z]+\d+")
_PTX_WIDTH = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2, "b32": 4, "u32": 4,
              "s32": 4, "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}
_NO_DEST = ("st.", "cp.", "red.", "bar.", "fence.", "membar.", "bra", "ret", "prefetch", "mbarrier.")


def _operands(text: str) -> list[str]:
    """Operands split at the commas outside [] and {}."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def pointer_loads(ptx: str, param: int) -> list[int]:
    """Bytes per thread of each global load in `ptx` (ld.global, and cp.async from global to shared
    memory) whose address is computed from kernel parameter number `param` (0-based, declaration
    order): which loads read that argument, and how wide each one is. A register is taken to hold
    such an address when any instruction writing it reads one (or the parameter itself)."""
    instrs = [(m.group(1), _operands(m.group(2))) for m in _PTX_INSTR.finditer(ptx)]
    tainted: set[str] = set()
    for op, args in instrs:
        if op.startswith("ld.param") and len(args) == 2 and re.search(rf"_param_{param}\b", args[1]):
            tainted.update(_PTX_REG.findall(args[0]))
    changed = True
    while changed:
        changed = False
        for op, args in instrs:
            if not args or op.startswith(_NO_DEST) or args[0].startswith("["):
                continue
            dest = set(_PTX_REG.findall(args[0]))
            if not dest <= tainted and any(r in tainted for a in args[1:] for r in _PTX_REG.findall(a)):
                tainted |= dest
                changed = True
    widths = []
    for op, args in instrs:
        parts = op.split(".")
        if op.startswith("ld.global") and len(args) >= 2:
            address, vector = args[1], next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
            size = vector * next((_PTX_WIDTH[p] for p in reversed(parts) if p in _PTX_WIDTH), 0)
        elif op.startswith("cp.async") and ".global" in op and len(args) >= 3:
            address, size = args[1], int(args[2], 0)
        else:
            continue
        if any(r in tainted for r in _PTX_REG.findall(address)):
            widths.append(size)
    return widths


def resident_ctas(capability: int, registers: int, num_warps: int, shared: int) -> int:
    """CTAs of a kernel one SM holds at once (the CUDA occupancy calculator's rules): registers go
    to a warp in units, a partition's warps share its quarter of the register file, and every CTA
    takes its shared memory plus the system's reserve."""
    lim = SM_LIMITS[capability]
    per_warp = -(-max(registers, 1) * 32 // lim.register_unit) * lim.register_unit
    warps_by_registers = 4 * (lim.registers // 4 // per_warp)
    by_shared = lim.shared // (shared + lim.cta_shared_reserved)
    return min(lim.ctas, lim.warps // num_warps, warps_by_registers // num_warps, by_shared)
