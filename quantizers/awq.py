"""AWQ (Lin et al., arXiv 2306.00978): protect the weight channels that see large activations by
scaling them up before quantization and folding the inverse scale into the op that produces the
input, so the float function of the model is unchanged and only the rounding error moves.

How this implementation searches, and why:
- Statistics come from the pipeline's float pass through hooks: per input channel mean |x| and the
  input second moment H = 2·XᵀX/N of each group of linears sharing an input (q/k/v, gate/up,
  o_proj, down_proj).
- The paper's objective ‖Q(W·s)(s⁻¹X) − WX‖² equals tr(ΔW H ΔWᵀ) with ΔW = W − Q(W·s)/s, so each
  candidate scale is scored exactly over *every* calibration token at a cost independent of the
  number of tokens (no repeated forward passes). Candidates: s = mean|x|^α (the paper) and
  s = mean|x|^α / mean|w|^(1−α) (the "duo" variant llm-compressor uses), α on a grid of `n_grid`
  (20) values; the best of both families wins.
- Folding: input_layernorm → q/k/v, the MLP's input norm (post_attention_layernorm; Gemma's
  pre_feedforward_layernorm) → gate/up (in an MoE layer: every expert's gate/up, one scale,
  searched on their pooled statistics, and the float router's columns scaled alike),
  up_proj → down_proj (per expert), and v_proj → o_proj. The last one also works with grouped-query attention: a v channel feeds the
  same channel of every query head sharing its KV head, so o_proj's columns take the v scale
  repeated per head.
- Clipping: per (row, group), shrink the range by p ∈ [0.5, 1] (n_grid steps) and keep the one
  with the least output error of that group, tr(Δ_g H_gg Δ_gᵀ); the weight observer's own qparams
  are a candidate too, so a better observer can only help. q/k are not clipped (their errors are
  amplified by the softmax, as the AWQ authors note).
The output is the same pack-quantized checkpoint as RTN/GPTQ: AWQ only chooses better scales.

- Optionally (`kv_attention_weights=true`) k_proj/v_proj's H weights each token by the attention
  it receives, as GPTQ does by default (see `hessian.received_attention`); for AWQ it measured no
  clear gain, so it is off.

Options: n_grid (20), duo_scaling (both | true | false; default both), clip (true), token_cap (10,
as in GPTQ: caps the weight of massive-activation tokens in H, not in the channel magnitudes),
kv_attention_weights (false).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from lmfoundry.errors import UserError
from lmfoundry.model.config import QKV, ROUTER
from lmfoundry.model.reference import DecoderLayer, RMSNorm
from lmfoundry.quantformat import qmath
from lmfoundry.quantformat.quantized_weight import QuantizedWeight
from lmfoundry.quantformat.scheme import QuantArgs, Scheme
from lmfoundry.quantizers.base import (
    LayerCalibration,
    LayerResult,
    Quantizer,
    get_linear,
    weight_error,
)
from lmfoundry.quantizers.hessian import DEFAULT_TOKEN_CAP, cap_token_energy, group_statistics
from lmfoundry.quantizers.observers import weight_observer

NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")


class InputStats:
    """Per-channel Σ|x| and Σ xᵀx of one linear input over the calibration tokens."""

    def __init__(self, token_cap: float = 0.0) -> None:
        self.abs_sum: torch.Tensor | None = None
        self.xtx: torch.Tensor | None = None
        self.count = 0
        self.token_cap = token_cap
        self.reduced = False  # summed over data-parallel ranks (once, when first read)

    @torch.no_grad()
    def add(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add the rows of x; `weights` (one per row, mean ~1) weight them in the error objective."""
        if self.reduced:
            raise RuntimeError("InputStats.add after the statistics were read")
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if self.xtx is None:
            self.xtx = torch.zeros(x.shape[1], x.shape[1])
            self.abs_sum = torch.zeros(x.shape[1])
        assert self.abs_sum is not None  # allocated with xtx
        self.abs_sum += x.abs().sum(0)
        xc = cap_token_energy(x, self.token_cap)  # the error objective, not the magnitudes
        if weights is not None:
            xc = xc * weights.reshape(-1, 1).float().sqrt()
        self.xtx.addmm_(xc.t(), xc)
        self.count += x.shape[0]

    def _reduce(self) -> None:
        from lmfoundry.distributed import ranks

        if self.reduced:
            return
        self.reduced = True
        group = ranks()
        self.count = int(group.sum_number(self.count))
        if self.xtx is not None and self.abs_sum is not None:
            group.sum_(self.xtx)
            group.sum_(self.abs_sum)

    def mean_abs(self) -> torch.Tensor:
        self._reduce()
        if self.abs_sum is None:
            raise RuntimeError("no calibration inputs reached this linear")
        return self.abs_sum / max(self.count, 1)

    def hessian(self) -> torch.Tensor:
        self._reduce()
        if self.xtx is None or self.count == 0:
            raise RuntimeError("no calibration inputs reached this linear")
        return self.xtx * (2.0 / self.count)


