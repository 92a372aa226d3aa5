"""Random, non-zero inputs for any kernel specialization, with a check against the reference.

`build(kernel, types, semantics, shape, device)` returns an `Example`: a ready `KernelCall`, the
names of its output arguments, the bytes it must move and the flops it must do (for GB/s and
TFLOP/s), and `check(ran, reference)` applying the error bounds of `checks`. Used by the GPU
benchmark (every kernel, and every kernel shipped in a bundle), by `compile --tune`, and by a CPU
test that runs every example through the interpreter so the benchmark's harness is itself tested.
The GEMM, elementwise and LoRA examples are built here, the KV-cache and attention ones in
harness_attention.py; `Example` itself is harness_example.py's.
"""

from __future__ import annotations

from typing import Any

import torch

from lmfoundry.kernels import (
    activation,
    error_bounds,
    lora,
    norm_quant,
    rotary,
    scaled_mm,
    tiled_layout,
    w4a16,
    w4a16_tiled,
    w8a8_reference,
)
from lmfoundry.kernels.dispatch import Launcher, ReferenceLauncher
from lmfoundry.kernels.harness_attention import attention_example, decode_reduce_example, store_kv_example
from lmfoundry.kernels.harness_example import TORCH_DTYPE, Example, nbytes
from lmfoundry.kernels.spec import KernelCall


