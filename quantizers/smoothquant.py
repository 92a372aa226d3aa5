"""SmoothQuant W8A8-INT8 (Xiao et al., arXiv 2211.10438).

Activations of LLMs have a few channels with very large magnitudes, which ruin per-token int8
quantization; weights do not. SmoothQuant moves the difficulty from activations to weights with
a per-input-channel factor s_j = max|X_j|^α / max|W_j|^(1-α): the input is divided by s (folded
into whatever produces it) and the weight columns multiplied by s, so the float function is
unchanged while both operands become easier to quantize.

Where s is folded (each is exact in float arithmetic):
- input_layernorm → q/k/v and the MLP's input norm → gate/up (post_attention_layernorm; Gemma's
  pre_feedforward_layernorm): the norm's applied gain is divided by s (`RMSNorm.divide_gain_`);
  in an MoE layer that norm feeds every expert's gate/up and the float router, all scaled alike;
- v_proj → o_proj: attention output channel (head h, dim j) is a weighted sum of V's channel
  (kv(h), j), so dividing v_proj's output row by s divides that channel. With grouped-query
  attention several query heads read one KV head, so the factor is shared by the group (statistics
  are reduced over it) — that is the "where shapes allow" of the paper, generalised to GQA;
- up_proj → down_proj (each expert's): down's input is silu(gate) * up, linear in up's output channel.

Then W8A8-INT8: int8 weights per output channel (RTN or GPTQ, option `weight_method`), int8
activations dynamic per token or static per tensor (scale calibrated on the smoothed input).

Options: alpha (0.5), alpha_search (false; per layer and mapping, grid `alpha_grid`, minimizing the
quantized output error on a subsample of the calibration inputs), smooth_vo (true), smooth_down
(true), weight_method (rtn|gptq; other options are passed to GPTQ).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from lmfoundry.errors import UserError
from lmfoundry.model.config import QKV, ROUTER
from lmfoundry.model.reference import DecoderLayer, RMSNorm, SparseMoE
from lmfoundry.quantformat import qmath
from lmfoundry.quantformat.scheme import QuantArgs, Scheme
from lmfoundry.quantizers.activations import InputRecorder, input_recorders, static_input_scales
from lmfoundry.quantizers.base import LayerCalibration, LayerResult, Quantizer, construct, get_linear
from lmfoundry.quantizers.gptq import GPTQQuantizer
from lmfoundry.quantizers.observers import weight_observer
from lmfoundry.quantizers.rtn import rtn_quantize_weight

OWN_OPTIONS = ("alpha", "alpha_search", "alpha_grid", "smooth_vo", "smooth_down", "weight_method",
               "search_rows_per_batch")
MIN_SCALE = 1e-5


def smoothing_factors(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^α / max|W_j|^(1-α); 1 where either statistic is zero (nothing to migrate)."""
    a, w = act_absmax.float(), weight_absmax.float()
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    ok = (a > 0) & (w > 0) & torch.isfinite(s)
    return torch.where(ok, s.clamp_min(MIN_SCALE), torch.ones_like(s))


def column_absmax(linears: list[nn.Linear]) -> torch.Tensor:
    """max |W[:, j]| over the rows of all `linears` (which share their input)."""
    return torch.stack([m.weight.detach().float().abs().amax(dim=0) for m in linears]).amax(dim=0)


@dataclass
class Mapping:
    """One smoothing site: the linears whose input is divided by s and how to fold s upstream.

    `expand` maps a factor over the fold site's channels to the balance linears' input channels
    (identity except for GQA v→o); `reduce` maps per-input-channel statistics back."""

    name: str
    balance: list[str]
    fold: Callable[[torch.Tensor], torch.Tensor | None]  # may return the factor really folded
    expand: Callable[[torch.Tensor], torch.Tensor] = lambda s: s
    reduce: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    carry: list[str] = field(default_factory=list)  # float linears scaled alike, not in the statistics (router)


