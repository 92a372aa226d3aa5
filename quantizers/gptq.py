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

- Token energy cap: a few massive-activation tokens (attention sinks) can hold nearly all of
  XᵀX of a down_proj input; each token's contribution is capped at `token_cap` × the median (10; 0 = off)
  so the fit is not made for a handful of tokens (see `cap_token_energy`).

- Attention-weighted K/V: k_proj/v_proj get their own Hessian in which each token counts by the
  attention it receives in the layer (see `received_attention`); the attention-sink token then
  keeps its keys and values instead of absorbing the error an unweighted fit pushes onto it.
- One pass per layer: the pipeline stops before each group of linears sharing an input and
  quantizes the group, so later linears are fitted to the inputs the quantized earlier ones
  produce ("true sequential"), at the cost of one forward per layer instead of two.
- CPU cost (the forward's float32 matmuls are the floor): Hessians with BLAS ssyrk (one
  triangle), the inverse factor from one Cholesky and one triangular inverse, and the attention
  weights from causal query chunks with bf16 scores where bf16 is native (see each function).

Options (`--option k=v` / recipe `options:`): dampening_frac (0.01), block_size (128),
max_damp_retries (3), token_cap (10), kv_attention_weights (true).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from lmfoundry.errors import UserError
from lmfoundry.model.config import input_groups
from lmfoundry.quantformat.quantized_weight import QuantizedWeight
from lmfoundry.quantformat.scheme import QuantArgs, Scheme
from lmfoundry.quantizers.base import (
    LayerCalibration,
    LayerResult,
    Quantizer,
    get_linear,
    weight_error,
)
from lmfoundry.quantizers.hessian import (
    DEFAULT_TOKEN_CAP,
    HessianAccumulator,
    InverseHessian,
    group_statistics,
    inverse_hessian,
)
from lmfoundry.quantizers.observers import weight_observer
from lmfoundry.quantizers.rtn import rtn_quantize_weight

DYNAMIC_ACTORDER_WARNING = (
    "actorder=dynamic stores weight_g_idx: honoured by lmfoundry's loader and by vLLM "
    "(compressed-tensors WNA16 with actorder=group); compressed-tensors >= 0.12 decompression "
    "(what transformers uses) ignores weight_g_idx, so transformers computes wrong weights for "
    "this checkpoint — use actorder=static for transformers"
)


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


INNER_BLOCK = 32  # columns per rank-1-update sub-block inside a lazy block


