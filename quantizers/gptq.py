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

- Attention-weighted K/V: k_proj/v_proj get their own Hessian in which each token counts by the
  attention it receives in the layer (see `received_attention`); the attention-sink token then
  keeps its keys and values. Measured on SmolLM2 W4A16 g64 (8 x 512 calibration, 12 held-out
  windows, float ppl 17.25): plain GPTQ 25.51 -> 21.13, act-order static 22.15 -> 20.99 (RTN 23.84).
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
from typing import Any, Callable

import torch
from torch import nn

from lmfoundry.errors import UserError
from lmfoundry.model.config import input_groups
from lmfoundry.quantizers.base import LayerCalibration, LayerResult, QuantizedWeight, Quantizer, weight_error
from lmfoundry.quantizers.observers import weight_observer
from lmfoundry.quantizers.qmath import all_finite
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
def token_energy_factor(x: torch.Tensor, cap: float) -> torch.Tensor | None:
    """Per-row factors [N] that scale rows of x [N, C] down so none has more than `cap` × the
    median squared norm (None: nothing to scale, cap <= 0).

    Why: a few "massive activation" tokens (attention sinks) can carry >99% of XᵀX for some
    down_proj inputs (measured on SmolLM2: 16 of 2048 tokens), so the plain Hessian fits the
    quantization to those tokens alone and the rest of the text pays. Capping their weight keeps
    them in the objective without letting them dominate."""
    if cap <= 0:
        return None
    energy = torch.linalg.vector_norm(x, dim=-1).square_()
    limit = cap * energy.median().clamp_min(1e-30)
    return torch.sqrt(torch.clamp(limit / energy.clamp_min(1e-30), max=1.0))


