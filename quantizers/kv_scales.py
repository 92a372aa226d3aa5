"""KV-cache quantization (INT8 or FP8 e4m3, per tensor or per KV head) with calibrated scales.

The scales come from the layer-wise pipeline: after a layer's weights have been replaced by their
quantized values, its attention is run on the calibration inputs with an observer in the
`kv_round_trip` slot, which records the post-rotary K and V the cache would store. The scale is
absmax / qmax (127 for int8, 448 for fp8), the convention of vLLM and compressed-tensors, and is
written as `model.layers.N.self_attn.k_scale` / `v_scale` (shape [1] per tensor, [Hkv, 1, 1] per
head, compressed-tensors' `attn_head` strategy). The same layer then keeps a real quantize-on-write,
dequantize-on-read round trip for the rest of the pipeline, so the next layer calibrates on the
outputs of attention over a quantized cache.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from lmfoundry.errors import UserError
from lmfoundry.model.kv_quant import (
    check_kv_args,
    kv_round_trip_from_checkpoint,
    kv_scales_from_absmax,
)
from lmfoundry.model.reference import DecoderLayer
from lmfoundry.quantformat.scheme import QuantArgs
from lmfoundry.quantizers.base import LayerCalibration, LayerResult


class KVObserver:
    """Records the absmax of K and V (per tensor or per KV head) and returns them unchanged."""

    def __init__(self, per_head: bool) -> None:
        self.per_head = per_head
        self.k_absmax: torch.Tensor | None = None
        self.v_absmax: torch.Tensor | None = None

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        a = x.detach().float().abs()
        if self.per_head:  # [..., T, Hkv, D] -> [Hkv]
            return a.reshape(-1, x.shape[-2], x.shape[-1]).amax(dim=(0, 2))
        return a.amax().reshape(1)

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ka, va = self._reduce(k), self._reduce(v)
        self.k_absmax = ka if self.k_absmax is None else torch.maximum(self.k_absmax, ka)
        self.v_absmax = va if self.v_absmax is None else torch.maximum(self.v_absmax, va)
        return k, v


def calibrate_kv_scales(layer: DecoderLayer, calib: LayerCalibration, kv_args: QuantArgs,
                        scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale, v_scale) of one decoder layer from its calibration inputs."""
    per_head = check_kv_args(kv_args)
    attn = layer.self_attn
    observer = KVObserver(per_head)
    previous = attn.kv_round_trip
    attn.kv_round_trip = observer
    try:
        calib.run(layer)
    finally:
        attn.kv_round_trip = previous
    if observer.k_absmax is None or observer.v_absmax is None:
        raise RuntimeError("KV calibration saw no data")
    from lmfoundry.distributed import ranks

    ranks().max_(observer.k_absmax)  # over every data-parallel rank's calibration inputs
    ranks().max_(observer.v_absmax)
    return (kv_scales_from_absmax(observer.k_absmax, kv_args.type, scale_dtype, per_head),
            kv_scales_from_absmax(observer.v_absmax, kv_args.type, scale_dtype, per_head))


def kv_calibration_pass(kv_args: QuantArgs, out_dtype: torch.dtype) -> Callable[..., None]:
    """The pipeline's extra layer pass: adds `self_attn.k_scale` / `self_attn.v_scale` to the
    layer's extra tensors and installs the quantized-cache round trip on the layer, so the
    propagated outputs include the KV error."""
    check_kv_args(kv_args)

    def kv_pass(layer: DecoderLayer, calib: LayerCalibration | None, layer_idx: int, result: LayerResult) -> None:
        if calib is None:
            raise UserError("KV cache quantization needs calibration data")
        k_scale, v_scale = calibrate_kv_scales(layer, calib, kv_args, out_dtype)
        result.extra_tensors["self_attn.k_scale"] = k_scale
        result.extra_tensors["self_attn.v_scale"] = v_scale
        result.metrics["kv_cache"] = kv_metrics(k_scale, v_scale, kv_args)
        layer.self_attn.kv_round_trip = kv_round_trip_from_checkpoint(kv_args, k_scale, v_scale)

    return kv_pass


def kv_metrics(k_scale: torch.Tensor, v_scale: torch.Tensor, kv_args: QuantArgs) -> dict[str, Any]:
    return {
        "scheme": kv_args.describe(),
        "k_scale_max": float(k_scale.float().max()),
        "v_scale_max": float(v_scale.float().max()),
        "k_scale_min": float(k_scale.float().min()),
        "v_scale_min": float(v_scale.float().min()),
    }
