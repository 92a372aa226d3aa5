"""How much memory the layer-wise pipeline needs, and where the calibration activations go.

One home for the estimate: `doctor` prints it before a run, `quantize --offload auto` decides
from it whether the activations stay on the GPU, and `benchmarks/calibration_scale.py` sets it
beside the measured peak. The terms follow the pipeline's code (calibration/pipeline.py), phase
by phase, because the peak is the larger of two phases that never overlap:

- embeddings: the table in its stored dtype (rows are gathered before widening, so there is no
  float32 copy of it), plus the calibration hidden states being made;
- layers: one decoder layer in float32 (plus its stored-dtype tensors while it is widened), the
  codes and scales of its quantized linears, the largest linear's quantization temporaries, the
  calibration activations the pass keeps, and the method's statistics (GPTQ: one Hessian per
  distinct input and the inverse-Hessian factorization of the largest one).
"""

from __future__ import annotations

from typing import Any

import torch

from lmfoundry.model.config import ModelConfig

FLOAT = 4  # the pipeline calibrates in float32


def _dtype_bytes(dtype: Any) -> int:
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    return {"float32": 4, "float16": 2, "bfloat16": 2}.get(str(dtype).replace("torch.", ""), 4)


def activation_bytes(config: ModelConfig, num_samples: int, seq_len: int, batch_size: int,
                     method: str | None) -> dict[str, int]:
    """The calibration activations one process holds at a layer's peak: hidden states (inputs
    and outputs, plus the float outputs of a two-pass method) and one batch's intermediates (the
    MLP's, and one chunk of attention scores)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    tokens = num_samples * seq_len
    sequential = method == "gptq"  # one pass: the residual stream, one group's inputs, the MLP's
    copies = 2 if sequential else 3
    parts = {"hidden_states": copies * tokens * h * FLOAT}
    if sequential:
        parts["mlp_inputs"] = tokens * i * FLOAT  # gate/up outputs of every batch, before down_proj
    b = min(batch_size, num_samples)
    parts["batch_intermediates"] = b * seq_len * (3 * i + 4 * config.num_heads * d) * FLOAT \
        + b * config.num_heads * seq_len * seq_len * FLOAT
    return parts


def calibration_bytes(config: ModelConfig, method: str | None, num_samples: int, seq_len: int,
                      batch_size: int, needs_data: bool, source_dtype: Any = "float32",
                      offloaded: bool = False) -> dict[str, int]:
    """Estimated peak memory of one pipeline process (host RAM on CPU): the two phases' parts,
    `embedding_phase`, `layer_phase` and their maximum, `total`. With `offloaded` (a GPU run whose
    activations live in host memory) the activations are left out: this is the device's share."""
    h, i = config.hidden_size, config.intermediate_size
    sb = _dtype_bytes(source_dtype)
    shapes = config.linear_shapes.values()
    linear_params = sum(o * k for o, k in shapes)
    layer_params = linear_params + 2 * h
    largest = max(o * k for o, k in shapes)
    acts = activation_bytes(config, num_samples, seq_len, batch_size, method) if needs_data and not offloaded else {}
    parts: dict[str, int] = {
        "embedding": config.vocab_size * h * sb,
        "layer_float32": layer_params * FLOAT,
        # widening to float32 keeps the stored-dtype tensors until the layer is built
        "layer_source": layer_params * sb if sb != FLOAT else 0,
        # int8 codes of every quantized linear of the layer, before packing
        "codes": linear_params,
        # the largest linear: its float32 copy being quantized and its dequantized replacement
        "largest_linear": 2 * largest * FLOAT,
        **acts,
    }
    if method == "gptq" and needs_data:
        inputs = {h, config.num_heads * config.head_dim, i}
        parts["hessians"] = (sum(k * k for k in inputs) + h * h) * FLOAT  # + the K/V attention-weighted one
        # factoring the largest Hessian: the damped copy, its Cholesky factor and the inverse factor
        parts["inverse_hessian"] = 3 * max(inputs) ** 2 * FLOAT
    embed_phase = parts["embedding"] + (acts.get("hidden_states", 0) // 3 if acts else 0)
    layer_phase = sum(v for k, v in parts.items() if k != "embedding")
    parts["embedding_phase"] = embed_phase
    parts["layer_phase"] = layer_phase
    parts["total"] = max(embed_phase, layer_phase)
    return parts


def activations_offload(config: ModelConfig, num_samples: int, seq_len: int, batch_size: int,
                        device: torch.device, offload: str = "auto", method: str | None = None) -> bool:
    """Whether calibration activations should live in host memory (`quantize --offload`): never
    on CPU; on a GPU when asked (`yes`) or, for `auto`, when the activations and a layer's working
    set would not fit in 90 % of the GPU's free memory."""
    if device.type == "cpu" or offload == "no":
        return False
    if offload == "yes":
        return True
    need = calibration_bytes(config, method, num_samples, seq_len, batch_size, True)["layer_phase"]
    free, _ = torch.cuda.mem_get_info(device)
    return need > 0.9 * free