def cap_token_energy(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Rows of x [N, C] scaled by `token_energy_factor` (x itself when cap <= 0)."""
    factor = token_energy_factor(x, cap)
    return x if factor is None else x * factor.unsqueeze(-1)


class HessianAccumulator:
    """Running Σ xᵀx over input rows (token energy capped, see `cap_token_energy`);
    `hessian()` returns 2·XᵀX/N (float32).

    XᵀX is symmetric, so it is accumulated with BLAS `ssyrk` (one triangle, half the products of
    a matmul) and mirrored once at the end: measured 0.81x the CPU time of the block-triangular
    matmuls used before (and 0.51x a full matmul) for a 1536-wide down_proj input, with float32
    sums; the Hessians are still about a quarter of GPTQ's calibration CPU time.

    Each batch's XᵀX is made in float32 on its own and added into a float64 sum. A sum of a few
    float32 values in float64 is exact, so it does not depend on the order of the batches: a
    data-parallel run, whose ranks each sum their own batches and then all-reduce, gets the same
    Hessian bits as one process (float32 accumulation across batches flipped 32 % of down_proj's
    GPTQ codes between 1 and 2 ranks on SmolLM2; GPTQ's error feedback amplifies the last bit)."""

    def __init__(self, token_cap: float = 0.0) -> None:
        self.sum: Any = None  # CPU: numpy float64 [C, C], Fortran order, upper triangle valid
        self.device_sum: torch.Tensor | None = None  # elsewhere (CUDA): torch float64 [C, C], full
        self.count = 0
        self.token_cap = token_cap
        self.reduced = False  # summed over data-parallel ranks (done once, when first read)
        self._h: torch.Tensor | None = None  # the float32 Hessian, once read (the sums are freed)

    @torch.no_grad()
    def add(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add the rows of x [..., C]; `weights` (one per row, mean ~1) scale their contribution."""
        import numpy as np
        from scipy.linalg.blas import ssyrk

        x = x.detach().reshape(-1, x.shape[-1]).float()
        factor = token_energy_factor(x, self.token_cap)
        if weights is not None:
            w = weights.reshape(-1).float().sqrt()
            factor = w if factor is None else factor * w
        if factor is not None:
            x = x * factor.unsqueeze(-1)
        if self.reduced:  # set by the first read
            raise RuntimeError("HessianAccumulator.add after the Hessian was read")
        self.count += x.shape[0]
        if x.device.type != "cpu":  # on the accelerator: one matmul, no host round trip
            if self.device_sum is None:
                self.device_sum = torch.zeros(x.shape[1], x.shape[1], device=x.device, dtype=torch.float64)
            self.device_sum += x.t() @ x
            return
        # x [N, C] row-major is xᵀ [C, N] column-major: ssyrk(trans=0) makes xᵀ·x without a copy
        part = ssyrk(1.0, x.contiguous().numpy().T, trans=0, lower=0)
        if self.sum is None:
            self.sum = np.zeros((x.shape[1], x.shape[1]), dtype=np.float64, order="F")
        self.sum += part

    def hessian(self) -> torch.Tensor:
        """2·XᵀX/N over the tokens of every data-parallel rank (summed across ranks here, once).

        Memory: the float64 sum becomes one float32 matrix (mirrored block by block, no second
        copy) and is freed; the result is kept for later reads. A down_proj Hessian of an 8B model
        is 0.8 GB in float32, so each extra copy here shows in the run's peak."""
        from lmfoundry.distributed import ranks

        if self._h is not None:
            return self._h
        if not self.reduced:
            self.reduced = True
            group = ranks()
            self.count = int(group.sum_number(self.count))
            if self.device_sum is not None:
                group.sum_(self.device_sum)
            elif self.sum is not None:
                group.sum_(torch.from_numpy(self.sum.T))  # C-contiguous view of the same memory
        if (self.sum is None and self.device_sum is None) or self.count == 0:
            raise RuntimeError("no calibration inputs reached this linear")
        if self.device_sum is not None:
            h = self.device_sum.float().mul_(2.0 / self.count)
        else:
            h = torch.from_numpy(self.sum).float()  # Fortran-ordered like the sum; upper triangle valid
            self.sum = None
            mirror_upper_(h)
            h = h.mul_(2.0 / self.count).t()  # symmetric: the transpose is the same matrix, C-contiguous
        self.device_sum = None
        self._h = h
        return h


def mirror_upper_(h: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Copy the upper triangle of square `h` onto its lower one, in place, `block` columns at a
    time (a temporary of one block, not of the matrix)."""
    n = h.shape[0]
    for j0 in range(0, n, block):
        j1 = min(j0 + block, n)
        h[j0:j1, :j0] = h[:j0, j0:j1].t()
        d = h[j0:j1, j0:j1]
        d.copy_(torch.triu(d) + torch.triu(d, 1).t())
    return h


@dataclass
class InverseHessian:
    """Upper Cholesky factor of (H + λI)⁻¹ in the sweep order, plus what produced it."""

    u: torch.Tensor  # [cols, cols] upper triangular
    perm: torch.Tensor | None  # sweep position -> original column (None: identity)
    dead: torch.Tensor  # bool [cols], inputs that were always zero
    damping_frac: float




def upper_cholesky_of_inverse(h_flipped: torch.Tensor, overwrite: bool = False) -> torch.Tensor | None:
    """U upper triangular with Uᵀ·U = H⁻¹, from J·H·J (H with rows and columns reversed); None
    if H is not positive definite. With `overwrite` the factorization happens in `h_flipped`'s
    memory (CPU), which is left holding garbage.

    Why this way: J·H·J = M·Mᵀ (M lower) gives H = R·Rᵀ with R = J·M·J upper, so
    H⁻¹ = R⁻ᵀ·R⁻¹ and U = R⁻¹ = J·M⁻¹·J — one Cholesky and one triangular inverse (LAPACK
    spotrf and strtri), about n³/3 each, instead of Cholesky, cholesky_inverse and a second
    Cholesky (measured 0.47x the CPU time at n = 1536). On CPU both run in place on the (symmetric)
    input seen in Fortran order, and U is the one new matrix: three matrices of H's size at the
    peak with the caller's H, instead of six."""
    if h_flipped.device.type != "cpu":  # no LAPACK strtri on the accelerator: a triangular solve against I
        m, info = torch.linalg.cholesky_ex(h_flipped)
        if info != 0:
            return None
        eye = torch.eye(m.shape[0], device=m.device, dtype=m.dtype)
        u = torch.linalg.solve_triangular(m, eye, upper=False).flip(0, 1)
    else:
        from scipy.linalg.lapack import spotrf, strtri

        a = (h_flipped if overwrite else h_flipped.clone()).float().contiguous()
        m, info = spotrf(a.numpy().T, lower=1, clean=0, overwrite_a=1)  # symmetric: its transpose is itself
        if info != 0:
            return None
        m, info = strtri(m, lower=1, overwrite_c=1)  # M⁻¹ in the lower triangle; the upper one is stale
        if info != 0:
            return None
        u = torch.from_numpy(m[::-1, ::-1].copy(order="C")).triu_()
        del m, a
    if not all_finite(u):
        return None
    return u.contiguous()


def inverse_hessian(
    h: torch.Tensor, actorder: str | None, dampening_frac: float = 0.01, max_retries: int = 3, name: str = ""
) -> tuple[InverseHessian | None, list[str]]:
    """Damped inverse-Hessian factor and the warnings it produced; the factor is None if no
    damping up to frac·10^max_retries makes H positive definite (the caller falls back to RTN).

    `h` is only read: one reordered copy (act-order permutation and the reversal J in one
    gather) is damped and factored in place, so the caller can drop `h` as soon as this returns."""
    warnings: list[str] = []
    h = h.float()
    n = h.shape[0]
    diag = torch.diagonal(h).clone()
    dead = diag == 0
    diag[dead] = 1.0
    perm = None
    if actorder in ("static", "dynamic"):
        perm = torch.argsort(diag, descending=True)
    order = perm if perm is not None else torch.arange(n, device=h.device)
    mean_diag = float(diag[order].mean())
    if not (mean_diag > 0 and all_finite(h)):
        warnings.append(f"{name}: Hessian is not finite/positive (mean diagonal {mean_diag})")
        return None, warnings
    rev = order.flip(0)
    base_diag = diag[rev]
    frac = dampening_frac
    for attempt in range(max_retries + 1):
        hd = h[rev.unsqueeze(1), rev]  # J·P·H·Pᵀ·J: reordered and reversed, one new matrix
        torch.diagonal(hd).copy_(base_diag).add_(frac * mean_diag)
        u = upper_cholesky_of_inverse(hd, overwrite=True)
        del hd
        if u is not None:
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
    per-call overhead, which is lower for numpy ufuncs than for torch ops: measured 0.61x the
    CPU time of the whole sweep on SmolLM2's shapes, with bit-identical codes, scales and losses
    (the same float32 IEEE operations: divide, round-half-even, clip, multiply, subtract)."""
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


# ------------------------------------------------------------------- attention-weighted K/V
KV_PROJ = ("self_attn.k_proj", "self_attn.v_proj")


ATTENTION_CHUNK = 64  # queries per block of the causal received-attention computation


def fast_bf16_matmul(device: torch.device) -> bool:
    """Whether bf16 matmuls are native (and so faster than float32) where `device` computes:
    CUDA, or a CPU with AVX512-BF16/AMX (what oneDNN reports); emulated bf16 would be slower."""
    if device.type == "cuda":
        return True
    try:
        return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@torch.no_grad()
def received_attention(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       chunk: int = ATTENTION_CHUNK, low_precision: bool | None = None) -> torch.Tensor:
    """Attention each token receives in this layer: Σ over queries of the causal softmax weight
    on it, averaged over heads; one value per row of x [B, T, H] (mean exactly 1 by construction).

    Why: a key/value token's error reaches every query in proportion to the attention it gets.
    The first token of a sequence (the "attention sink") gets about half of all attention but is
    1/T of the tokens, so an unweighted Hessian lets GPTQ push error into its direction: measured
    on SmolLM2, plain GPTQ raised position 0's v_proj output error from 0.29 (RTN) to 0.53 while
    lowering everyone else's, and lost to RTN in perplexity. Weighting K/V rows by received
    attention makes the Hessian see what the attention output sees.

    Cost: the scores are computed `chunk` queries at a time against only the keys they can see
    (the causal lower triangle: ~(1 + 1/n)/2 of the full T×T for n chunks), each query head
    grouped with its KV head instead of repeating K; measured 2.6x less CPU time than a full
    masked [Hq, T, T] softmax per sequence at T = 512, same sums up to float32 rounding.
    `low_precision` (default: where bf16 matmuls are native, see `fast_bf16_matmul`) computes
    q, k and the scores in bf16 (softmax and sums in float32): these are weights of a statistic,
    not the model's function, and bf16 moves them little — measured on SmolLM2 layers 0-29:
    median 0.13-0.50 %, 99th percentile <= 1.9 %, max <= 3 % per token — for 0.65x the time."""
    if low_precision is None:
        low_precision = fast_bf16_matmul(x.device)
    dtype = torch.bfloat16 if low_precision else torch.float32
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=low_precision):
        q, k = attn.project_qk(x, cos.to(dtype), sin.to(dtype))  # [B, T, Hq, D], [B, T, Hkv, D]
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    rep = hq // hkv
    spec = getattr(attn, "spec", None)  # Gemma: its own scale, score soft-cap and sliding window
    scale = spec.scale if spec is not None else d**-0.5
    # [B, Hkv, rep, T, D]: the query heads that share one KV head, side by side
    qg = (q.float() * scale).to(dtype).permute(0, 2, 1, 3).reshape(b, hkv, rep, t, d)
    kg = k.to(dtype).permute(0, 2, 1, 3)  # [B, Hkv, T, D]
    future = torch.full((chunk, chunk), float("-inf")).triu_(1)
    received = torch.zeros(b, t)
    for c0 in range(0, t, chunk):
        c1 = min(c0 + chunk, t)
        n = c1 - c0
        scores = torch.matmul(qg[:, :, :, c0:c1].reshape(b, hkv, rep * n, d), kg[:, :, :c1].transpose(-1, -2))
        scores = scores.float().view(b, hkv, rep, n, c1)
        if spec is not None and spec.softcap is not None:
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
        scores[..., c0:c1] += future[:n, :n]
        if spec is not None and spec.window is not None:  # keys more than window-1 back are unseen
            old = torch.arange(c1)[None, :] <= torch.arange(c0, c1)[:, None] - spec.window
            scores.masked_fill_(old, float("-inf"))
        received[:, :c1] += scores.softmax(-1).sum((1, 2, 3))
    return received.div_(hq).reshape(-1)


def kv_weighted_hook(layer: nn.Module, calib: LayerCalibration, add: Callable | None, add_kv: Callable):
    """A forward hook body for the q/k/v input: `add(x)` for q_proj's statistics (every token
    once), `add_kv(x, received_attention)` for k_proj/v_proj's. Shared by GPTQ and AWQ."""
    cos, sin = calib.cos, calib.sin
    inside = [False]  # as a forward hook on q_proj, our own q_proj call re-enters: ignore that

    def hook(x: torch.Tensor) -> None:
        if inside[0]:
            return
        if add is not None:
            add(x)
        inside[0] = True
        try:
            add_kv(x, received_attention(layer.self_attn, x, cos, sin))
        finally:
            inside[0] = False
    return hook


def group_statistics(layer: nn.Module, schemes: dict, calib: LayerCalibration | None, make: Callable,
                     kv_weighted: bool) -> tuple[dict, dict[str, Callable]]:
    """One input statistic (`make()`, with `.add(x[, weights])`) per group of linears sharing an
    input, plus — when `kv_weighted` and the layer's calibration is known — a separate one for
    k_proj/v_proj weighted by received attention; returns (linear name -> statistic, hooks)."""
    stats: dict = {}
    hooks: dict[str, Callable] = {}
    for group in input_groups(list(schemes)):
        st = make()
        for n in group:
            stats[n] = st
        hooks[group[0]] = st.add
        kv = [n for n in group if n in KV_PROJ]
        if kv_weighted and kv and calib is not None:
            kv_st = make()
            for n in kv:
                stats[n] = kv_st
            hooks[group[0]] = kv_weighted_hook(layer, calib, st.add if len(kv) < len(group) else None, kv_st.add)
    return stats, hooks


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
        weights = [layer.get_submodule(n).weight.data.float() for n in names]
        if hinv is None:
            result.warnings.append(f"{label}: fell back to RTN")
            for n, w in zip(names, weights):
                qw = rtn_quantize_weight(w, args, self.scale_dtype)
                qw.metrics["rtn_fallback"] = 1.0
                result.weights[n] = qw
            return
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