def layer_mappings(layer: DecoderLayer, smooth_vo: bool, smooth_down: bool,
                   storage_dtype: torch.dtype | None = None) -> list[Mapping]:
    """The smoothing sites of one layer. `storage_dtype` (the checkpoint's) lets a norm fold
    report the factor its stored gain really realizes (`RMSNorm.divide_gain_`)."""
    attn, mlp = layer.self_attn, layer.mlp

    def fold_norm(norm: RMSNorm) -> Callable[[torch.Tensor], torch.Tensor]:
        def fold(s: torch.Tensor) -> torch.Tensor:
            # gain w, or Gemma's (1 + w), divided by s; the factor the stored gain realizes
            return norm.divide_gain_(s, storage_dtype)
        return fold

    def fold_rows(linear: nn.Linear) -> Callable[[torch.Tensor], None]:
        def fold(s: torch.Tensor) -> None:
            linear.weight.data = (linear.weight.data.float() / s[:, None]).to(linear.weight.dtype)
            if linear.bias is not None:
                linear.bias.data = (linear.bias.data.float() / s).to(linear.bias.dtype)
        return fold

    moe = isinstance(mlp, SparseMoE)
    prefixes = layer.mlp_prefixes  # "mlp.", or each expert's
    maps = [
        Mapping("input_layernorm", list(QKV),
                fold_norm(layer.input_layernorm)),
        # an MoE norm feeds the router and every expert's gate/up: one factor for all of them
        Mapping(layer.mlp_norm_name, [p + n for p in prefixes for n in ("gate_proj", "up_proj")],
                fold_norm(layer.mlp_norm), carry=[ROUTER] if moe else []),
    ]
    if smooth_vo:
        hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        group = hq // hkv

        def expand(s: torch.Tensor) -> torch.Tensor:  # [Hkv*d] -> [Hq*d], head h reads kv head h // group
            return s.reshape(hkv, 1, d).expand(hkv, group, d).reshape(hq * d)

        def reduce(x: torch.Tensor) -> torch.Tensor:  # [Hq*d] -> [Hkv*d], max over the query group
            return x.reshape(hkv, group, d).amax(dim=1).reshape(hkv * d)

        maps.append(Mapping("v_proj", ["self_attn.o_proj"], fold_rows(attn.v_proj), expand, reduce))
    if smooth_down:
        maps += [Mapping(p + "up_proj", [p + "down_proj"], fold_rows(get_linear(layer, p + "up_proj")))
                 for p in prefixes]
    return maps


def fake_quant_activation(x: torch.Tensor, args: QuantArgs, static_absmax: torch.Tensor | None) -> torch.Tensor:
    """Quantize-dequantize rows of x [N, K] as the runtime will (per token, or per tensor)."""
    if args.dynamic or static_absmax is None:
        absmax = x.abs().amax(dim=-1, keepdim=True)
    else:
        absmax = static_absmax.reshape(1, 1)
    scale = (absmax / args.qmax).clamp_min(torch.finfo(torch.float32).tiny)
    if args.type == "float":
        return (x / scale).clamp(args.qmin, args.qmax).to(qmath.FP8_DTYPE).float() * scale
    return torch.round(x / scale).clamp(args.qmin, args.qmax) * scale


