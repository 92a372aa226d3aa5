"""What the engine really executes, in words: the weight format of the loaded model, read from its
modules after the serving swaps (`ReferenceModelExecutor`), not from the flags that asked for it.

A decoder linear is described by its stored scheme (`w4a16 g64`, `w8a8 per-channel`, or the
execution dtype for a float weight) and the form it runs in: `int4 C product` and `int8 C product`
(our C kernels, AVX-512 BF16 CPUs), `int4pack` / `int8pack` (PyTorch's kernels), `int8 GEMM` /
`fp8 exact products` (W8A8 / FP8), `dequantized` (a quantized weight served dense, as
`--dtype float32` keeps it), `compiled step` (an `--arch cpu` AOTInductor package), or an engine
bundle's kernels on a GPU. `serve` prints it at start-up, /v1/models and /metrics export it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from lmfoundry.model.quantized_linear import ActivationQuantizedLinear
from lmfoundry.quantformat.scheme import Scheme
from lmfoundry.runtime.cpu.dense_linears import FusedPrepackedLinear, PrepackedLinear, PrepackedPart
from lmfoundry.runtime.cpu.weight_only_linears import CProductLinear, Int4PackLinear, Int8PackLinear

SHORT_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
KERNEL_MODES = {"cubin": "cubins", "jit": "Triton JIT", "interpret": "Triton interpreter",
                "reference": "PyTorch kernel references"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def scheme_label(scheme: Scheme) -> str:
    """A stored scheme in the CLI's words: `w4a16 g64`, `w8a16 per-channel asym`, `w8a8 per-channel`,
    `fp8 per-tensor static`."""
    w, a = scheme.weights, scheme.input_activations
    how = f"g{w.group_size}" if w.strategy == "group" else f"per-{w.strategy}"
    name = f"fp8 {how}" if w.type == "float" else f"w{w.num_bits}a{a.num_bits if a is not None else 16} {how}"
    extra = [word for word, on in (("asym", not w.symmetric), ("act-order", bool(w.actorder)),
                                   ("static", a is not None and not a.dynamic)) if on]
    return " ".join([name, *extra])


def _form(module: nn.Module) -> str | None:
    """How one linear module computes (None: not a linear, or a fused whole counted by its parts)."""
    if isinstance(module, PrepackedPart):
        return _form(module.fused) if not isinstance(module.fused, FusedPrepackedLinear) else "bf16 dense"
    if isinstance(module, CProductLinear):
        return f"{module.kind} C product"
    if isinstance(module, FusedPrepackedLinear):
        return None  # its PrepackedParts are the linears
    if isinstance(module, PrepackedLinear):
        return "bf16 dense"
    if isinstance(module, Int4PackLinear):
        return "int4pack"
    if isinstance(module, Int8PackLinear):
        return "int8pack"
    if isinstance(module, ActivationQuantizedLinear):
        return "int8 GEMM" if module.weight.dtype == torch.int8 else "fp8 exact products"
    if isinstance(module, nn.Linear):
        return f"{SHORT_DTYPE.get(module.weight.dtype, dtype_name(module.weight.dtype))} dense"
    return None


def _fused_whole(module: nn.Module) -> bool:
    return isinstance(module, FusedPrepackedLinear) or (isinstance(module, CProductLinear) and len(module.sizes) > 1)


def _reference_labels(model: Any) -> Counter[str]:
    """One label per decoder linear of a reference `CausalLM` (the LM head and embeddings are left
    out: they stay dense in every format)."""
    schemes: dict[str, Scheme] = getattr(model, "stored_schemes", {})  # set by runtime.loader
    compiled = getattr(model, "compiled_step", None) is not None
    dtype = SHORT_DTYPE.get(model.dtype, dtype_name(model.dtype))
    labels: Counter[str] = Counter()
    for name, module in model.named_modules():
        if not name.startswith("model.layers.") or _fused_whole(module):
            continue
        form = _form(module)
        if form is None:
            continue
        scheme = schemes.get(name)
        if compiled:
            labels[f"{scheme_label(scheme) if scheme else f'{dtype} dense'} (compiled step)"] += 1
        elif scheme is None:
            labels[form] += 1
        elif form.endswith(" dense"):
            labels[f"{scheme_label(scheme)} (dequantized to {form})"] += 1
        else:
            labels[f"{scheme_label(scheme)} ({form})"] += 1
    return labels


def _bundle_labels(model: Any) -> Counter[str]:
    """A GPU engine bundle's `KernelModel`: its linears' schemes as compile recorded them, and the
    kernels that run them (cubins for this GPU's arch, Triton JIT, or the references)."""
    from lmfoundry.gpus import ARCH_OF_CAPABILITY

    kernels = model.kernels
    where = KERNEL_MODES.get(kernels.mode, kernels.mode)
    device = torch.device(model.device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where += f", {ARCH_OF_CAPABILITY.get(major * 10 + minor, f'sm_{major}{minor}')}"
    dense = f"{SHORT_DTYPE.get(model.dtype, dtype_name(model.dtype))} dense"
    labels: Counter[str] = Counter()
    for name, record in (kernels.manifest.get("linears") or {}).items():  # one GEMM a layer (q/k/v fused: one)
        if name != "lm_head":
            scheme = record.get("scheme", "dense")
            labels[f"{dense if scheme == 'dense' else scheme} (engine bundle: {where})"] += model.config.num_layers
    return labels or Counter({f"engine bundle ({where})": 1})


def describe_weights(model: Any) -> str:
    """The weight format in effect, e.g. `w4a16 g64 (int4 C product)` or `bf16 dense`; a model of
    several formats lists each, most common first, with its count (`... x168; bf16 dense x42`)."""
    tp = getattr(model, "tp", 1)
    model = getattr(model, "local", model)  # a tensor-parallel model: rank 0's share, as every rank's
    labels = _bundle_labels(model) if hasattr(model, "kernels") else _reference_labels(model)
    if not labels:
        return "no linears"
    if len(labels) == 1:
        text = next(iter(labels))
    else:
        text = "; ".join(f"{label} x{count}" for label, count in labels.most_common())
    return f"{text}, split over {tp} ranks" if tp > 1 else text


def runtime_form(model: Any, dtype: torch.dtype) -> dict[str, Any]:
    """`EngineInfo`'s description of what runs: execution dtype, device, the CPU kernels' vector
    path (on a CPU) and the weight format."""
    from lmfoundry.runtime.cpu.isa import isa

    local = getattr(model, "local", model)
    device = torch.device(local.device) if hasattr(local, "kernels") else local.device
    return {"dtype": dtype_name(dtype), "device": str(device), "cpu_isa": isa() if device.type == "cpu" else None,
            "weight_format": describe_weights(model)}