@dataclass
class Mapping:
    """One smoothing: scales over `prev`'s output channels, folded into `prev`, multiplied into
    the input columns of `linears`; `stats_of` names the linear(s) whose input statistics apply
    (an MoE norm feeds every expert, each with its own tokens: their statistics are pooled).
    `carry` are float linears reading the same input (the MoE router): their columns take the
    scale too, so the function is unchanged, but they do not steer the search."""

    prev: str
    linears: tuple[str, ...]
    stats_of: tuple[str, ...]
    carry: tuple[str, ...] = ()


def layer_mappings(schemes: dict[str, Scheme], mlp_norm: str = "post_attention_layernorm",
                   mlp_prefixes: tuple[str, ...] = ("mlp.",)) -> list[Mapping]:
    """The smoothings that apply to the quantized linears present (in layer order); `mlp_norm`
    names the norm feeding gate/up (`DecoderLayer.mlp_norm_name`). In a sparse MoE layer
    (`mlp_prefixes`: one per expert) that norm feeds the router and every expert's gate/up, and
    each expert's up_proj feeds its down_proj."""
    have = set(schemes)
    out = []
    qkv = tuple(n for n in QKV if n in have)
    if qkv:
        out.append(Mapping("input_layernorm", qkv, qkv[:1]))
    if "self_attn.o_proj" in have:
        out.append(Mapping("self_attn.v_proj", ("self_attn.o_proj",), ("self_attn.o_proj",)))
    moe = mlp_prefixes != ("mlp.",)
    gu = tuple(p + n for p in mlp_prefixes for n in ("gate_proj", "up_proj") if p + n in have)
    if gu:
        out.append(Mapping(mlp_norm, gu, gu, (ROUTER,) if moe else ()))
    out += [Mapping(p + "up_proj", (p + "down_proj",), (p + "down_proj",)) for p in mlp_prefixes
            if p + "down_proj" in have]
    return out


def pooled_mean_abs(stats: list[InputStats]) -> torch.Tensor:
    """Mean |x| per channel over the tokens of several statistics (each counted once)."""
    distinct = list({id(st): st for st in stats}.values())
    total = cast(torch.Tensor, sum(st.mean_abs() * st.count for st in distinct))  # `stats` is never empty
    return total / max(sum(st.count for st in distinct), 1)


def _fake_quant(w: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype) -> torch.Tensor:
    scale, zp = weight_observer(args.observer)(w, args, scale_dtype)
    return qmath.dequantize(qmath.quantize(w, scale, zp, args), scale, zp, args, torch.float32)