@torch.no_grad()
def gptq_sweep(
    w: torch.Tensor, hinv: InverseHessian, args: QuantArgs, scale_dtype: torch.dtype, block_size: int = 128
) -> GPTQOutput:
    """Quantize `w` [rows, cols] column by column with error feedback through `hinv`.

    Works on Wᵀ so that a column is one contiguous row of memory, and updates lazily at two
    levels: per column only inside a sub-block of `INNER_BLOCK` columns, per sub-block (one
    matmul) inside the block, per block (one matmul) for the rest of the matrix. The arithmetic
    is GPTQ's; only the order of the additions differs from a column-by-column update of all
    remaining columns.
    """
    if args.type != "int":
        raise UserError("GPTQ quantizes integer weights (wNa16, w8a8); use --method fp8 for fp8")
    rows, cols = w.shape
    observe: Callable = weight_observer(args.observer)
    w = w.clone().float()
    w[:, hinv.dead] = 0.0
    perm = hinv.perm
    if perm is not None:
        w = w[:, perm]
    wt = w.t().contiguous()  # [cols, rows]: sweep position j is row j
    del w
    u = hinv.u
    strategy = args.strategy
    if strategy == "group":
        assert args.group_size is not None  # QuantArgs requires one for "group"
        gs = int(args.group_size)
    else:
        gs = cols
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
    dynamic_groups = strategy == "group" and not static_groups  # qparams fixed when a group starts
    block = -(-max(block_size, gs if strategy == "group" else 1) // gs) * gs if strategy == "group" else block_size
    # a sub-block never splits a group whose qparams are observed at its start
    inner = -(-INNER_BLOCK // gs) * gs if dynamic_groups else INNER_BLOCK
    group_of = gcol.tolist()

    scale_t = torch.empty(ngroups, rows, dtype=scale_dtype)  # transposed while sweeping
    zp_t = None if args.symmetric else torch.empty(ngroups, rows, dtype=torch.int8)
    if strategy in ("channel", "tensor"):  # one range for the whole row (or matrix): before the sweep
        s_, z_ = observe(wt.t(), args, scale_dtype)
        scale_t.copy_(s_.reshape(1, -1).expand(1, rows) if s_.numel() == 1 else s_.reshape(1, rows))
        if zp_t is not None:
            zp_t.copy_(z_.reshape(1, -1).expand(1, rows) if z_.numel() == 1 else z_.reshape(1, rows))
    gargs = _group_args(args)
    fixed = [False] * ngroups
    qmin, qmax = float(args.qmin), float(args.qmax)

    def fix_group(g: int, cols_of_group: torch.Tensor) -> None:
        s_, z_ = observe(cols_of_group.t(), gargs, scale_dtype)
        scale_t[g] = s_[:, 0]
        if zp_t is not None:
            zp_t[g] = z_[:, 0]
        fixed[g] = True

    codes_t = torch.empty(cols, rows, dtype=torch.int8)
    losses = torch.zeros(rows, dtype=torch.float32)
    diag = torch.diagonal(u).tolist()
    u_np = u.float().contiguous().numpy()
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        if static_groups:  # fix qparams of groups first touched in this block from current weights
            for g in sorted(set(group_of[i1:i2])):
                if not fixed[g]:
                    fix_group(g, wt[(gcol == g).nonzero().squeeze(1)])
        err = torch.empty(i2 - i1, rows)
        for s1 in range(i1, i2, inner):
            s2 = min(s1 + inner, i2)
            if dynamic_groups:
                for j in range(s1, s2, gs):
                    fix_group(group_of[j], wt[j:j + gs])
            q1 = torch.empty(s2 - s1, rows)
            _sweep_columns(wt[s1:s2].numpy(), q1.numpy(), err[s1 - i1:s2 - i1].numpy(), u_np[s1:s2, s1:s2],
                           diag[s1:s2], group_of[s1:s2], scale_t, zp_t, qmin, qmax)
            codes_t[s1:s2] = q1.to(torch.int8)
            if s2 < i2:  # the rest of the block, from this sub-block's errors
                wt[s2:i2].addmm_(u[s1:s2, s2:i2].t(), err[s1 - i1:s2 - i1], alpha=-1.0)
        losses += err.square().sum(0) * 0.5
        if i2 < cols:
            wt[i2:].addmm_(u[i1:i2, i2:].t(), err, alpha=-1.0)

    codes = codes_t.t()
    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        codes = codes[:, inv]
        if strategy == "group" and args.actorder == "dynamic":
            g_idx = gcol[inv].to(torch.int32)
    scale = scale_t.t().contiguous()
    zp = zp_t.t().contiguous() if zp_t is not None else None
    return GPTQOutput(codes.contiguous(), scale, zp, g_idx, losses)


def _sweep_columns(w1, q1, e1, u1, diag: list[float], groups: list[int], scale_t: torch.Tensor,
                   zp_t: torch.Tensor | None, qmin: float, qmax: float) -> None:
    """GPTQ's column loop over one sub-block, in place on numpy views of the sweep's tensors:
    quantize column i (its group's qparams), store its code in q1[i] and its scaled error
    (w - deq)/d in e1[i], and push the error onto the sub-block's later columns (rank-1, BLAS
    sger). Why numpy: each step works on one column of a few hundred values, so the cost is
    per-call overhead, which is lower for numpy ufuncs than for torch ops; the codes, scales and
    losses are bit-identical (the same float32 IEEE operations: divide, round-half-even, clip,
    multiply, subtract)."""
    import numpy as np
    from scipy.linalg.blas import sger

    half = scale_t.dtype != torch.float32
    sf = scale_t.float().numpy()
    zf = zp_t.float().numpy() if zp_t is not None else None
    deq = np.empty(w1.shape[1], dtype=np.float32)
    n = w1.shape[0]
    for i in range(n):
        g = groups[i]
        col, q, e = w1[i], q1[i], e1[i]
        np.rint(np.divide(col, sf[g], out=q), out=q)
        if zf is not None:
            q += zf[g]
            np.clip(q, qmin, qmax, out=q)
            np.subtract(q, zf[g], out=deq)
        else:
            np.clip(q, qmin, qmax, out=q)
            deq[:] = q
        if half:  # dequantize exactly as the stored checkpoint will: in the scale's dtype
            d16 = torch.from_numpy(deq)
            d16.copy_((d16.to(scale_t.dtype) * scale_t[g]).float())
        else:
            deq *= sf[g]
        np.subtract(col, deq, out=e)
        e /= np.float32(diag[i])
        if i + 1 < n:  # w1[i+1:] -= u1[i, i+1:] ⊗ e, as [rows, k] column-major for BLAS
            sger(-1.0, e, u1[i, i + 1:], a=w1[i + 1:].T, overwrite_a=1)


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
    sequential = True  # each linear only needs its own input's Hessian: one pass per layer

    known_options = ("dampening_frac", "block_size", "max_damp_retries", "token_cap", "kv_attention_weights")

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        self.dampening_frac = float(self.options.get("dampening_frac", 0.01))
        self.block_size = int(self.options.get("block_size", 128))
        self.max_retries = int(self.options.get("max_damp_retries", 3))
        self.token_cap = float(self.options.get("token_cap", DEFAULT_TOKEN_CAP))
        self.kv_attention_weights = self.flag("kv_attention_weights", True)
        if not self.dampening_frac > 0 or self.block_size <= 0 or self.max_retries < 0:
            raise UserError("gptq: dampening_frac must be > 0, block_size > 0, max_damp_retries >= 0")
        self._hessians: dict[str, HessianAccumulator] = {}

    def validate(self, scheme: Scheme) -> None:
        if scheme.weights.type != "int":
            raise UserError(f"gptq cannot produce {scheme.name} (float weights); use --method fp8")
        if scheme.weights.actorder not in (None, "static", "dynamic"):
            raise UserError(f"actorder {scheme.weights.actorder!r}: expected static or dynamic")

    def calibration_hooks(self, layer: nn.Module, schemes: dict[str, Scheme], layer_idx: int):
        self._hessians, hooks = group_statistics(layer, schemes, self.calib,
                                                 lambda: HessianAccumulator(self.token_cap), self.kv_attention_weights)
        return hooks

    def quantize_layer(self, layer: nn.Module, schemes: dict[str, Scheme], calib: LayerCalibration | None,
                       layer_idx: int) -> LayerResult:
        if calib is None or not self._hessians:
            raise UserError("gptq needs calibration data")
        result = LayerResult({})
        for group in input_groups(list(schemes)):
            self.quantize_group(layer, group, schemes, layer_idx, result)
        self._hessians = {}
        return result

    def quantize_group(self, layer: nn.Module, group: tuple[str, ...], schemes: dict[str, Scheme],
                       layer_idx: int, result: LayerResult) -> None:
        group = tuple(n for n in group if n in schemes)
        if not group:
            return
        if layer_idx == 0 and group[0] == next(iter(schemes)) and any(
                s.weights.actorder == "dynamic" and s.weights.strategy == "group" for s in schemes.values()):
            result.warnings.append(DYNAMIC_ACTORDER_WARNING)  # once per checkpoint, in the manifest
        # members with one Hessian and identical args are swept together (GPTQ's rows are independent)
        by_key: dict[tuple[int, QuantArgs], list[str]] = {}
        for n in group:
            by_key.setdefault((id(self._hessians[n]), schemes[n].weights), []).append(n)
        accumulators = {id(self._hessians[n]): self._hessians[n] for n in group}
        for n in group:  # the group's statistics leave the quantizer: each is freed once its linears are swept
            del self._hessians[n]
        for hid in list(accumulators):
            h = accumulators.pop(hid).hessian()  # its float64 sums are freed here
            keys = [(args, names) for (kid, args), names in by_key.items() if kid == hid]
            hinvs: dict[str | None, InverseHessian | None] = {}
            for args, names in keys:
                if args.actorder not in hinvs:
                    label = f"model.layers.{layer_idx}.{'+'.join(n.split('.')[-1] for n in names)}"
                    hinvs[args.actorder], warns = inverse_hessian(h, args.actorder, self.dampening_frac,
                                                                  self.max_retries, label)
                    result.warnings += warns
            del h  # peak = one Hessian, its reordered copy being factored, and the factor
            for args, names in keys:
                self._sweep_linears(layer, names, args, hinvs[args.actorder], layer_idx, result)
            del hinvs

    def _sweep_linears(self, layer: nn.Module, names: list[str], args: QuantArgs, hinv: InverseHessian | None,
                       layer_idx: int, result: LayerResult) -> None:
        """GPTQ over the stacked rows of `names` (one Hessian, same args); RTN when it has no factor."""
        label = f"model.layers.{layer_idx}.{'+'.join(n.split('.')[-1] for n in names)}"
        weights = [get_linear(layer, n).weight.data.float() for n in names]
        if hinv is None:
            result.warnings.append(f"{label}: fell back to RTN")
            for n, w in zip(names, weights, strict=True):
                qw = rtn_quantize_weight(w, args, self.scale_dtype)
                qw.metrics["rtn_fallback"] = 1.0
                result.weights[n] = qw
            return
        stacked = torch.cat(weights, 0) if len(weights) > 1 else weights[0]
        out = gptq_sweep(stacked, hinv, args, self.scale_dtype, self.block_size)
        r0 = 0
        for n, w in zip(names, weights, strict=True):
            r1 = r0 + w.shape[0]
            part = GPTQOutput(out.q[r0:r1].clone(), out.scale[r0:r1].clone(),
                              out.zero_point[r0:r1].clone() if out.zero_point is not None else None,
                              out.g_idx.clone() if out.g_idx is not None else None, out.row_loss[r0:r1])
            result.weights[n] = _to_quantized_weight(w, part, args, hinv)
            r0 = r1
