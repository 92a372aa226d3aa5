"""GPTQ (Frantar et al., arXiv 2210.17323): quantize a linear's weight one column at a time and push
each column's rounding error onto the columns not yet quantized, weighted by the inverse Hessian
of the layer's input, so the *output* error ‖XWᵀ − XŴᵀ‖² is minimized rather than the weight error.

What this implementation does, and why:
- H = 2·XᵀX/N over every calibration token. Linears that read one input (q/k/v, gate/up) share
  one Hessian, one damping and one inverse-Cholesky factor; because GPTQ treats the rows of W
  independently, their weights are also stacked and swept in one pass (same result, one third
  of the per-column work for q/k/v).
- Dampening `dampening_frac` × mean(diag H); dead inputs (zero diagonal) get a unit diagonal and
  zero weight. If a Cholesky fails the damping grows ×10 (with a warning naming the layer); if it
  never succeeds the linear falls back to RTN and the manifest records it.
- Lazy block updates (128 columns, rounded up to a multiple of the group size so that a group's
  columns are all up to date when its qparams are fixed); inside a block, one rank-1 update per
  column.
- Group qparams come from the weight observer (minmax / mse) on the error-updated columns, fixed
  when the group is reached, so a better observer improves GPTQ too.
- Activation order (llm-compressor's meaning): "static" sweeps columns by decreasing H diagonal
  but keeps groups contiguous in the original order (no g_idx needed at inference; a group's
  qparams are fixed from the updated weights at the start of the block where the group is first
  touched); "dynamic" (desc_act) forms groups in the permuted order and stores `weight_g_idx`.

- Token energy cap: massive-activation tokens (attention sinks) can hold >99% of XᵀX of a
  down_proj input; each token's contribution is capped at `token_cap` × the median (10; 0 = off)
  so the fit is not made for a handful of tokens (see `cap_token_energy`).

Options (`--option k=v` / recipe `options:`): dampening_frac (0.01), block_size (128),
max_damp_retries (3), token_cap (10).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from lmfoundry.errors import UserError
from lmfoundry.quantizers._input_groups import input_groups
from lmfoundry.quantizers.base import LayerCalibration, LayerResult, QuantizedWeight, Quantizer, weight_error
from lmfoundry.quantizers.observers import weight_observer
from lmfoundry.quantizers.rtn import rtn_quantize_weight
from lmfoundry.quantizers.scheme import QuantArgs, Scheme

DYNAMIC_ACTORDER_WARNING = (
    "actorder=dynamic stores weight_g_idx: honoured by lmfoundry's loader and by vLLM "
    "(compressed-tensors WNA16 with actorder=group); compressed-tensors >= 0.12 decompression "
    "(what transformers uses) ignores weight_g_idx, so transformers computes wrong weights for "
    "this checkpoint — use actorder=static for transformers"
)


# ------------------------------------------------------------------------------------ Hessian
DEFAULT_TOKEN_CAP = 10.0
def cap_token_energy(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Rows of x [N, C] scaled down so none has more than `cap` × the median squared norm.

    Why: a few "massive activation" tokens (attention sinks) can carry >99% of XᵀX for some
    down_proj inputs (measured on SmolLM2: 16 of 2048 tokens), so the plain Hessian fits the
    quantization to those tokens alone and the rest of the text pays. Capping their weight keeps
    them in the objective without letting them dominate. cap <= 0 disables it."""
    if cap <= 0:
        return x
    energy = x.square().sum(-1)
    limit = cap * energy.median().clamp_min(1e-30)
    return x * torch.sqrt(torch.clamp(limit / energy.clamp_min(1e-30), max=1.0)).unsqueeze(-1)


class HessianAccumulator:
    """Running Σ xᵀx over input rows (token energy capped, see `cap_token_energy`);
    `hessian()` returns 2·XᵀX/N (float32)."""

    def __init__(self, token_cap: float = 0.0) -> None:
        self.sum: torch.Tensor | None = None
        self.count = 0
        self.token_cap = token_cap

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        x = cap_token_energy(x.detach().reshape(-1, x.shape[-1]).float(), self.token_cap)
        if self.sum is None:
            self.sum = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32)
        self.sum.addmm_(x.t(), x)
        self.count += x.shape[0]

    def hessian(self) -> torch.Tensor:
        if self.sum is None or self.count == 0:
            raise RuntimeError("no calibration inputs reached this linear")
        return self.sum * (2.0 / self.count)


