"""The tiled W4A16/W8A16 layout (compile-time repack) and its kernel `w4a16_tiled`.

Layout: `repack_tiled` then `unrepack_tiled` gives back the compressed-tensors tensors bit for bit
(codes, scales, packed zero points, act-order g_idx, bias), with and without a row permutation.

Kernel vs the reference (dequantize-then-matmul in float32, `tiled_reference`), error bound from
the arithmetic (`checks.exact_weight_bound`, derivation in its docstring): the kernel multiplies
exact integer weights (q - z) — bf16 as (128 + q) with the offset cancelled per group by a second
fp32 sum of x — and scales fp32 partial sums, so against a reference that rounds every dequantized
weight to the scale and activation dtypes,

    |out - ref| <= 2 u_out |ref| + w_u S + gamma_{K+2} (1 + w_u) S + gamma_{K+32} (S + 2 O)

with S = sum_k |x_k| |(q_k - z) s| (+ |bias|), O = sum_k |x_k| |s| (B + 2^b) (the cancelled offsets,
0 for fp16), w_u = u_s + u_a + u_s u_a, gamma_n = n u / (1 - n u) for fp32 accumulation (u = 2^-24
in the interpreter). Outputs are NaN-filled first: every element must be written. Shapes cover
M = 1, 3, 16, 64 (and 70, where the op passes no split-K workspace), K not a multiple of the split
(empty splits too), N not a multiple of the tile, group sizes 32/64/128 and per channel, symmetric
and asymmetric, act-order, 4 and 8 bits, bf16 and fp16.
"""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels import tiled_layout, w4a16, w4a16_tiled
from lmfoundry.kernels.dispatch import JitLauncher, ReferenceLauncher
from lmfoundry.kernels.error_bounds import assert_within, assert_written, exact_weight_bound, poisoned
from lmfoundry.kernels.spec import TileConfig

BF, F16 = torch.bfloat16, torch.float16


