"""Every kernel family, what it declares to support, and its kernel definitions.

`compile` walks this registry to turn a checkpoint into specializations; the runtime asks
`supports(family, ...)` before choosing a path; tests and the GPU benchmark iterate it so that no
kernel goes untested.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmfoundry.kernels import (
    activation,
    fp8_gemm,
    norm_quant,
    paged_attention,
    paged_kv,
    rotary,
    w4a16,
    w4a16_tiled,
    w8a8,
)
from lmfoundry.kernels import lora as lora_kernels
from lmfoundry.kernels.spec import KernelDef, Support


@dataclass(frozen=True)
class Family:
    """A kernel family: one module, one support declaration, one or more kernels."""

    name: str
    module: Any
    support: Support
    kernels: tuple[KernelDef, ...]

    def supports(self, **query: Any) -> bool:
        return self.support.supports(**query)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("w4a16", w4a16, w4a16.SUPPORT, (w4a16_tiled.TILED, w4a16.GEMM, w4a16.GEMV)),
        Family("w8a8", w8a8, w8a8.SUPPORT, (w8a8.KERNEL,)),
        Family("fp8", fp8_gemm, fp8_gemm.SUPPORT, (fp8_gemm.KERNEL,)),
        Family("rmsnorm_quant", norm_quant, norm_quant.SUPPORT, (norm_quant.KERNEL,)),
        Family("silu_mul", activation, activation.SUPPORT, (activation.KERNEL,)),
        Family("rotary", rotary, rotary.SUPPORT, (rotary.KERNEL,)),
        Family("kv_cache", paged_kv, paged_kv.SUPPORT, (paged_kv.KERNEL,)),
        Family("paged_attention", paged_attention, paged_attention.SUPPORT,
               (paged_attention.PREFILL, paged_attention.DECODE_SPLIT, paged_attention.DECODE_REDUCE,
                paged_attention.DECODE)),
        Family("lora", lora_kernels, lora_kernels.SUPPORT, (lora_kernels.SHRINK, lora_kernels.EXPAND)),
    )
}

KERNELS: dict[str, KernelDef] = {k.name: k for f in FAMILIES.values() for k in f.kernels}


def families() -> list[str]:
    return list(FAMILIES)


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown kernel family {name!r}; known: {', '.join(FAMILIES)}") from None


def kernel(name: str) -> KernelDef:
    try:
        return KERNELS[name]
    except KeyError:
        raise KeyError(f"unknown kernel {name!r}; known: {', '.join(KERNELS)}") from None


def supports(family_name: str, **query: Any) -> bool:
    """Whether `family_name` handles e.g. bits=4, group_size=64, dtype="bfloat16", arch=90."""
    return family(family_name).supports(**query)
