"""FP8 W8A8 (e4m3): fp8 weights per channel or per tensor, fp8 activations dynamic or static.

`fp8-dynamic`: weights per output channel (scale = absmax / 448), activations quantized per token
at run time — no calibration data at all. `fp8-static`: weights per tensor, activations per tensor
with a scale calibrated from the layer inputs seen in the pipeline's float pass (`input_scale`).
Weights are rounded to nearest (fp8's own rounding); an `mse` observer may shrink the range.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from lmfoundry.errors import UserError
from lmfoundry.quantformat.scheme import Scheme
from lmfoundry.quantizers.activations import (
    InputRecorder,
    input_recorders,
    needs_static_activations,
    static_input_scales,
)
from lmfoundry.quantizers.base import LayerCalibration, LayerResult, Quantizer
from lmfoundry.quantizers.rtn import float_weight, rtn_quantize_weight


class FP8Quantizer(Quantizer):
    name = "fp8"
    needs_calibration = False  # set per scheme by validate(): only static activations need data

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        unknown = set(self.options)
        if unknown:
            raise UserError(f"fp8 takes no options, got {', '.join(sorted(unknown))}")
        self._recorders: dict[str, InputRecorder] = {}

    def validate(self, scheme: Scheme) -> None:
        w, a = scheme.weights, scheme.input_activations
        if w.type != "float":
            raise UserError(f"method fp8 needs an fp8 scheme (fp8-dynamic, fp8-static); got {scheme.name}")
        if w.strategy not in ("channel", "tensor"):
            raise UserError(f"fp8 weights are per channel or per tensor, got {w.strategy}")
        if a is not None and a.type != "float":
            raise UserError(f"fp8 weights with {a.describe()} activations have no kernel")
        if scheme.needs_activation_calibration:
            self.needs_calibration = True

    def calibration_hooks(self, layer: nn.Module, schemes: dict[str, Scheme], layer_idx: int
                          ) -> dict[str, Callable[[torch.Tensor], None]]:
        if not needs_static_activations(schemes):
            return {}
        names = [n for n, s in schemes.items() if s.needs_activation_calibration]
        self._recorders, hooks = input_recorders(names)
        return hooks

    @torch.no_grad()
    def quantize_layer(self, layer: nn.Module, schemes: dict[str, Scheme], calib: LayerCalibration | None,
                       layer_idx: int) -> LayerResult:
        weights = {n: rtn_quantize_weight(float_weight(layer, n), s.weights, self.scale_dtype)
                   for n, s in schemes.items()}
        extra: dict[str, torch.Tensor] = {}
        if needs_static_activations(schemes):
            if not self._recorders:
                if calib is None:
                    raise UserError("fp8-static needs calibration data for its activation scales")
                calib.run(layer, hooks=self.calibration_hooks(layer, schemes, layer_idx))
            extra = static_input_scales(schemes, self._recorders, self.scale_dtype)
            self._recorders = {}
        return LayerResult(weights, extra_tensors=extra)