@dataclass
class InverseHessian:
    """Upper Cholesky factor of (H + λI)⁻¹ in the sweep order, plus what produced it."""

    u: torch.Tensor  # [cols, cols] upper triangular
    perm: torch.Tensor | None  # sweep position -> original column (None: identity)
    dead: torch.Tensor  # bool [cols], inputs that were always zero
    damping_frac: float


def inverse_hessian(
    h: torch.Tensor, actorder: str | None, dampening_frac: float = 0.01, max_retries: int = 3, name: str = ""
) -> tuple[InverseHessian | None, list[str]]:
    """Damped inverse-Hessian factor and the warnings it produced; the factor is None if no
    damping up to frac·10^max_retries makes H positive definite (the caller falls back to RTN)."""
    h = h.clone().float()
    warnings: list[str] = []
    diag = torch.diagonal(h)
    dead = diag == 0
    h[dead, dead] = 1.0
    perm = None
    if actorder in ("static", "dynamic"):
        perm = torch.argsort(torch.diagonal(h), descending=True)
        h = h[perm][:, perm]
    mean_diag = float(torch.diagonal(h).mean())
    if not (torch.isfinite(h).all() and mean_diag > 0):
        warnings.append(f"{name}: Hessian is not finite/positive (mean diagonal {mean_diag})")
        return None, warnings
    frac = dampening_frac
    for attempt in range(max_retries + 1):
        hd = h.clone()
        torch.diagonal(hd).add_(frac * mean_diag)
        lower, info = torch.linalg.cholesky_ex(hd)
        if info == 0:
            hinv = torch.cholesky_inverse(lower)
            u, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if info == 0 and torch.isfinite(u).all():
                return InverseHessian(u, perm, dead, frac), warnings
        if attempt < max_retries:
            warnings.append(f"{name}: Cholesky failed at dampening_frac={frac:g}; retrying at {frac * 10:g}")
        frac *= 10
    warnings.append(f"{name}: Cholesky failed up to dampening_frac={frac / 10:g}")
    return None, warnings


# ---------------------------------------------------------------------------------- the sweep
@dataclass
class GPTQOutput:
    q: torch.Tensor  # int8 codes [rows, cols], original column order
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    g_idx: torch.Tensor | None
    row_loss: torch.Tensor  # [rows] GPTQ objective Σ (w - q)² / d² / 2 per row


def _group_args(args: QuantArgs) -> QuantArgs:
    """The args that make an observer return one scale per row for a [rows, group] slice."""
    return replace(args, strategy="channel", group_size=None)


