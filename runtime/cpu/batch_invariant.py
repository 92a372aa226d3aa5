"""The engine's deterministic mode (`serve --deterministic`): a token's arithmetic does not depend
on the batch it is computed in.

Without it, the same greedy request can give another answer (and other logprobs) depending on
what else is scheduled with it, because three things change with the batch:

- linears: oneDNN and BLAS choose their kernel, and so the summation order of every output, by
  the number of rows; the few-row C product serves decode steps only; packed int4/int8 weights
  switch to dequantize-then-GEMM from 128 rows;
- elementwise: PyTorch's vectorized SiLU and its scalar remainder differ in the last bit, and
  which elements fall in the remainder depends on the tensor's size and its split over threads;
  the native SiLU pass only runs from a size on;
- attention: a prompt chunk runs the prefill kernel (or SDPA), a decode the decode kernel, whose
  context partitions follow the batch's size, its longest context and the thread count; a
  prefix-cache hit changes where a prompt's chunks start.

`make_batch_invariant` swaps the model's modules so that each computes a row alone in a fixed
order: every dense linear runs one C product for any row count (`PrepackedLinear` with
`batch_invariant` in bfloat16, `FloatPanelLinear` in float32), packed int4/int8 weights run our C
products (`CProductLinear`, no dense crossover) where they are built and PyTorch's per-row kernels
elsewhere, SiLU(gate) * up runs the C pass at every size. The executor does the
attention part: every row of a step, prompt tokens included, is one query of the decode kernel
over its own context, with partitions fixed by that context (`DecodeBatch.batch_invariant`).
The sampler's reductions (argmax, log-softmax) are per row already. The cost is measured by
benchmarks/deterministic.py.

What has no batch-invariant form here is refused with the reason (`DeterminismUnavailable`):
FP8 activation-quantized linears, float16, attention with a layer-specific spec (Gemma), a
quantized KV cache, machines without the C kernels.
"""

from __future__ import annotations

from torch import nn

from lmfoundry.model.quantized_linear import ActivationQuantizedLinear
from lmfoundry.model.reference import MLP, CausalLM
from lmfoundry.runtime.cpu.dense_linears import PrepackedLinear, PrepackedPart, prepack_dense_linears
from lmfoundry.runtime.cpu.elementwise import swap_native_elementwise
from lmfoundry.runtime.cpu.panel_linears import FloatPanelLinear, panel_float_linears
from lmfoundry.runtime.cpu.weight_only_linears import CProductLinear, Int4PackLinear, Int8PackLinear, prepack_c_products


class DeterminismUnavailable(ValueError):
    """Why this model cannot run batch-invariantly on this machine (the engine refuses it)."""


def _invariant(module: nn.Module) -> bool | None:
    """Whether a linear-like module computes each row alone in a fixed order; None: not a linear."""
    from lmfoundry.kernels.w8a8_reference import QUANT_INT8

    if isinstance(module, PrepackedLinear):
        return module.batch_invariant
    if isinstance(module, (FloatPanelLinear, PrepackedPart)):
        return True
    if isinstance(module, (Int4PackLinear, Int8PackLinear)):
        return module.dense_from is None
    if isinstance(module, CProductLinear):  # each row its own fixed sum, unless switched to the dense GEMM
        return module.dense_from is None
    if isinstance(module, ActivationQuantizedLinear):  # int8: exact integer products, per-token scales
        return module.quant == QUANT_INT8
    if isinstance(module, nn.Linear) or hasattr(module, "in_features"):
        return False
    return None


def make_batch_invariant(model: CausalLM) -> None:
    """Swap `model`'s modules (in place) for their batch-invariant forms, or raise
    `DeterminismUnavailable` naming what has none."""
    import torch

    from lmfoundry.runtime.cpu.native.norm_act import load_norm_act

    dtype = model.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        raise DeterminismUnavailable(f"{dtype} has no batch-invariant kernels here; use bfloat16 or float32")
    try:
        if dtype == torch.bfloat16:
            prepack_dense_linears(model, fuse=True, batch_invariant=True)
            prepack_c_products(model, fuse=True)  # 4/8-bit codes: our C products, never the dense crossover
        else:
            panel_float_linears(model)
    except ValueError as exc:
        raise DeterminismUnavailable(str(exc)) from None
    for m in model.modules():
        if isinstance(m, (Int4PackLinear, Int8PackLinear)):
            m.dense_from = None
    kernel = load_norm_act()
    if kernel is None:
        raise DeterminismUnavailable("the native SiLU kernel is not built (no C compiler, or "
                                     "LMFOUNDRY_NATIVE_KERNELS=0)")
    if dtype == torch.bfloat16:
        swap_native_elementwise(model, batch_invariant=True)
    else:
        from lmfoundry.runtime.cpu.elementwise import NativeSiluMul

        for mlp in (m for m in model.modules() if isinstance(m, MLP) and m.gelu is None):
            mlp.act_mul = NativeSiluMul(kernel, min_elements=0)
    gelu = [name for name, m in model.named_modules() if isinstance(m, MLP) and m.gelu is not None]
    if gelu:
        raise DeterminismUnavailable(f"{gelu[0]}: GELU MLPs have no batch-invariant activation here")
    bad = [(name, m) for name, m in model.named_modules() if _invariant(m) is False]
    if bad:
        name, m = bad[0]
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        if isinstance(m, PrepackedLinear):  # swapped by an engine in the default mode before
            raise DeterminismUnavailable(f"{name}{more} were prepared for the default mode by an earlier engine; "
                                         "load the model again")
        raise DeterminismUnavailable(f"no batch-invariant product for {name} ({m.extra_repr() or type(m).__name__})"
                                     + more)
