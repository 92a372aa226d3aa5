"""How much memory the layer-wise pipeline needs, and where the calibration activations go.

One home for the estimate: `doctor` prints it before a run, `quantize --offload auto` decides
from it whether the activations stay on the GPU, and `benchmarks/calibration_scale.py` sets it
beside the measured peak. The terms follow the pipeline's code (calibration/pipeline.py), phase
by phase, because the peak is the larger of two phases that never overlap:

- embeddings: the table in its stored dtype (rows are gathered before widening, so there is no
  float32 copy of it), plus the calibration hidden states being made;
- layers: one decoder layer in float32 and the codes of its quantized linears, plus the larger
  of what loading it needs (its stored-dtype tensors while they are widened) and what quantizing
  it needs: the largest linear's quantization temporaries, or for GPTQ the statistics of the
  group of linears being quantized (float64 sums while they accumulate; then the float32
  Hessian, its reordered copy factored in place, and the factor), one group at a time;
  plus the calibration activations the pass keeps.
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
    MLP's, and one chunk of attention scores). An MoE layer runs its experts one at a time, each
    over (at most) every token: one expert's width stands in for the MLP's."""
    h, i, d = config.hidden_size, config.mlp_width, config.head_dim
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


def gptq_statistics_bytes(config: ModelConfig) -> int:
    """GPTQ's statistics at their peak: the group of linears sharing one input that needs most.
    A group of width k with a accumulators (q/k/v has two: plain and attention-weighted) holds a
    float64 sums (8k² each) plus one batch's float32 product (4k²) while it accumulates; reading
    turns one sum at a time into a float32 Hessian, and factoring it adds one reordered copy and
    the factor: (8a + 4)·k² bytes either way (quantizers/hessian.py)."""
    h, i = config.hidden_size, config.mlp_width  # an MoE layer: one expert's statistics at a time
    widths = {"qkv": (h, 2), "o": (config.num_heads * config.head_dim, 1), "gate_up": (h, 1), "down": (i, 1)}
    return max((8 * a + 4) * k * k for k, a in widths.values())


def calibration_bytes(config: ModelConfig, method: str | None, num_samples: int, seq_len: int,
                      batch_size: int, needs_data: bool, source_dtype: Any = "float32",
                      offloaded: bool = False) -> dict[str, int]:
    """Estimated peak memory of one pipeline process (host RAM on CPU): the two phases' parts,
    `embedding_phase`, `layer_phase` and their maximum, `total`. With `offloaded` (a GPU run whose
    activations live in host memory) the activations are left out: this is the device's share."""
    h = config.hidden_size
    sb = _dtype_bytes(source_dtype)
    shapes = config.linear_shapes.values()
    linear_params = sum(o * k for o, k in shapes)
    layer_params = linear_params + 2 * h
    largest = max(o * k for o, k in shapes)
    acts = activation_bytes(config, num_samples, seq_len, batch_size, method) if needs_data and not offloaded else {}
    parts: dict[str, int] = {
        "embedding": config.vocab_size * h * sb,
        "layer_float32": layer_params * FLOAT,
        # int8 codes of every quantized linear of the layer, before packing
        "codes": linear_params,
        # while the layer is built: the stored-dtype tensors being widened (before any codes exist)
        "layer_source": layer_params * sb if sb != FLOAT else 0,
        # the largest linear: its float32 copy being quantized and its dequantized replacement
        "largest_linear": 2 * largest * FLOAT,
        **acts,
    }
    if method == "gptq" and needs_data:
        parts["hessians"] = gptq_statistics_bytes(config)
    work = max(parts["largest_linear"], parts.get("hessians", 0))
    embed_phase = parts["embedding"] + (acts.get("hidden_states", 0) // 3 if acts else 0)
    layer_phase = parts["layer_float32"] + max(parts["layer_source"], parts["codes"] + work) + sum(acts.values())
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
