"""Round-to-nearest: each weight group quantized independently with its observer's qparams.

Data-free (no calibration passes), so it is the fast baseline every other method must beat.
"""

from __future__ import annotations

import torch
from torch import nn

from lmfoundry.quantformat import qmath
from lmfoundry.quantformat.quantized_weight import QuantizedWeight
from lmfoundry.quantformat.scheme import QuantArgs, Scheme
from lmfoundry.quantizers.base import LayerCalibration, LayerResult, Quantizer, weight_error
from lmfoundry.quantizers.observers import weight_observer


def rtn_quantize_weight(w: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype) -> QuantizedWeight:
    """Quantize one weight matrix [out, in] with the observer named in `args`."""
    scale, zp = weight_observer(args.observer)(w, args, scale_dtype)
    q = qmath.quantize(w, scale, zp, args)
    qw = QuantizedWeight(q, scale, zp, args)
    qw.metrics["weight_rel_error"] = weight_error(w, qw.dequantize(torch.float32))
    return qw



def float_weight(layer: nn.Module, name: str) -> torch.Tensor:
    """The weight of the float linear `name` of a decoder layer being quantized."""
    lin = layer.get_submodule(name)
    if not isinstance(lin, nn.Linear):
        raise TypeError(f"{name} is a {type(lin).__name__}, not the float linear a quantizer reads")
    return lin.weight.data

class RTNQuantizer(Quantizer):
    name = "rtn"
    needs_calibration = False
    known_options = ()  # round-to-nearest has no knobs: any --option is a mistake

    def quantize_layer(
        self, layer: nn.Module, schemes: dict[str, Scheme], calib: LayerCalibration | None, layer_idx: int
    ) -> LayerResult:
        out = {}
        for name, scheme in schemes.items():
            out[name] = rtn_quantize_weight(float_weight(layer, name), scheme.weights, self.scale_dtype)
        return LayerResult(out)
