"""Every kernel family, what it declares to support, its kernel definitions and its op functions.

`compile` walks this registry to turn a checkpoint into specializations; the runtime asks
`supports(family, ...)` before choosing a path and binds the families' ops to an engine's launcher
(`runtime/kernel_set.KernelSet`); tests and the GPU benchmark iterate it so that no kernel goes
untested. The one list of families: a new kernel is registered here only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

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
    """A kernel family: one module, one support declaration, one or more kernels, and the op
    functions callers run them through, by the name an engine's `KernelSet` gives them (each
    takes a `launcher=`)."""

    name: str
    module: Any
    support: Support
    kernels: tuple[KernelDef, ...]
    ops: dict[str, Callable[..., Any]] = field(hash=False)

    def supports(self, **query: Any) -> bool:
        return self.support.supports(**query)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("w4a16", w4a16, w4a16.SUPPORT, (w4a16_tiled.TILED, w4a16.GEMM, w4a16.GEMV),
               {"w4a16_linear": w4a16.w4a16_linear, "w4a16_tiled_linear": w4a16_tiled.w4a16_tiled_linear}),
        Family("w8a8", w8a8, w8a8.SUPPORT, (w8a8.KERNEL,),
               {"w8a8_gemm": w8a8.w8a8_gemm, "w8a8_linear": w8a8.w8a8_linear}),
        Family("fp8", fp8_gemm, fp8_gemm.SUPPORT, (fp8_gemm.KERNEL,),
               {"fp8_gemm": fp8_gemm.fp8_gemm, "fp8_linear": fp8_gemm.fp8_linear}),
        Family("rmsnorm_quant", norm_quant, norm_quant.SUPPORT, (norm_quant.KERNEL,),
               {"rmsnorm_quant": norm_quant.rmsnorm_quant}),
        Family("silu_mul", activation, activation.SUPPORT, (activation.KERNEL,), {"silu_mul": activation.silu_mul}),
        Family("rotary", rotary, rotary.SUPPORT, (rotary.KERNEL,), {"apply_rotary": rotary.apply_rotary}),
        Family("kv_cache", paged_kv, paged_kv.SUPPORT, (paged_kv.KERNEL,), {"store_kv": paged_kv.store_kv}),
        Family("paged_attention", paged_attention, paged_attention.SUPPORT,
               (paged_attention.PREFILL, paged_attention.DECODE_SPLIT, paged_attention.DECODE_REDUCE,
                paged_attention.DECODE),
               {"paged_prefill": paged_attention.paged_prefill, "paged_decode": paged_attention.paged_decode}),
        Family("lora", lora_kernels, lora_kernels.SUPPORT, (lora_kernels.SHRINK, lora_kernels.EXPAND),
               {"lora_shrink": lora_kernels.lora_shrink, "lora_expand": lora_kernels.lora_expand}),
    )
}

KERNELS: dict[str, KernelDef] = {k.name: k for f in FAMILIES.values() for k in f.kernels}
# op name ("w4a16_linear", "paged_decode", ...) -> op function, over every family
OPS: dict[str, Callable[..., Any]] = {name: op for f in FAMILIES.values() for name, op in f.ops.items()}


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