@torch.no_grad()
def gptq_sweep(
    w: torch.Tensor, hinv: InverseHessian, args: QuantArgs, scale_dtype: torch.dtype, block_size: int = 128
) -> GPTQOutput:
    """Quantize `w` [rows, cols] column by column with error feedback through `hinv`."""
    if args.type != "int":
        raise UserError("GPTQ quantizes integer weights (wNa16, w8a8); use --method fp8 for fp8")
    rows, cols = w.shape
    observe: Callable = weight_observer(args.observer)
    w = w.clone().float()
    w[:, hinv.dead] = 0.0
    perm = hinv.perm
    if perm is not None:
        w = w[:, perm]
    u = hinv.u
    strategy = args.strategy
    gs = int(args.group_size) if strategy == "group" else cols
    if strategy == "group" and cols % gs:
        raise UserError(f"group size {gs} does not divide the input dimension {cols}")
    ngroups = cols // gs if strategy == "group" else 1
    # which group each sweep position belongs to
    positions = torch.arange(cols)
    if strategy != "group":
        gcol = torch.zeros(cols, dtype=torch.long)
    elif perm is not None and args.actorder == "static":
        gcol = perm // gs  # groups stay contiguous in the original column order
    else:
        gcol = positions // gs  # none, or dynamic (groups in sweep order)
    static_groups = strategy == "group" and perm is not None and args.actorder == "static"
    block = -(-max(block_size, gs if strategy == "group" else 1) // gs) * gs if strategy == "group" else block_size

    scale = torch.empty(rows, ngroups, dtype=scale_dtype)
    zp = None if args.symmetric else torch.empty(rows, ngroups, dtype=torch.int8)
    if strategy in ("channel", "tensor"):  # one range for the whole row (or matrix): before the sweep
        s, z = observe(w, args, scale_dtype)
        scale.copy_(s.reshape(-1, 1).expand(rows, 1) if s.numel() == 1 else s.reshape(rows, 1))
        if zp is not None:
            zp.copy_(z.reshape(-1, 1).expand(rows, 1) if z.numel() == 1 else z.reshape(rows, 1))
    gargs = _group_args(args)
    fixed = torch.zeros(ngroups, dtype=torch.bool)
    qmin, qmax = args.qmin, args.qmax
    half = scale_dtype != torch.float32

    codes = torch.empty(rows, cols, dtype=torch.int8)
    losses = torch.zeros(rows, dtype=torch.float32)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        if static_groups:  # fix qparams of groups first touched in this block from current weights
            for g in torch.unique(gcol[i1:i2]).tolist():
                if not fixed[g]:
                    sweep_pos = (gcol == g).nonzero().squeeze(1)
                    s, z = observe(w[:, sweep_pos], gargs, scale_dtype)
                    scale[:, g] = s[:, 0]
                    if zp is not None:
                        zp[:, g] = z[:, 0]
                    fixed[g] = True
        w1 = w[:, i1:i2].clone()
        err1 = torch.empty_like(w1)
        u1 = u[i1:i2, i1:i2]
        sf = scale.float()
        zf = zp.float() if zp is not None else None
        for i in range(i2 - i1):
            j = i1 + i
            g = int(gcol[j])
            if strategy == "group" and not static_groups and j % gs == 0:
                s, z = observe(w1[:, i : i + gs], gargs, scale_dtype)
                scale[:, g] = s[:, 0]
                sf[:, g] = scale[:, g].float()
                if zp is not None:
                    zp[:, g] = z[:, 0]
                    zf[:, g] = z[:, 0].float()
            col = w1[:, i]
            s_g = sf[:, g]
            q = torch.round(col / s_g)
            if zf is not None:
                q = torch.clamp(q + zf[:, g], qmin, qmax)
                deq = q - zf[:, g]
            else:
                q = torch.clamp(q, qmin, qmax)
                deq = q
            # dequantize exactly as the stored checkpoint will (in the scale's dtype)
            deq = (deq.to(scale_dtype) * scale[:, g]).float() if half else deq * s_g
            codes[:, j] = q.to(torch.int8)
            d = u1[i, i]
            e = (col - deq) / d
            losses += e.square() * 0.5
            if i + 1 < i2 - i1:
                w1[:, i + 1 :].addr_(e, u1[i, i + 1 :], alpha=-1.0)
            err1[:, i] = e
        if i2 < cols:
            w[:, i2:].addmm_(err1, u[i1:i2, i2:], alpha=-1.0)

    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        codes = codes[:, inv]
        if strategy == "group" and args.actorder == "dynamic":
            g_idx = gcol[inv].to(torch.int32)
    return GPTQOutput(codes, scale, zp, g_idx, losses)


def gptq_quantize(
    w: torch.Tensor, h: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype = torch.float32,
    dampening_frac: float = 0.01, block_size: int = 128, max_retries: int = 3, name: str = "linear",
) -> tuple[QuantizedWeight, list[str]]:
    """GPTQ for one weight with its Hessian (the unit the tests check); falls back to RTN."""
    hinv, warnings = inverse_hessian(h, args.actorder, dampening_frac, max_retries, name)
    if hinv is None:
        qw = rtn_quantize_weight(w.float(), args, scale_dtype)
        qw.metrics["rtn_fallback"] = 1.0
        return qw, warnings + [f"{name}: fell back to RTN"]
    out = gptq_sweep(w, hinv, args, scale_dtype, block_size)
    qw = _to_quantized_weight(w, out, args, hinv)
    return qw, warnings


def _to_quantized_weight(w: torch.Tensor, out: GPTQOutput, args: QuantArgs, hinv: InverseHessian) -> QuantizedWeight:
    qw = QuantizedWeight(out.q, out.scale, out.zero_point, args, out.g_idx)
    qw.metrics["gptq_loss"] = float(out.row_loss.sum())
    qw.metrics["weight_rel_error"] = weight_error(w, qw.dequantize(torch.float32))
    qw.metrics["dampening_frac"] = hinv.damping_frac
    if int(hinv.dead.sum()):
        qw.metrics["dead_inputs"] = float(hinv.dead.sum())
    return qw


# ------------------------------------------------------------------------------- the quantizer
class GPTQQuantizer(Quantizer):
    name = "gptq"

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        known = {"dampening_frac", "block_size", "max_damp_retries", "token_cap"}
        unknown = set(self.options) - known
        if unknown:
            raise UserError(f"gptq: unknown option(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        self.dampening_frac = float(self.options.get("dampening_frac", 0.01))
        self.block_size = int(self.options.get("block_size", 128))
        self.max_retries = int(self.options.get("max_damp_retries", 3))
        self.token_cap = float(self.options.get("token_cap", DEFAULT_TOKEN_CAP))
        if not self.dampening_frac > 0 or self.block_size <= 0 or self.max_retries < 0:
            raise UserError("gptq: dampening_frac must be > 0, block_size > 0, max_damp_retries >= 0")
        self._hessians: dict[str, HessianAccumulator] = {}

    def validate(self, scheme: Scheme) -> None:
        if scheme.weights.type != "int":
            raise UserError(f"gptq cannot produce {scheme.name} (float weights); use --method fp8")
        if scheme.weights.actorder not in (None, "static", "dynamic"):
            raise UserError(f"actorder {scheme.weights.actorder!r}: expected static or dynamic")

    def calibration_hooks(self, layer: nn.Module, schemes: dict[str, Scheme], layer_idx: int):
        self._hessians = {}
        hooks = {}
        for group in input_groups(list(schemes)):
            acc = HessianAccumulator(self.token_cap)
            for n in group:
                self._hessians[n] = acc
            hooks[group[0]] = acc.add
        return hooks

    def quantize_layer(self, layer: nn.Module, schemes: dict[str, Scheme], calib: LayerCalibration | None,
                       layer_idx: int) -> LayerResult:
        if calib is None or not self._hessians:
            raise UserError("gptq needs calibration data")
        result = LayerResult({})
        dynamic = any(s.weights.actorder == "dynamic" and s.weights.strategy == "group" for s in schemes.values())
        if dynamic and layer_idx == 0:  # once per checkpoint, in the manifest's warnings
            result.warnings.append(DYNAMIC_ACTORDER_WARNING)
        for group in input_groups(list(schemes)):
            h = self._hessians[group[0]].hessian()
            # members with identical args are swept together (rows are independent in GPTQ)
            by_args: dict[QuantArgs, list[str]] = {}
            for n in group:
                by_args.setdefault(schemes[n].weights, []).append(n)
            hinv_cache: dict[str | None, InverseHessian | None] = {}
            for args, names in by_args.items():
                label = f"model.layers.{layer_idx}.{'+'.join(n.split('.')[-1] for n in names)}"
                if args.actorder not in hinv_cache:
                    hinv_cache[args.actorder], warns = inverse_hessian(
                        h, args.actorder, self.dampening_frac, self.max_retries, label)
                    result.warnings += warns
                hinv = hinv_cache[args.actorder]
                weights = [layer.get_submodule(n).weight.data.float() for n in names]
                if hinv is None:
                    result.warnings.append(f"{label}: fell back to RTN")
                    for n, w in zip(names, weights):
                        qw = rtn_quantize_weight(w, args, self.scale_dtype)
                        qw.metrics["rtn_fallback"] = 1.0
                        result.weights[n] = qw
                    continue
                stacked = torch.cat(weights, 0) if len(weights) > 1 else weights[0]
                out = gptq_sweep(stacked, hinv, args, self.scale_dtype, self.block_size)
                r0 = 0
                for n, w in zip(names, weights):
                    r1 = r0 + w.shape[0]
                    part = GPTQOutput(out.q[r0:r1].clone(), out.scale[r0:r1].clone(),
                                      out.zero_point[r0:r1].clone() if out.zero_point is not None else None,
                                      out.g_idx.clone() if out.g_idx is not None else None, out.row_loss[r0:r1])
                    result.weights[n] = _to_quantized_weight(w, part, args, hinv)
                    r0 = r1
        self._hessians = {}
        return result