def _w4a16(kernel, types, sem, shape, device, gen) -> Example:
    m, n, k, bits = shape["M"], shape["N"], shape["K"], sem["BITS"]
    act, sdt = TORCH_DTYPE[types["act"]], TORCH_DTYPE[types["scale"]]
    group = sem["GROUP_SIZE"]
    groups = 1 if group == 0 else k // group
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    from lmfoundry.kernels.w4a16 import PackedLinear

    def pack(q: torch.Tensor, dim: int) -> torch.Tensor:
        per = 32 // bits
        u = (q.to(torch.int32) - lo)
        u = u if dim == 1 else u.t()
        pad = (-u.shape[1]) % per
        u = torch.nn.functional.pad(u, (0, pad)).reshape(u.shape[0], -1, per)
        words = (u << (torch.arange(per, dtype=torch.int32) * bits)).sum(-1, dtype=torch.int64).to(torch.int64)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        return words if dim == 1 else words.t().contiguous()

    q = torch.randint(lo, hi, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, groups, generator=gen) * 0.02 + 0.002).to(sdt)
    zp = pack(torch.randint(lo, hi, (n, groups), generator=gen, dtype=torch.int8), 0) if sem["HAS_ZP"] else None
    gidx = ((torch.arange(k) // (group or k))[torch.randperm(k, generator=gen)]).to(torch.int32) if sem["HAS_GIDX"] else None
    bias = torch.randn(n, generator=gen).to(act) if sem["HAS_BIAS"] else None
    w = PackedLinear(pack(q, 1), scale, bits, group, k, zp, gidx, bias)
    x = torch.randn(m, k, generator=gen).to(act)

    def on_device(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    w_dev = PackedLinear(w.weight_packed.to(device), w.weight_scale.to(device), bits, group, k,
                         on_device(zp), on_device(gidx), on_device(bias))
    out = error_bounds.poisoned((m, n), act, device)
    call = w4a16.make_call(x.to(device), w_dev, out)
    if call.kernel.name != kernel:
        raise ValueError(f"{kernel} does not serve M={m} (the op picks {call.kernel.name})")
    def check(ran: KernelCall, ref: KernelCall, acc_u: error_bounds.Accumulation = error_bounds.U32) -> None:
        abs_products = x.double().abs() @ w.dequantize().to(act).double().abs().t()
        if bias is not None:
            abs_products = abs_products + bias.double().abs()
        out_ref = ref.args["out_ptr"].cpu()
        error_bounds.assert_written(ran.args["out_ptr"], kernel)
        error_bounds.assert_within(ran.args["out_ptr"].cpu(), out_ref, error_bounds.dot_bound(out_ref, abs_products, k, act, acc_u), kernel)

    return Example(call, ("out_ptr",), nbytes(x, w.weight_packed, scale, zp, gidx, bias, out), 2 * m * n * k, check)


def _w4a16_tiled(kernel, types, sem, shape, device, gen) -> Example:
    """The tiled-layout GEMM on a random compressed-tensors weight repacked as compile does (no
    act-order: it permutes x before the kernel, which the kernel never sees)."""
    m, n, k, bits = shape["M"], shape["N"], shape["K"], sem["BITS"]
    act, sdt = TORCH_DTYPE[types["act"]], TORCH_DTYPE[types["scale"]]
    group = sem["GROUP_SIZE"]
    groups = 1 if group == 0 else k // group
    q = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int32)
    scale = (torch.rand(n, groups, generator=gen) * 0.02 + 0.002).to(sdt)
    zp = tiled_layout.pack_codes(torch.randint(0, 1 << bits, (n, groups), generator=gen, dtype=torch.int32), bits, 0) \
        if sem["HAS_ZP"] else None
    bias = torch.randn(n, generator=gen).to(act) if sem["HAS_BIAS"] else None
    tiled = tiled_layout.repack_tiled(w4a16.PackedLinear(tiled_layout.pack_codes(q, bits, 1), scale, bits, group, k, zp, None, bias))
    x = torch.randn(m, k, generator=gen).to(act)
    out = error_bounds.poisoned((m, n), act, device)
    call = w4a16_tiled.make_tiled_call(x.to(device), tiled.to(device), out)

    def check(ran: KernelCall, ref: KernelCall, acc_u: error_bounds.Accumulation = error_bounds.U32) -> None:
        exact, offset, weight_u = w4a16_tiled.tiled_error_terms(tiled, act)
        out_ref = ref.args["out_ptr"].cpu()
        error_bounds.assert_written(ran.args["out_ptr"], kernel)
        bound = error_bounds.exact_weight_bound(out_ref, x, exact, offset, act, weight_u, acc_u, bias)
        error_bounds.assert_within(ran.args["out_ptr"].cpu(), out_ref, bound, kernel)

    return Example(call, ("out_ptr",), nbytes(x, tiled.qweight, tiled.scale, tiled.zero, bias, out), 2 * m * n * k,
                   check)


def _scaled(kernel, types, sem, shape, device, gen) -> Example:
    m, n, k = shape["M"], shape["N"], shape["K"]
    out_dt, bsdt = TORCH_DTYPE[types["out"]], TORCH_DTYPE[types["bscale"]]
    if types["a"] == "i8":
        a = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
        b = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        a = (torch.randn(m, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
        b = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    a_s = torch.rand(m if sem["A_PER_TOKEN"] else 1, generator=gen) * 0.01 + 1e-3
    b_s = (torch.rand(n if sem["B_PER_CHANNEL"] else 1, generator=gen) * 0.01 + 1e-3).to(bsdt)
    bias = torch.randn(n, generator=gen).to(out_dt) if sem["HAS_BIAS"] else None
    out = error_bounds.poisoned((m, n), out_dt, device)
    from lmfoundry.kernels import registry

    call = scaled_mm.make_call(registry.kernel(kernel), a.to(device), a_s.to(device), b.to(device), b_s.to(device),
                               None if bias is None else bias.to(device), out,
                               a_per_token=sem["A_PER_TOKEN"], b_per_channel=sem["B_PER_CHANNEL"])
    def check(ran: KernelCall, ref: KernelCall, acc_u: error_bounds.Accumulation = error_bounds.U32) -> None:
        abs_products = (a.double().abs() @ b.double().abs().t()) * a_s.double().reshape(-1, 1) * b_s.double().reshape(1, -1)
        if bias is not None:
            abs_products = abs_products + bias.double().abs()
        out_ref = ref.args["out_ptr"].cpu()
        error_bounds.assert_written(ran.args["out_ptr"], kernel)
        # int8 sums are exact (int32); fp8 ones as `acc_u` says (`scaled_mm.fp8_accumulation` on a
        # GPU). extra=4: dot_bound's usual 2 plus the epilogue's two scale products (the bias is in
        # abs_products).
        acc = acc_u if types["a"] != "i8" else error_bounds.U32
        bound = error_bounds.dot_bound(out_ref, abs_products, k, out_dt, acc, extra=4)
        error_bounds.assert_within(ran.args["out_ptr"].cpu(), out_ref, bound, kernel)

    return Example(call, ("out_ptr",), nbytes(a, b, a_s, b_s, bias, out), 2 * m * n * k, check)


def _norm(kernel, types, sem, shape, device, gen) -> Example:
    rows, h = shape["M"], shape["H"]
    act, out_dt = TORCH_DTYPE[types["act"]], TORCH_DTYPE[types["out"]]
    x = (torch.randn(rows, h, generator=gen) * (torch.rand(rows, 1, generator=gen) * 3 + 0.1)).to(act)
    w = (torch.rand(h, generator=gen) + 0.5).to(act) if sem["APPLY_NORM"] else None
    res = torch.randn(rows, h, generator=gen).to(act) if sem["HAS_RESIDUAL"] else None
    static = (x.float().abs().amax() / w8a8_reference.QMAX[sem["QUANT"]]).reshape(1) if sem["STATIC_SCALE"] else None
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    out = error_bounds.poisoned((rows, h), out_dt, device)
    scale_out = error_bounds.poisoned((rows,), torch.float32, device) if sem["QUANT"] and not sem["STATIC_SCALE"] else None
    res_out = error_bounds.poisoned((rows, h), act, device) if res is not None else None
    calls: list[KernelCall] = []

    class Capture:
        def run(self, call: KernelCall) -> None:
            calls.append(call)

    norm_quant.rmsnorm_quant(x.to(device), dev(w), 1e-6, quant_dtype=None if not sem["QUANT"] else out_dt,
                             residual=dev(res), static_scale=dev(static), out=out, scale_out=scale_out,
                             residual_out=res_out, launcher=Capture())
    call = calls[0]
    outputs = tuple(n for n in ("out_ptr", "res_out_ptr", "scale_ptr") if
                    (n == "out_ptr") or (n == "res_out_ptr" and res is not None) or (n == "scale_ptr" and scale_out is not None))
    def check(ran: KernelCall, ref: KernelCall, acc_u: error_bounds.Accumulation = error_bounds.U32) -> None:
        h_ref, _, res_ref = norm_quant.reference(x, w, 1e-6, res, norm_quant.QUANT_NONE)
        src = x if res_ref is None else res_ref  # res_ref: the residual sum, when there is a residual
        h_err = error_bounds.rmsnorm_bound(src, w, h_ref, 1e-6) if w is not None else torch.zeros_like(h_ref, dtype=torch.float64)
        for name in outputs:
            error_bounds.assert_written(ran.args[name], f"{kernel}.{name}")
        if res is not None:
            assert res_ref is not None and torch.equal(ran.args["res_out_ptr"].cpu(), res_ref), "residual sum"
        got = ran.args["out_ptr"].cpu()
        if not sem["QUANT"]:
            error_bounds.assert_within(got, h_ref, h_err, kernel)
            return
        s = (static if static is not None else ran.args["scale_ptr"].cpu()).double().reshape(-1, 1)
        q_err = error_bounds.quantization_error(h_ref.double().abs() + h_err, s, out_dt)
        error_bounds.assert_within(got.double() * s, h_ref, q_err + h_err, kernel)

    return Example(call, outputs, nbytes(x, w, res, out, scale_out, res_out), 0, check)


def _silu(kernel, types, sem, shape, device, gen) -> Example:
    rows, inter = shape["M"], shape["I"]
    act = TORCH_DTYPE[types["act"]]
    x = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(act)
    out = error_bounds.poisoned((rows, inter), act, device)
    call = KernelCall(activation.KERNEL, {"x_ptr": x.to(device), "out_ptr": out, "INTER": inter,
                                          "stride_x": 2 * inter, "stride_o": inter}, dict(types), {}, {"M": rows, "I": inter})
    def check(ran: KernelCall, ref: KernelCall, acc_u: error_bounds.Accumulation = error_bounds.U32) -> None:
        g, u = x.double().chunk(2, dim=-1)
        exact = torch.nn.functional.silu(g) * u
        out_ref = ref.args["out_ptr"].cpu()
        error_bounds.assert_written(ran.args["out_ptr"], kernel)
        bound = 2 * error_bounds.unit_roundoff(act) * out_ref.double().abs() + 16 * error_bounds.U32 * exact.abs() + 1e-30
        error_bounds.assert_within(ran.args["out_ptr"].cpu(), out_ref, bound, kernel)

    return Example(call, ("out_ptr",), nbytes(x, out), 0, check)


def _rotary(kernel, types, sem, shape, device, gen) -> Example:
    t, hq, hkv, d = shape["T"], sem["NUM_Q_HEADS"], sem["NUM_KV_HEADS"], sem["HEAD_DIM"]
    act = TORCH_DTYPE[types["act"]]
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(act).to(device)
    q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rotary.rope_tables(inv, 4096)
    pos = torch.randint(0, 4096, (t,), generator=gen)
    q_out, k_out = error_bounds.poisoned((t, hq, d), act, device), error_bounds.poisoned((t, hkv, d), act, device)
    calls: list[KernelCall] = []

    class Capture:
        def run(self, call: KernelCall) -> None:
            calls.append(call)

    rotary.apply_rotary(q, k, pos.to(device), cos.to(device), sin.to(device), q_out, k_out, launcher=Capture())

    def check(ran: KernelCall, ref: KernelCall, acc_u: error_bounds.Accumulation = error_bounds.U32) -> None:
        for name, x in (("q_out_ptr", q), ("k_out_ptr", k)):
            error_bounds.assert_written(ran.args[name], kernel)
            out_ref = ref.args[name].cpu()
            half = d // 2
            c, s = cos[pos][:, None, :].double().abs(), sin[pos][:, None, :].double().abs()
            xa = x.cpu().double().abs()
            mag = torch.cat((xa[..., :half] * c + xa[..., half:] * s, xa[..., half:] * c + xa[..., :half] * s), -1)
            bound = 2 * error_bounds.unit_roundoff(act) * out_ref.double().abs() + 4 * error_bounds.U32 * mag + 1e-30
            error_bounds.assert_within(ran.args[name].cpu(), out_ref, bound, kernel)

    return Example(calls[0], ("q_out_ptr", "k_out_ptr"), 2 * nbytes(q, k) + nbytes(pos), 0, check)


def _lora_rows(t: int, slots: int) -> torch.Tensor:
    """Each row's adapter slot, every slot and the base (-1) in turn."""
    return torch.tensor([(i % (slots + 1)) - 1 for i in range(t)], dtype=torch.int32)


def _lora_shrink(kernel, types, sem, shape, device, gen) -> Example:
    t, k, s_cols, slots = shape["T"], shape["K"], shape["S"], shape.get("L", 4)
    act = TORCH_DTYPE[types["act"]]
    x = torch.randn(t, k, generator=gen).to(act)
    a = (torch.randn(slots, s_cols, k, generator=gen) / k**0.5).to(act)
    rows = _lora_rows(t, slots)
    out = error_bounds.poisoned((t, s_cols), torch.float32, device)
    call = KernelCall(lora.SHRINK, {"x_ptr": x.to(device), "a_ptr": a.to(device), "rows_ptr": rows.to(device),
                                    "s_ptr": out, "K": k, "S": s_cols, "stride_x": k, "stride_al": s_cols * k,
                                    "stride_s": s_cols}, dict(types), {}, {"T": t, "K": k, "S": s_cols})

    def check(ran: KernelCall, ref: KernelCall, acc_u: error_bounds.Accumulation = error_bounds.U32) -> None:
        live = rows >= 0
        products = torch.zeros(t, s_cols, dtype=torch.float64)
        products[live] = torch.einsum("tk,tsk->ts", x[live].double().abs(), a[rows[live].long()].double().abs())
        out_ref = ref.args["s_ptr"].cpu()
        error_bounds.assert_written(ran.args["s_ptr"], kernel)
        error_bounds.assert_within(ran.args["s_ptr"].cpu(), out_ref,
                                   error_bounds.dot_bound(out_ref, products, k, torch.float32, acc_u), kernel)

    return Example(call, ("s_ptr",), nbytes(x, a, rows, out), 2 * t * s_cols * k, check)


def _lora_expand(kernel, types, sem, shape, device, gen) -> Example:
    t, n, r, parts, slots = shape["T"], shape["N"], shape["R"], sem["PARTS"], shape.get("L", 4)
    act = TORCH_DTYPE[types["act"]]
    s = torch.randn(t, parts * r, generator=gen)
    bt = (torch.randn(slots, r, n, generator=gen) / r**0.5).to(act)
    ends = torch.tensor([(p + 1) * n // parts for p in range(parts)], dtype=torch.int32)
    rows = _lora_rows(t, slots)
    y = torch.randn(t, n, generator=gen).to(act)
    call = KernelCall(lora.EXPAND, {"s_ptr": s.to(device), "bt_ptr": bt.to(device), "rows_ptr": rows.to(device),
                                    "ends_ptr": ends.to(device), "y_ptr": y.to(device), "N": n, "R": r, "stride_s": parts * r,
                                    "stride_bl": r * n, "stride_y": n}, dict(types), {"PARTS": parts},
                      {"T": t, "N": n, "R": r})

    def check(ran: KernelCall, ref: KernelCall, acc_u: error_bounds.Accumulation = error_bounds.U32) -> None:
        part = torch.bucketize(torch.arange(n), ends.long(), right=True)
        gathered = s.double().view(t, parts, r)[:, part, :].abs()  # [T, N, R]
        terms = y.double().abs().clone()
        live = rows >= 0
        terms[live] += (gathered[live] * bt[rows[live].long()].double().abs().transpose(1, 2)).sum(-1)
        out, out_ref = ran.args["y_ptr"].cpu(), ref.args["y_ptr"].cpu()
        error_bounds.assert_within(out, out_ref, error_bounds.dot_bound(out_ref, terms, r + 1, act, acc_u), kernel)
        if not torch.equal(out[~live], y[~live]):
            raise AssertionError(f"{kernel}: a base row (slot -1) was written")

    return Example(call, ("y_ptr",), nbytes(s, bt, rows, y, y), 2 * t * n * r, check)


BUILDERS = {
    "w4a16_gemm": _w4a16, "w4a16_gemv": _w4a16, "w4a16_tiled": _w4a16_tiled, "w8a8_gemm": _scaled, "fp8_gemm": _scaled,
    "rmsnorm_quant": _norm, "silu_mul": _silu, "rotary": _rotary, "store_kv": store_kv_example,
    "paged_prefill": attention_example, "paged_decode": attention_example,
    "paged_decode_split": attention_example,
    "paged_decode_reduce": decode_reduce_example, "lora_shrink": _lora_shrink, "lora_expand": _lora_expand,
}


def build(kernel: str, types: dict[str, str], semantics: dict[str, Any], shape: dict[str, int],
          device: str | torch.device = "cpu", seed: int = 0) -> Example:
    """An example call of `kernel` for these dtypes/semantics/shape, with inputs on `device`."""
    gen = torch.Generator().manual_seed(seed)
    return BUILDERS[kernel](kernel, types, semantics, shape, device, gen)


def run_and_check(ex: Example, launcher: Launcher, acc_u: error_bounds.Accumulation = error_bounds.U32) -> KernelCall:
    """Run `ex` with `launcher` and with the reference on copies; raise if outside the bounds.
    Returns the reference's call (its outputs), for checking another implementation against it."""
    ran = ex.clone()
    launcher.run(ran)
    ref = ex.clone()
    ReferenceLauncher().run(ref)
    ex.check(ran, ref, acc_u)
    return ref


def time_ms(ex: Example, launcher: Launcher) -> float:
    """Median milliseconds of one call (Triton's do_bench; GPU only)."""
    import triton.testing

    call = ex.clone()
    return float(triton.testing.do_bench(lambda: launcher.run(call), return_mode="median"))


def shape_for(kernel: str, cover_shape: dict[str, int], rows: int) -> dict[str, int]:
    """Example shape for a bundle cover: its static shape plus a row count / token count."""
    shape = dict(cover_shape)
    if kernel in ("w4a16_gemm", "w4a16_gemv", "w4a16_tiled", "w8a8_gemm", "fp8_gemm", "rmsnorm_quant", "silu_mul"):
        shape["M"] = rows
    elif kernel in ("rotary", "store_kv", "lora_shrink", "lora_expand"):
        shape["T"] = rows
    return shape