def make_packed(n: int, k: int, bits: int, group: int, symmetric: bool, actorder: bool, dtype: torch.dtype,
                gen: torch.Generator, bias: bool = False) -> w4a16.PackedLinear:
    """A random compressed-tensors linear (every code, scale and zero point random, scales > 0)."""
    groups = k // group if group else 1
    q = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int32)
    scale = (torch.rand(n, groups, generator=gen) * 0.02 + 0.002).to(dtype)
    zp = None
    if not symmetric:
        zp = tiled_layout.pack_codes(torch.randint(0, 1 << bits, (n, groups), generator=gen, dtype=torch.int32), bits, 0)
    g_idx = None
    if actorder:
        g_idx = ((torch.arange(k) // (group or k))[torch.randperm(k, generator=gen)]).to(torch.int32)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return w4a16.PackedLinear(tiled_layout.pack_codes(q, bits, 1), scale, bits, group, k, zp, g_idx, b)


def config(bm: int, bn: int, split: int) -> TileConfig:
    return TileConfig.make(num_warps=4, num_stages=2, BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split)


def run_and_check(m, n, k, bits, group, symmetric, actorder, dtype, bias, cfg, gen, device, acc_u):
    w = make_packed(n, k, bits, group, symmetric, actorder, dtype, gen, bias)
    t = tiled_layout.repack_tiled(w)
    x = torch.randn(m, k, generator=gen).to(dtype)
    out = poisoned((m, n), dtype, device)
    launcher = JitLauncher(pick_config=(lambda call: cfg) if cfg is not None else None)
    w4a16_tiled.w4a16_tiled_linear(x.to(device), t.to(device), out=out, launcher=launcher)
    assert_written(out, "w4a16_tiled")
    ref = w4a16_tiled.tiled_reference(x, t)
    # the tiled reference is the compressed-tensors reference (same rounding points, K permuted)
    legacy = w4a16.reference(x, w.weight_packed, w.weight_scale, w.weight_zero_point, w.weight_g_idx, w.bias, bits,
                             group)
    exact, offset, weight_u = w4a16_tiled.tiled_error_terms(t, dtype)
    xs = x.index_select(1, t.perm.long()) if t.perm is not None else x
    bound = exact_weight_bound(ref, xs, exact, offset, dtype, weight_u, acc_u, t.bias)
    assert_within(legacy, ref, bound, "tiled reference vs compressed-tensors reference")
    assert_within(out.cpu(), ref, bound, f"w4a16_tiled {m}x{n}x{k} W{bits} g{group}")
    return out


CASES = [
    # M, N, K, bits, group, symmetric, actorder, dtype, bias, (BLOCK_M, BLOCK_N, SPLIT_K)
    (1, 96, 256, 4, 32, True, False, BF, False, (16, 64, 3)),  # M=1; 2 panels over 3 splits: one is empty
    (3, 80, 640, 4, 64, False, False, BF, True, (16, 32, 3)),  # 5 panels / 3 splits; N not a tile multiple
    (16, 128, 384, 4, 128, False, True, F16, False, (16, 128, 2)),  # act-order (x permuted by the op)
    (64, 64, 512, 4, 128, True, True, BF, True, (64, 64, 3)),  # M=64: the largest split-K bucket
    (64, 136, 256, 4, 0, False, False, F16, False, (32, 64, 2)),  # per channel, two m-tiles, split
    (20, 72, 100, 4, 0, True, False, BF, False, (32, 64, 1)),  # K=100: a partial plane
    (5, 64, 192, 8, 64, False, False, BF, False, (16, 64, 2)),  # 8-bit bf16 (fp32 magic), 3 panels of 64
    (2, 48, 256, 8, 128, False, True, F16, True, (16, 16, 2)),  # 8-bit fp16, g128 spans 2 panels
    (70, 64, 256, 4, 32, False, False, BF, False, (64, 64, 4)),  # M > SPLIT_MAX_M: split turned off
]


@pytest.mark.parametrize("m,n,k,bits,group,symmetric,actorder,dtype,bias,tiles", CASES)
def test_tiled_kernel_matches_reference(m, n, k, bits, group, symmetric, actorder, dtype, bias, tiles, gen, device,
                                        acc_u):
    run_and_check(m, n, k, bits, group, symmetric, actorder, dtype, bias, config(*tiles), gen, device, acc_u)


def test_default_and_hopper_table_configs(gen, device, acc_u):
    """The kernel's default tiles and the Hopper table's decode bucket (BLOCK_N 64, split from the SMs)."""
    from lmfoundry.kernels import tiles

    run_and_check(3, 64, 256, 4, 64, True, False, BF, False, None, gen, device, acc_u)
    shape = {"N": 256, "K": 4096, "bits": 4, "group": 128}
    lo, hi, cfg = tiles.buckets(90, "w4a16_tiled", shape)[0]
    assert (lo, hi, cfg["BLOCK_M"], cfg["BLOCK_N"]) == (1, 16, 16, 64) and cfg["SPLIT_K"] > 1
    run_and_check(1, 256, 4096, 4, 128, False, False, BF, False, cfg, gen, device, acc_u)



def llm_decode_configs() -> list[tuple[int, TileConfig]]:
    """(rows, config): each distinct Hopper config the GPU benchmark's LLM layer shapes launch at
    M = 1, 16 and 64 (`tiles.buckets`, what compile and the runtime take; tests/compile/
    test_decode_sass.py checks their cubins), with the fewest rows that launch it."""
    from helpers import gpu_kernels_benchmark

    from lmfoundry.kernels import tiles

    out: dict[TileConfig, int] = {}
    for n, k in gpu_kernels_benchmark().gpu_matmul_sections.W4A16_LLM_SHAPES:
        for m in (1, 16, 64):
            shape = {"N": n, "K": k, "bits": 4, "group": 128}
            out.setdefault(next(c for lo, hi, c in tiles.buckets(90, "w4a16_tiled", shape) if lo <= m <= hi), m)
    return [(m, c) for c, m in out.items()]


def test_llm_decode_configs_on_small_layers(gen, device, acc_u):
    """The configs the 8B/70B layers decode with (64-row tiles, 2-6 splits), on a layer small enough
    for the interpreter whose K gives every split two panels: g128 symmetric; with the most splits
    also M = 16, g32 asymmetric with a bias, and fp16."""
    configs = llm_decode_configs()
    assert {c["SPLIT_K"] for _, c in configs} >= {2, 3, 6} and {c["BLOCK_N"] for _, c in configs} == {64}
    most = max(c["SPLIT_K"] for _, c in configs)
    for m, cfg in configs:
        k = 2 * 128 * cfg["SPLIT_K"]
        run_and_check(m, 64, k, 4, 128, True, False, BF, False, cfg, gen, device, acc_u)
        if m == 1 and cfg["SPLIT_K"] == most:
            run_and_check(16, 64, k, 4, 128, True, False, BF, False, cfg, gen, device, acc_u)
            run_and_check(m, 64, k, 4, 32, False, False, BF, True, cfg, gen, device, acc_u)
            run_and_check(m, 64, k, 4, 128, False, False, F16, False, cfg, gen, device, acc_u)

def test_split_k_is_deterministic_and_resets_its_counters(gen, device):
    """Splits add up in a fixed order: two runs agree bit for bit; every tile counter is back to 0."""
    w = tiled_layout.repack_tiled(make_packed(96, 512, 4, 32, False, False, BF, gen)).to(device)
    x = torch.randn(5, 512, generator=gen).to(BF).to(device)
    runs = [w4a16_tiled.w4a16_tiled_linear(x, w, launcher=JitLauncher(lambda call: config(16, 32, 3))) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert int(w4a16_tiled.split_locks(torch.device(device), 1).abs().sum()) == 0


def test_act_order_folded_into_the_producer(gen, device, acc_u):
    """down_proj's K permutation applied to the rows of gate/up (what compile does): SiLU(gate) * up
    comes out in down's K order, and down (input_permuted, no gather) gives the unfolded result."""
    inter, hidden = 256, 128
    gate, up = (make_packed(inter, hidden, 4, 32, True, False, BF, gen) for _ in range(2))
    down = make_packed(hidden, inter, 4, 64, False, True, BF, gen)
    perm = tiled_layout.act_order_perm(down.weight_g_idx, 64).long()
    x = torch.randn(3, hidden, generator=gen).to(BF)

    def mlp(g: tiled_layout.TiledLinear, u: tiled_layout.TiledLinear, d: tiled_layout.TiledLinear) -> tuple[torch.Tensor, torch.Tensor]:
        run = lambda w, v: w4a16_tiled.w4a16_tiled_linear(v, w, launcher=ReferenceLauncher())  # noqa: E731
        h = (torch.nn.functional.silu(run(g, x).float()) * run(u, x).float()).to(BF)
        return h, run(d, h)

    plain_h, plain = mlp(tiled_layout.repack_tiled(gate), tiled_layout.repack_tiled(up), tiled_layout.repack_tiled(down))
    folded = [tiled_layout.repack_tiled(gate, out_perm=perm), tiled_layout.repack_tiled(up, out_perm=perm),
              tiled_layout.repack_tiled(down, input_permuted=True)]
    folded_h, folded_out = mlp(*folded)
    assert torch.equal(folded_h, plain_h[:, perm]) and torch.equal(folded_out, plain)
    # the kernel on the pre-permuted input (no gather)
    out = poisoned((3, hidden), BF, device)
    w4a16_tiled.w4a16_tiled_linear(folded_h.to(device), folded[2].to(device), out=out)
    assert_written(out, "folded down_proj")
    exact, offset, weight_u = w4a16_tiled.tiled_error_terms(folded[2], BF)
    bound = exact_weight_bound(folded_out, folded_h, exact, offset, BF, weight_u, acc_u)
    assert_within(out.cpu(), folded_out, bound, "folded down_proj")


ROUND_TRIP = [
    # N, K, bits, group, symmetric, actorder, row permutation
    (96, 256, 4, 32, True, False, False),
    (80, 640, 4, 64, False, False, True),
    (130, 384, 4, 128, False, True, True),
    (72, 100, 4, 0, True, False, False),
    (64, 192, 8, 64, False, False, False),
    (48, 256, 8, 128, False, True, True),
    (33, 96, 8, 0, False, False, True),
]


@pytest.mark.parametrize("n,k,bits,group,symmetric,actorder,rows", ROUND_TRIP)
def test_repack_round_trip_is_exact(n, k, bits, group, symmetric, actorder, rows, gen):
    w = make_packed(n, k, bits, group, symmetric, actorder, BF, gen, bias=True)
    out_perm = torch.randperm(n, generator=gen).to(torch.int32) if rows else None
    t = tiled_layout.repack_tiled(w, out_perm=out_perm)
    assert t.qweight.shape == (-(-n // 128), -(-k // tiled_layout.panel_k(bits)), 128, 16)
    assert t.scale.shape[1] % 128 == 0
    back = tiled_layout.unrepack_tiled(tiled_layout.TiledLinear.from_tensors(t.to_tensors()))
    for name in ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "bias"):
        a, b = getattr(w, name), getattr(back, name)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), name
    assert (back.bits, back.group_size, back.in_features) == (bits, group, k)
    # stored order: rows by out_perm, columns by the act-order permutation
    deq = w.dequantize()
    if t.perm is not None:
        deq = deq[:, t.perm.long()]
    if out_perm is not None:
        deq = deq[out_perm.long()]
    assert torch.equal(t.dequantize(), deq)


def test_unbalanced_act_order_is_refused():
    g_idx = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1], dtype=torch.int32)  # groups of 3 and 5, not of 4
    with pytest.raises(ValueError, match="equal groups of 4"):
        tiled_layout.act_order_perm(g_idx, 4)


def test_pair_packing_matches_the_kernel_order():
    """Word w of a panel row holds k = 32 p + 2 w + h in code p + h * PACK/2: one shift and mask of a
    word gives the pair (2w, 2w + 1) of plane p in its two 16-bit halves."""
    n, k = 1, 128
    codes = (torch.arange(k, dtype=torch.int32) % 16).reshape(1, k)
    t = tiled_layout.repack_tiled(w4a16.PackedLinear(tiled_layout.pack_codes(codes, 4, 1), torch.ones(1, 1), 4, 0, k))
    word = int(t.qweight[0, 0, 0, 5]) & 0xFFFFFFFF  # row 0, word 5
    for p in range(4):
        lo, hi = (word >> (4 * p)) & 0xF, (word >> (16 + 4 * p)) & 0xF
        assert (lo, hi) == ((32 * p + 10) % 16, (32 * p + 11) % 16)
    assert torch.equal(t.codes(), codes[:, :k]) and n == 1


SLOW_CASES = [
    (16, 256, 2048, 4, 128, False, False, BF, True, (16, 128, 8)),
    (64, 384, 1024, 4, 32, False, True, BF, False, (64, 64, 2)),
    (1, 512, 1536, 4, 64, True, False, F16, False, (16, 128, 5)),
    (33, 200, 768, 8, 0, False, False, BF, True, (64, 64, 3)),
]


@pytest.mark.slow
@pytest.mark.heavy  # the interpreter at large shapes; the fast tier runs the kernel at small ones
@pytest.mark.parametrize("m,n,k,bits,group,symmetric,actorder,dtype,bias,tiles", SLOW_CASES)
def test_tiled_kernel_larger_shapes(m, n, k, bits, group, symmetric, actorder, dtype, bias, tiles, gen, device, acc_u):
    run_and_check(m, n, k, bits, group, symmetric, actorder, dtype, bias, config(*tiles), gen, device, acc_u)
