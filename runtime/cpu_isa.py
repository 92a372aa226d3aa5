"""What this CPU computes natively, for choosing the serving dtype and keying `--arch cpu` bundles.

bfloat16 is the default execution dtype where the CPU has bf16 arithmetic (AVX512-BF16 or
AMX-BF16): there bf16 GEMMs run on the matrix/dot-product units and the int4pack / int8pack
weight-only kernels take their vectorized path. On AVX2 CPUs oneDNN emulates bf16, but the
runtime's own products (`kernels/cpu/bf16_fma_gemm.c`: bf16 weights widened in registers, float32
FMAs) and attention kernels read half the bytes of float32 at the same arithmetic, so bfloat16 is
the default there too wherever they are built; elsewhere float32 is faster.
"""

from __future__ import annotations

from functools import lru_cache

import torch

ISAS = ("amx", "avx512", "avx2", "default")  # an ahead-of-time artifact's ISA key, richest first


@lru_cache(maxsize=1)
def cpu_features() -> dict[str, bool]:
    """The feature flags PyTorch detected (cpuinfo), as booleans."""
    try:
        caps = torch._C._cpu._get_cpu_capability()
    except AttributeError:  # older torch: only the dispatch level is known
        level = torch.backends.cpu.get_cpu_capability().lower()
        return {"avx512_f": level.startswith("avx512"), "avx2": level in ("avx2", "avx512")}
    return {k: bool(v) for k, v in caps.items() if isinstance(v, bool)}


def native_bf16() -> bool:
    f = cpu_features()
    return f.get("avx512_bf16", False) or f.get("amx_bf16", False)


def isa() -> str:
    """The richest of ISAS this CPU runs (AMX needs its bf16 and int8 tiles)."""
    f = cpu_features()
    if f.get("amx_tile") and f.get("amx_bf16") and f.get("amx_int8"):
        return "amx"
    if f.get("avx512_f") and f.get("avx512_bw") and f.get("avx512_vl"):
        return "avx512"
    if f.get("avx2"):
        return "avx2"
    return "default"


def widened_bf16() -> bool:
    """Whether bf16 runs through the runtime's AVX2 kernels here (no bf16 arithmetic, but AVX2 +
    FMA and the kernels built)."""
    if native_bf16():
        return False
    from lmfoundry.kernels.cpu.bf16_fma_gemm import load_bf16_fma_gemm

    return load_bf16_fma_gemm() is not None


def default_dtype() -> torch.dtype:
    """The execution dtype of `--dtype auto` on CPU."""
    return torch.bfloat16 if native_bf16() or widened_bf16() else torch.float32


def describe() -> str:
    """One line for a server's or evaluation's start: what was detected and what follows."""
    extra = [n for n in ("avx512_bf16", "amx_bf16", "amx_int8", "avx512_vnni") if cpu_features().get(n)]
    dtype = "bfloat16" if native_bf16() else \
        "bfloat16 (widened to float32 in the runtime's AVX2 kernels)" if widened_bf16() else "float32 (no native bf16)"
    return f"cpu: {isa()} ({', '.join(extra) or 'no bf16/int8 dot-product units'}); --dtype auto -> {dtype}"