class SmoothQuantQuantizer(Quantizer):
    name = "smoothquant"
    needs_calibration = True

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        o = self.options
        self.weight_method = str(o.get("weight_method", "rtn"))
        if self.weight_method not in ("rtn", "gptq"):
            raise UserError(f"smoothquant weight_method must be rtn or gptq, got {self.weight_method!r}")
        from lmfoundry.quantizers.gptq import GPTQQuantizer

        known = set(OWN_OPTIONS) | (set(GPTQQuantizer.known_options or ()) if self.weight_method == "gptq" else set())
        unknown = set(o) - known
        if unknown:
            raise UserError(f"smoothquant: unknown option(s) {', '.join(sorted(unknown))}; known: "
                            f"{', '.join(sorted(known))}")
        self.alpha = float(o.get("alpha", 0.5))
        if not 0.0 <= self.alpha <= 1.0:
            raise UserError(f"smoothquant alpha must be in [0, 1], got {self.alpha}")
        self.alpha_search = bool(o.get("alpha_search", False))
        self.alpha_grid = [float(a) for a in o.get("alpha_grid", [i / 10 for i in range(11)])]
        self.smooth_vo = bool(o.get("smooth_vo", True))
        self.smooth_down = bool(o.get("smooth_down", True))
        self.rows_per_batch = int(o.get("search_rows_per_batch", 64))
        self._weight_quantizer: Quantizer | None = None
        self._recorders: dict[str, InputRecorder] = {}

    @property
    def weight_quantizer(self) -> Quantizer | None:
        """GPTQ (built lazily, with every option that is not SmoothQuant's), or None for RTN."""
        if self.weight_method == "gptq" and self._weight_quantizer is None:
            rest = {k: v for k, v in self.options.items() if k not in OWN_OPTIONS}
            self._weight_quantizer = construct(GPTQQuantizer, rest)
        return self._weight_quantizer

    def validate(self, scheme: Scheme) -> None:
        w, a = scheme.weights, scheme.input_activations
        if w.type != "int" or w.num_bits != 8 or a is None or a.type != "int" or a.num_bits != 8:
            raise UserError(f"smoothquant produces W8A8-INT8 (--scheme w8a8); got scheme {scheme.name}")
        if not w.symmetric or not a.symmetric:
            raise UserError("smoothquant W8A8 is symmetric (the int8 kernels have no weight zero points)")
        if w.strategy not in ("channel", "tensor"):
            raise UserError(f"W8A8 weights are per channel or per tensor, got {w.strategy}")
        if self.weight_quantizer is not None:
            self.weight_quantizer.validate(scheme)

    def calibration_hooks(self, layer: DecoderLayer, schemes: dict[str, Scheme], layer_idx: int
                          ) -> dict[str, Callable[[torch.Tensor], None]]:
        rows = self.rows_per_batch if self.alpha_search else 0
        self._recorders, hooks = input_recorders(list(layer.linear_names), rows)
        return hooks

    @torch.no_grad()
    def quantize_layer(self, layer: DecoderLayer, schemes: dict[str, Scheme], calib: LayerCalibration | None,
                       layer_idx: int) -> LayerResult:
        if not self._recorders or any(r.absmax is None for r in self._recorders.values()):
            if calib is None:
                raise UserError("smoothquant needs calibration data")
            hooks = self.calibration_hooks(layer, schemes, layer_idx)
            calib.run(layer, hooks=hooks)
        recorders = self._recorders
        metrics: dict[str, Any] = {"smoothing": {}}
        divisors: dict[str, torch.Tensor] = {}
        for m in layer_mappings(layer, self.smooth_vo, self.smooth_down, self.scale_dtype):
            balance = [get_linear(layer, n) for n in m.balance]
            # max over the recorders of the balance linears: MoE experts each record their own tokens
            act = m.reduce(torch.stack([recorders[n].channel_absmax() for n in m.balance]).amax(0))
            wmax = m.reduce(column_absmax(balance))
            alpha = self.alpha
            if self.alpha_search:
                alpha = self._search_alpha(m, balance, recorders[m.balance[0]], act, wmax, schemes)
            s = smoothing_factors(act, wmax, alpha)
            realized = m.fold(s)
            s = realized if realized is not None else s
            s_in = m.expand(s)
            for lin in balance + [get_linear(layer, n) for n in m.carry]:
                lin.weight.data = (lin.weight.data.float() * s_in[None, :]).to(lin.weight.dtype)
            for n in m.balance:
                divisors[n] = s_in
            metrics["smoothing"][m.name] = {"alpha": alpha, "s_max": float(s.max()), "s_min": float(s.min()),
                                            "act_absmax_before": float(act.max()),
                                            "act_absmax_after": float((act / s).max())}

        weights = self._quantize_weights(layer, schemes, calib, layer_idx)
        extra = static_input_scales(schemes, recorders, self.scale_dtype, divisors)
        self._recorders = {}
        return LayerResult(weights, extra_tensors=extra, metrics=metrics)

    def _quantize_weights(self, layer: DecoderLayer, schemes: dict[str, Scheme], calib: LayerCalibration | None,
                          layer_idx: int) -> dict:
        wq = self.weight_quantizer
        if wq is None:
            return {n: rtn_quantize_weight(get_linear(layer, n).weight.data, s.weights, self.scale_dtype)
                    for n, s in schemes.items()}
        # GPTQ needs Hessians of the *smoothed* inputs: one more pass through the smoothed layer
        # (its float function is unchanged, only the linears' inputs are rescaled).
        wq.scale_dtype = self.scale_dtype
        wq.calib = calib
        if wq.needs_calibration and calib is not None:
            calib.run(layer, hooks=wq.calibration_hooks(layer, schemes, layer_idx))
        return wq.quantize_layer(layer, schemes, calib, layer_idx).weights

    def _search_alpha(self, m: Mapping, balance: list[nn.Linear], rec: InputRecorder, act: torch.Tensor,
                      wmax: torch.Tensor, schemes: dict[str, Scheme]) -> float:
        """α of the grid minimizing Σ ||Q(X/s) Q(W s)^T - X W^T||² over the balance linears."""
        x = rec.sample()
        if x.numel() == 0:
            return self.alpha
        targets = [(n, lin, x @ lin.weight.detach().float().t()) for n, lin in zip(m.balance, balance, strict=True)]
        best, best_err = self.alpha, float("inf")
        for alpha in self.alpha_grid:
            s_in = m.expand(smoothing_factors(act, wmax, alpha))
            xs = x / s_in
            err = 0.0
            for n, lin, y in targets:
                scheme = schemes.get(n)
                if scheme is None:  # not quantized: smoothing cannot hurt or help it
                    continue
                w = lin.weight.detach().float() * s_in[None, :]
                scale, zp = weight_observer(scheme.weights.observer)(w, scheme.weights, torch.float32)
                w_hat = qmath.fake_quantize(w, scale, zp, scheme.weights)
                static = (rec.channel_absmax() / s_in).amax() if scheme.needs_activation_calibration else None
                assert scheme.input_activations is not None  # validate() admits W8A8 schemes only
                x_hat = fake_quant_activation(xs, scheme.input_activations, static)
                err += float((x_hat @ w_hat.t() - y).pow(2).sum())
            if err < best_err:
                best, best_err = alpha, err
        return best
