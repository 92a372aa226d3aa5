"""What GPTQ and AWQ learn about a linear's input: the Hessian statistic H = 2·XᵀX/N, its
inverse factor, and the attention-weighted variant for k_proj/v_proj.

Kept apart from the algorithms that use them (the statistic, like an observer, is its own piece):
a better statistic here improves both quantizers. Why each choice (token energy cap, one
triangle via BLAS ssyrk, Cholesky with growing damping, received attention) is said at the
function; the reasoning that ties them to GPTQ's sweep is in quantizers/gptq.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, cast

import torch
from torch import nn

from lmfoundry.model.config import input_groups
from lmfoundry.quantformat.qmath import all_finite
from lmfoundry.quantizers.base import LayerCalibration

if TYPE_CHECKING:
    from lmfoundry.model.reference import Attention

# ------------------------------------------------------------------------------------ Hessian
DEFAULT_TOKEN_CAP = 10.0
def token_energy_factor(x: torch.Tensor, cap: float) -> torch.Tensor | None:
    """Per-row factors [N] that scale rows of x [N, C] down so none has more than `cap` × the
    median squared norm (None: nothing to scale, cap <= 0).

    Why: a few "massive activation" tokens (attention sinks) can carry nearly all of XᵀX for
    some down_proj inputs, so the plain Hessian fits the
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
    a matmul) and mirrored once at the end, with float32 sums (benchmarks/results/
    quant_quality_w4a16_32x512_v4.md has where GPTQ's calibration CPU time goes).

    Each batch's XᵀX is made in float32 on its own and added into a float64 sum. A sum of a few
    float32 values in float64 is exact, so it does not depend on the order of the batches: a
    data-parallel run, whose ranks each sum their own batches and then all-reduce, gets the same
    Hessian bits as one process (float32 accumulation across batches changes the last bits with
    the rank count, and GPTQ's error feedback turns those into different codes)."""

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
    Cholesky: about two thirds of the work. On CPU both run in place on the (symmetric)
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
def received_attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       chunk: int = ATTENTION_CHUNK, low_precision: bool | None = None) -> torch.Tensor:
    """Attention each token receives in this layer: Σ over queries of the causal softmax weight
    on it, averaged over heads; one value per row of x [B, T, H] (mean exactly 1 by construction).

    Why: a key/value token's error reaches every query in proportion to the attention it gets.
    The first token of a sequence (the "attention sink") gets about half of all attention but is
    1/T of the tokens, so an unweighted Hessian lets GPTQ push error into its direction: plain
    GPTQ can raise position 0's v_proj output error above RTN's while lowering everyone else's,
    and then lose to RTN in perplexity. Weighting K/V rows by received
    attention makes the Hessian see what the attention output sees.

    Cost: the scores are computed `chunk` queries at a time against only the keys they can see
    (the causal lower triangle: ~(1 + 1/n)/2 of the full T×T for n chunks), each query head
    grouped with its KV head instead of repeating K, rather than a full masked [Hq, T, T]
    softmax per sequence: the same sums up to float32 rounding, for less than half the work.
    `low_precision` (default: where bf16 matmuls are native, see `fast_bf16_matmul`) computes
    q, k and the scores in bf16 (softmax and sums in float32): these are weights of a statistic,
    not the model's function: a score s rounded to bf16 is off by at most |s| 2^-8, which scales
    its softmax weight by a factor within exp(±|s| 2^-8) before normalisation."""
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
            add_kv(x, received_attention(cast("Attention", layer.self_attn), x, cos, sin))
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
