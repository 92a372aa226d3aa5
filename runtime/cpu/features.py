"""What this CPU computes natively, for choosing the serving dtype and keying `--arch cpu` bundles.

bfloat16 is the default execution dtype where the CPU has bf16 arithmetic (AVX512-BF16 or
AMX-BF16): there bf16 GEMMs run on the matrix/dot-product units and the int4pack / int8pack
weight-only kernels take their vectorized path. On AVX2 CPUs oneDNN emulates bf16, but the
runtime's own products (`runtime/cpu/native/bf16_fma_gemm.c`: bf16 weights widened in registers, float32
FMAs) and attention kernels read half the bytes of float32 at the same arithmetic, so bfloat16 is
the default there too wherever they are built; elsewhere float32 is faster.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from lmfoundry.runtime.cpu.isa import ISAS, features, forced, isa, machine

__all__ = ["ISAS", "cpu_features", "default_dtype", "describe", "isa", "machine", "native_bf16", "onednn_bf16",
           "widened_bf16"]


def cpu_features() -> dict[str, bool]:
    """The CPU's feature flags as booleans, less what a forced path (`LMFOUNDRY_CPU_ISA`, see
    `lmfoundry.runtime.cpu.isa`) leaves out."""
    return features()


def native_bf16() -> bool:
    f = cpu_features()
    return f.get("avx512_bf16", False) or f.get("amx_bf16", False)


@lru_cache(maxsize=1)
def onednn_bf16() -> bool:
    """Whether this CPU's oneDNN has bf16 kernels (AVX512-BF16 or AMX; elsewhere it emulates them)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def widened_bf16() -> bool:
    """Whether bf16 runs through the runtime's AVX2 kernels here (no bf16 arithmetic, but AVX2 +
    FMA and the kernels built)."""
    if native_bf16():
        return False
    from lmfoundry.runtime.cpu.native.bf16_fma_gemm import load_bf16_fma_gemm

    return load_bf16_fma_gemm() is not None


def default_dtype() -> torch.dtype:
    """The execution dtype of `--dtype auto` on CPU."""
    return torch.bfloat16 if native_bf16() or widened_bf16() else torch.float32


def describe(dtype: str = "auto") -> str:
    """One line for a server's or evaluation's start: what was detected and what follows for
    `--dtype auto`; a `dtype` given instead is said to be the one used."""
    extra = [n for n in ("avx512_bf16", "amx_bf16", "amx_int8", "avx512_vnni") if cpu_features().get(n)]
    auto = "bfloat16" if native_bf16() else \
        "bfloat16 (widened to float32 in the runtime's AVX2 kernels)" if widened_bf16() else "float32 (no native bf16)"
    path = f"{isa()}, forced by LMFOUNDRY_CPU_ISA" if forced() else isa()
    chosen = f"--dtype auto -> {auto}" if dtype == "auto" else f"--dtype {dtype} (as given; auto would be {auto})"
    return f"cpu: {path} ({', '.join(extra) or 'no bf16/int8 dot-product units'}); {chosen}"


if __name__ == "__main__":  # `python -m lmfoundry.runtime.cpu.features`: the line CI prints before the tests
    import sys

    from lmfoundry.errors import UserError
    from lmfoundry.runtime.cpu.isa import apply

    try:
        apply()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    print(f"{describe()}; {machine()}")