def output_error(dw: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """tr(ΔW H ΔWᵀ): the squared output error summed over calibration tokens (up to 2/N)."""
    return ((dw @ h) * dw).sum()


@torch.no_grad()
def search_scales(weights: list[torch.Tensor], args: list[QuantArgs], h: torch.Tensor | list[torch.Tensor],
                  x_mean: torch.Tensor, scale_dtype: torch.dtype, n_grid: int = 20, duo: str = "both",
                  expand: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Best per-channel scale s (over the channels of x_mean) for the given linears.

    `h` is the input second moment of the linears, or one per linear (k/v weighted by received
    attention, q not). `expand` (index tensor) maps the linears' input columns to scale channels
    when one scale covers several columns (v → o under grouped-query attention)."""
    hs = h if isinstance(h, list) else [h] * len(weights)
    x_mean = x_mean.float().clamp_min(1e-8)
    rel = [w.abs() / w.abs().amax(1, keepdim=True).clamp_min(1e-12) for w in weights]
    w_mean = torch.cat(rel, 0).mean(0)  # normalized weight magnitude per input column
    if expand is not None:  # average the columns sharing one scale
        w_mean = torch.zeros_like(x_mean).index_add_(0, expand, w_mean) / torch.bincount(expand, minlength=x_mean.numel())
    w_mean = w_mean.clamp_min(1e-8)
    base = sum(output_error(w - _fake_quant(w, a, scale_dtype), hw) for w, a, hw in zip(weights, args, hs, strict=True))
    best = (float(base), torch.ones_like(x_mean), 0.0, "none")
    families = {"both": (False, True), "true": (True,), "false": (False,)}[str(duo).lower()]
    for use_w in families:
        for k in range(n_grid):
            alpha = k / n_grid
            s = x_mean.pow(alpha) / w_mean.pow(1 - alpha) if use_w else x_mean.pow(alpha)
            s = s / (s.max() * s.min()).sqrt()
            if not torch.isfinite(s).all() or (s <= 0).any():
                continue
            cols = s[expand] if expand is not None else s
            err: float | torch.Tensor = 0.0
            for w, a, hw in zip(weights, args, hs, strict=True):
                ws = w * cols
                err = err + output_error(w - _fake_quant(ws, a, scale_dtype) / cols, hw)
            if float(err) < best[0]:
                best = (float(err), s, alpha, "duo" if use_w else "act")
    err, s, alpha, family = best
    return s, {"awq_alpha": alpha, "awq_duo": float(family == "duo"), "awq_rel_gain": 1 - err / max(float(base), 1e-30)}


@torch.no_grad()
def clip_qparams(w: torch.Tensor, args: QuantArgs, h: torch.Tensor, scale_dtype: torch.dtype,
                 n_grid: int = 20, max_shrink: float = 0.5) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per (row, group) qparams minimizing the group's output error tr(Δ H_gg Δᵀ), among the
    observer's own and min/max ranges shrunk by p ∈ [1 − max_shrink, 1]."""
    rows, cols = w.shape
    if args.strategy == "group":
        assert args.group_size is not None  # QuantArgs requires one for "group"
        gs = int(args.group_size)
    else:
        gs = cols
    ngroups = cols // gs
    hb = torch.stack([h[g * gs:(g + 1) * gs, g * gs:(g + 1) * gs] for g in range(ngroups)])  # [G, gs, gs]

    def group_err(scale: torch.Tensor, zp: torch.Tensor | None) -> torch.Tensor:
        d = (w - qmath.dequantize(qmath.quantize(w, scale, zp, args), scale, zp, args, torch.float32))
        d = d.reshape(rows, ngroups, gs).transpose(0, 1)  # [G, rows, gs]
        return (torch.bmm(d, hb) * d).sum(-1).t()  # [rows, G]

    best_s, best_z = weight_observer(args.observer)(w, args, scale_dtype)
    best_e = group_err(best_s, best_z)
    x = w.reshape(rows, ngroups, gs)
    lo, hi = x.amin(-1), x.amax(-1)
    steps = int(round(n_grid * max_shrink))
    for i in range(steps + 1):
        p = 1.0 - i * max_shrink / max(steps, 1)
        s, z = qmath.qparams_from_range(lo * p, hi * p, args, scale_dtype)
        s = s.reshape(rows, ngroups)
        z = z.reshape(rows, ngroups) if z is not None else None
        e = group_err(s, z)
        better = e < best_e
        best_e = torch.where(better, e, best_e)
        best_s = torch.where(better, s, best_s)
        if z is not None:
            assert best_z is not None  # the observer's zero points exist exactly when the range's do
            best_z = torch.where(better, z, best_z)
    return best_s, best_z


class AWQQuantizer(Quantizer):
    name = "awq"

    known_options = ("n_grid", "duo_scaling", "clip", "token_cap", "kv_attention_weights")

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        self.n_grid = int(self.options.get("n_grid", 20))
        self.duo = str(self.options.get("duo_scaling", "both")).lower()
        if self.duo not in ("both", "true", "false") or self.n_grid < 1:
            raise UserError("awq: duo_scaling must be both|true|false and n_grid >= 1")
        self.clip = self.flag("clip", True)
        self.token_cap = float(self.options.get("token_cap", DEFAULT_TOKEN_CAP))
        # off by default: unlike GPTQ, AWQ showed no clear perplexity gain from it (better at one
        # calibration size, worse at another), and it costs an attention pass per batch
        self.kv_attention_weights = self.flag("kv_attention_weights", False)
        self._stats: dict[str, InputStats] = {}

    def validate(self, scheme: Scheme) -> None:
        if scheme.weights.type != "int" or scheme.input_activations is not None:
            raise UserError(f"awq produces integer weight-only schemes (wNa16), not {scheme.name}")

    def calibration_hooks(self, layer: nn.Module, schemes: dict[str, Scheme], layer_idx: int):
        # with kv_attention_weights, k/v's error objective weights each token by the attention it
        # receives (see hessian.received_attention); q's and the channel magnitudes stay per token
        self._stats, hooks = group_statistics(layer, schemes, self.calib, lambda: InputStats(self.token_cap),
                                              self.kv_attention_weights)
        return hooks

    @torch.no_grad()
    def smooth_layer(self, layer: DecoderLayer, schemes: dict[str, Scheme]) -> dict[str, dict[str, float]]:
        """Search and fold the smoothing scales into `layer` (float function unchanged). Returns
        per-mapping metrics. The stored statistics are rescaled to the smoothed inputs."""
        metrics: dict[str, dict[str, float]] = {}
        attn = layer.self_attn
        for m in layer_mappings(schemes, layer.mlp_norm_name, layer.mlp_prefixes):
            x_mean = pooled_mean_abs([self._stats[n] for n in m.stats_of])
            h = [self._stats[n].hessian() for n in m.linears]
            expand = None
            if m.prev == "self_attn.v_proj":
                # o_proj column (head h, dim d) reads v channel (h // rep, d)
                rep = attn.num_heads // attn.num_kv_heads
                heads = torch.arange(attn.num_heads).repeat_interleave(attn.head_dim) // rep
                expand = heads * attn.head_dim + torch.arange(attn.head_dim).repeat(attn.num_heads)
                x_mean = torch.zeros(attn.num_kv_heads * attn.head_dim).index_add_(0, expand, x_mean) / rep
            weights = [get_linear(layer, n).weight.data.float() for n in m.linears]
            args = [schemes[n].weights for n in m.linears]
            s, info = search_scales(weights, args, h, x_mean, self.scale_dtype, self.n_grid, self.duo, expand)
            s = self._fold(layer, m.prev, s, self.scale_dtype)  # the factor the stored tensors realize
            cols = s[expand] if expand is not None else s
            for n in m.linears + m.carry:
                lin = get_linear(layer, n)
                lin.weight.data = (lin.weight.data.float() * cols).to(lin.weight.dtype)
            # the linears now read x / s: rescale the statistics they share
            for shared in {id(self._stats[n]): self._stats[n] for n in m.linears}.values():
                assert shared.xtx is not None and shared.abs_sum is not None  # read by hessian() above
                shared.xtx = shared.xtx / torch.outer(cols, cols)
                shared.abs_sum = shared.abs_sum / cols
            metrics[f"{m.prev}->{'+'.join(n.split('.')[-1] for n in m.linears)}"] = info
        return metrics

    @staticmethod
    def _fold(layer: nn.Module, prev: str, s: torch.Tensor, storage_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Divide the output channels of `prev` (a norm or a linear) by s; returns the factor
        really applied (a Gemma norm stored in `storage_dtype` realizes a rounded one)."""
        mod = layer.get_submodule(prev)
        if isinstance(mod, nn.Linear):
            mod.weight.data = (mod.weight.data.float() / s[:, None]).to(mod.weight.dtype)
            if mod.bias is not None:
                mod.bias.data = (mod.bias.data.float() / s).to(mod.bias.dtype)
            return s
        # RMSNorm: y = gain * normalized(x), gain w (or Gemma's 1 + w)
        return cast(RMSNorm, mod).divide_gain_(s, storage_dtype)

    def quantize_layer(self, layer: DecoderLayer, schemes: dict[str, Scheme], calib: LayerCalibration | None,
                       layer_idx: int) -> LayerResult:
        if calib is None or not self._stats:
            raise UserError("awq needs calibration data")
        smooth = self.smooth_layer(layer, schemes)
        result = LayerResult({}, metrics={"awq": smooth})
        for name, scheme in schemes.items():
            args = scheme.weights
            w = get_linear(layer, name).weight.data.float()
            h = self._stats[name].hessian()
            if self.clip and name not in NO_CLIP and args.strategy in ("group", "channel"):
                scale, zp = clip_qparams(w, args, h, self.scale_dtype, self.n_grid)
            else:
                scale, zp = weight_observer(args.observer)(w, args, self.scale_dtype)
            qw = QuantizedWeight(qmath.quantize(w, scale, zp, args), scale, zp, args)
            deq = qw.dequantize(torch.float32)
            qw.metrics["weight_rel_error"] = weight_error(w, deq)
            qw.metrics["output_err_proxy"] = float(output_error(w - deq, h) / output_error(w, h).clamp_min(1e-30))
            result.weights[name] = qw
        self._stats = {}
        return result
