"""A compile worker: reads one JSON job per line on stdin, cross-compiles it with Triton for the
named GPU target (no GPU or driver needed), writes `<key>.cubin/.ptx/.json` and answers one JSON
line per job.

It runs as its own process (`python -m lmfoundry.compile.worker`) because a process that has
`TRITON_INTERPRET=1` — the test suite, or anything that imported kernels for the interpreter —
cannot AOT-compile: the kernels must be imported as real `JITFunction`s. The parent starts it
with a clean environment (`TRITON_DISABLE_LINE_INFO=1`, a private cache directory).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_PTX_ENTRY = re.compile(r"\.visible\s+\.entry\s+(\w+)\s*\(([^)]*)\)", re.S)
# ctypes width of each runtime param type in the kernel signature.
_ARG_CTYPE = {"i32": "i32", "i64": "i64", "fp32": "f32", "u32": "u32", "u64": "u64", "i1": "u8"}


def ptx_params(ptx: str) -> tuple[str, list[dict[str, Any]]]:
    """(entry name, [{"ptx": type, "pointer": bool}]) of the single kernel entry in `ptx`."""
    match = _PTX_ENTRY.search(ptx)
    if match is None:
        raise ValueError("no .visible .entry in PTX")
    params = []
    for line in match.group(2).split(","):
        line = line.strip()
        if not line:
            continue
        m = re.match(r"\.param\s+\.(\w+)((?:\s+\.ptr)?)", line)
        if m is None:
            raise ValueError(f"unparsed PTX param {line!r}")
        params.append({"ptx": m.group(1), "pointer": bool(m.group(2))})
    return match.group(1), params


def _versions() -> dict[str, str]:
    import triton
    from triton.backends.nvidia import compiler as nv

    ptxas = nv.get_ptxas_version(90)
    release = re.search(r"release (\d+)\.(\d+), V([\d.]+)", ptxas)
    return {
        "triton": triton.__version__,
        "ptxas": release.group(3) if release else ptxas.strip().splitlines()[-1],
        "cuda": f"{release.group(1)}.{release.group(2)}" if release else "",
    }


def compile_job(job: dict[str, Any]) -> dict[str, Any]:
    """Compile one specialization; write its files; return the summary line."""
    import triton
    from triton.backends.compiler import GPUTarget

    from lmfoundry.compile import sass
    from lmfoundry.kernels import registry
    from lmfoundry.kernels.spec import DIVISIBILITY, TileConfig

    t0 = time.perf_counter()
    kd = registry.kernel(job["kernel"])
    config = TileConfig.from_dict(job["config"])
    types, semantics = job["types"], job["semantics"]
    signature = kd.signature(types)
    constexprs = {**semantics, **dict(config.constexprs)}
    aligned = set(job["aligned"])
    attrs = {}
    for i, p in enumerate(kd.params):
        if p.is_pointer or p.name in aligned:
            attrs[(i,)] = [["tt.divisibility", DIVISIBILITY]]
    src = triton.compiler.ASTSource(kd.fn, signature, constexprs, attrs)
    cap = int(job["capability"])
    compiled = triton.compile(src, target=GPUTarget("cuda", cap, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    md = compiled.metadata
    ptx = compiled.asm["ptx"]
    cubin = compiled.asm["cubin"]
    entry, pparams = ptx_params(ptx)
    if entry != md.name:
        raise RuntimeError(f"PTX entry {entry} != kernel name {md.name}")
    extra = len(pparams) - len(kd.params)
    # strict=False below: the PTX may end with `extra` pointer params Triton appends (checked here)
    if extra < 0 or any(pp["pointer"] != p.is_pointer for pp, p in zip(pparams, kd.params, strict=False)):
        raise RuntimeError(f"PTX params {pparams} do not match the declared params of {kd.name}")
    if not all(pp["pointer"] for pp in pparams[len(kd.params):]):
        raise RuntimeError(f"unexpected trailing non-pointer params in {kd.name}: {pparams[len(kd.params):]}")
    params = []
    for p, pp in zip(kd.params, pparams, strict=False):  # the declared ones, not Triton's trailing extras
        t = p.resolve(types)
        assumed = p.is_pointer or p.name in aligned
        params.append({"name": p.name, "type": t, "ctype": "ptr" if p.is_pointer else _ARG_CTYPE[t],
                       "ptx": pp["ptx"], "assume_multiple_of_16": assumed,
                       "divisibility": DIVISIBILITY if assumed else 1})
    versions = _versions()
    meta = {
        "format": "lmfoundry-kernel/1",
        "key": job["key"],
        "kernel": kd.name,
        "entry": md.name,
        "target": {"backend": "cuda", "capability": cap, "sm": job["sm"]},
        "grid": list(kd.grid),
        "num_warps": md.num_warps,
        "num_ctas": md.num_ctas,
        "num_stages": config.num_stages,
        "shared": md.shared,
        "global_scratch_size": md.global_scratch_size or 0,
        "global_scratch_align": md.global_scratch_align or 1,
        "profile_scratch_size": getattr(md, "profile_scratch_size", 0) or 0,
        "profile_scratch_align": getattr(md, "profile_scratch_align", 1) or 1,
        "launch_cooperative_grid": bool(md.launch_cooperative_grid),
        "launch_pdl": bool(md.launch_pdl),
        "params": params,
        "scratch_params": extra,
        "types": types,
        "semantics": semantics,
        "config": config.as_dict(),
        "signature": signature,
        "triton": versions["triton"],
        "ptxas": versions["ptxas"],
        "cuda": versions["cuda"],
    }
    out = Path(job["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    base = out / job["key"]
    base.with_suffix(".cubin").write_bytes(cubin)
    base.with_suffix(".ptx").write_text(ptx)
    base.with_suffix(".json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    disassembly = sass.disassemble(base.with_suffix(".cubin"))
    found, usage = sass.mma_opcodes(disassembly), sass.resource_usage(disassembly)
    return {"id": job["id"], "ok": True, "seconds": time.perf_counter() - t0, "mma": found,
            "shared": md.shared, "num_warps": md.num_warps, "versions": versions, "resources": usage}


def main() -> None:
    # The protocol owns the original stdout; anything else printed (Triton prints PTX on ptxas
    # failures) goes to stderr, which the parent sends to a log file.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        job = json.loads(line)
        try:
            reply = compile_job(job)
        except Exception as exc:  # reported to the parent, which fails the build with the message
            reply = {"id": job.get("id"), "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}",
                     "traceback": traceback.format_exc()[-4000:]}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


if __name__ == "__main__":
    main()
