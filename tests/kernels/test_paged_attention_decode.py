"""FlashDecoding (`paged_attention.paged_decode`): the split kernel, the log-sum-exp merge kernel and
the split heuristic, against the PyTorch reference, under the interpreter on CPU (a GPU if present).

Error bound (`checks.attention_bound(..., p_split=True, splits=S)`), derived from the arithmetic:
both sides compute softmax(q·K^T·sm)·V with fp32 scores and fp32 accumulation; the reference in
float32 torch, the kernel with
  - scores: model-dtype q times K codes converted exactly to the model dtype, fp32 tensor-core
    accumulation: |Δs| ≤ γ_{D+4}·Σ|q||k|·sm per side;
  - exp2 (fp32) of rounded arguments in the online softmax: each key-tile rescale and the split
    merge add ≤ u32·2·max|s| + 4·u32 to a weight's relative error ε;
  - P as hi + lo in the model dtype (u² relative: 2^-16 bf16, 2^-22 fp16; fp16's subnormal P adds
    n·2^-24/P_SCALE·max|v|);
  - fp32 sums of the PV products and the normaliser over n keys and S splits: γ_{n+S+2}·max|v|;
  - one rounding of the output to the model dtype on each side: 2·u_out·|ref|.
A weighted mean whose weights are off by ≤ ε moves by ≤ 2ε/(1-ε)·max|v|, so the bound is
(2ε/(1-ε) + 2γ_{n+S+2})·max|v| + 2·u_out·|ref|: a few ulp of the output dtype (the u_out term
dominates) plus terms that grow with n·u32, i.e. with the context length, not with its square.
Outputs are filled with NaN before each launch and every element must be overwritten.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import gpu_kernels_benchmark

from lmfoundry.kernels import harness, kv_layout, paged_attention
from lmfoundry.kernels.dispatch import JitLauncher, ReferenceLauncher
from lmfoundry.kernels.error_bounds import assert_within, assert_written, attention_bound, poisoned
from lmfoundry.kernels.kv_layout import PagedKVCache
from lmfoundry.kernels.spec import KernelCall

E4M3 = torch.float8_e4m3fn


def make_cache(lens, hkv, d, page, dtype, cache_dtype, gen):
    """Sequences of `lens` tokens stored by the reference store on shuffled blocks (random,
    non-zero keys and values; quantized caches with calibrated per-head scales)."""
    per_seq = [max(1, -(-n // page)) for n in lens]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lens), max(per_seq) + 1, dtype=torch.int32)  # one spare column: unused entries
    table[:, -1] = perm[-1]
    used = 0
    for b, nb in enumerate(per_seq):
        table[b, :nb] = perm[used : used + nb]
        used += nb
    slots = torch.cat([table[b, torch.arange(n) // page].long() * page + torch.arange(n) % page
                       for b, n in enumerate(lens)])
    k = (torch.randn(sum(lens), hkv, d, generator=gen) * 1.5).to(dtype)
    v = torch.randn(sum(lens), hkv, d, generator=gen).to(dtype)
    quantized = cache_dtype in (torch.int8, E4M3)

    def scale(x):
        amax = x.float().abs().amax(dim=(0, 2))
        return amax / kv_layout.kv_code_max(cache_dtype) * (1 + 0.1 * torch.rand(hkv, generator=gen))

    cache = PagedKVCache.allocate(num_blocks, page, hkv, d, cache_dtype, "cpu",
                                  scale(k) if quantized else None, scale(v) if quantized else None)
    kv_layout.store_reference(k, v, cache, slots.to(torch.int32))
    return cache, table


def to(cache: PagedKVCache, device: str) -> PagedKVCache:
    return PagedKVCache(*(t.to(device) for t in (cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale)))


def check_decode(dtype, cache_dtype, hq, hkv, d, page, lens, splits, gen, device, min_split_pages=1):
    cdt = dtype if cache_dtype == "model" else cache_dtype
    cache, table = make_cache(lens, hkv, d, page, dtype, cdt, gen)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    out = poisoned(tuple(q.shape), dtype, device)
    paged_attention.paged_decode(q.to(device), to(cache, device), table.to(device), ctx.to(device), out=out,
                                 num_splits=splits, min_split_pages=min_split_pages)
    assert_written(out, "decode")
    if splits is None:  # what the op chose
        splits = paged_attention.decode_splits(len(lens), hkv, table.shape[1] * page,
                                               paged_attention.device_sm_count(torch.device(device)), page)
    sm = 1 / math.sqrt(d)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    ref = paged_attention.reference(q, cache, table, cu, ctx, sm)
    bound = attention_bound(q, cache, table, cu, ctx, ref, sm, dtype, p_split=True, splits=splits)
    assert_within(out.cpu(), ref, bound, f"decode S={splits}")
    return out.cpu(), ref, bound


# dtype, cache dtype, Hq, Hkv, D, block size, context lengths, splits
FAST = [
    (torch.bfloat16, "model", 4, 4, 64, 16, [70, 1, 33], 3),  # MHA (group 1), ragged, partial last blocks
    (torch.float16, "model", 12, 4, 64, 16, [100, 16], 1),  # GQA 3, unsplit: the kernel writes the output
    (torch.bfloat16, torch.int8, 8, 2, 128, 16, [97, 40], 4),  # GQA 4, int8 KV, head_dim 128
    (torch.float16, E4M3, 6, 2, 64, 16, [130], 5),  # GQA 3, fp8 KV, fp16: hi/lo P near subnormals
    (torch.bfloat16, E4M3, 4, 1, 128, 8, [45, 9, 64], 2),  # GQA 4, blocks of 8: one tile spans 8 blocks
    (torch.float16, torch.int8, 4, 4, 64, 128, [200, 3], 2),  # blocks of 128: tiles inside one block
    (torch.bfloat16, "model", 3, 1, 80, 32, [50, 0], 2),  # head_dim 80 (padded to 128), an empty context
]


@pytest.mark.parametrize("dtype,cache_dtype,hq,hkv,d,page,lens,splits", FAST)
def test_decode_matches_reference(dtype, cache_dtype, hq, hkv, d, page, lens, splits, gen, device):
    check_decode(dtype, cache_dtype, hq, hkv, d, page, lens, splits, gen, device)


SLOW = [
    (torch.bfloat16, "model", 32, 8, 128, 16, [1000, 731, 17, 512], 7),  # Llama-3-8B heads, many splits
    (torch.float16, torch.int8, 12, 4, 128, 16, [2048, 1500], 16),
    (torch.bfloat16, E4M3, 16, 4, 64, 32, [1600, 333, 1], 11),
    (torch.float16, "model", 8, 8, 128, 64, [900, 64, 65], 1),  # long unsplit rows
    (torch.bfloat16, torch.int8, 64, 1, 64, 16, [300, 120], 3),  # MQA: 64 query heads in one program
]


@pytest.mark.slow
@pytest.mark.heavy  # the interpreter at long lengths; the fast tier runs the kernel at short ones
@pytest.mark.parametrize("dtype,cache_dtype,hq,hkv,d,page,lens,splits", SLOW)
def test_decode_matches_reference_long(dtype, cache_dtype, hq, hkv, d, page, lens, splits, gen, device):
    check_decode(dtype, cache_dtype, hq, hkv, d, page, lens, splits, gen, device)


def test_default_split_count_runs(gen, device):
    """`num_splits=None` picks `decode_splits` for the device and the table width."""
    check_decode(torch.bfloat16, "model", 4, 2, 64, 16, [300, 20], None, gen, device, min_split_pages=None)


def test_one_nonempty_split_equals_unsplit(gen, device):
    """A sequence that fits in one split gives bit-identical output with or without the merge
    kernel (a CUDA graph captured with more splits than an eager step uses decodes the same)."""
    dtype, hq, hkv, d = torch.bfloat16, 8, 2, 64
    cache, table = make_cache([90, 41], hkv, d, 16, dtype, dtype, gen)
    ctx = torch.tensor([90, 41], dtype=torch.int32)
    q = torch.randn(2, hq, d, generator=gen).to(dtype).to(device)
    outs = []
    for splits in (1, 6):
        out = poisoned(tuple(q.shape), dtype, device)
        paged_attention.paged_decode(q, to(cache, device), table.to(device), ctx.to(device), out=out,
                                     num_splits=splits, min_split_pages=8)  # 8 blocks = 128 tokens: one split
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])


def _calls(q, cache, table, ctx, splits, min_split_pages=1):
    calls: list[KernelCall] = []

    class Capture:
        def run(self, call: KernelCall) -> None:
            calls.append(call)

    out = poisoned(tuple(q.shape), q.dtype, q.device)
    paged_attention.paged_decode(q, cache, table, ctx, out=out, launcher=Capture(), num_splits=splits,
                                 min_split_pages=min_split_pages)
    return calls, out


def test_split_states_follow_the_reference_contract(gen, device):
    """Kernel split + reference merge, and reference split + kernel merge, both give the attention
    output: the partial-state conventions (log2 max, P_SCALE, v_scale folded in) match on both
    sides, so any launcher may run either half. Every partial state is written, empty splits too."""
    dtype, cdt, hq, hkv, d, page = torch.float16, torch.int8, 6, 2, 64, 16
    lens = [75, 20]  # 4 splits: 2+2+1 blocks of sequence 0 (split 3 empty), 1+1 of sequence 1 (2, 3 empty)
    cache, table = make_cache(lens, hkv, d, page, dtype, cdt, gen)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(2, hq, d, generator=gen).to(dtype)
    sm = 1 / math.sqrt(d)
    cu = torch.arange(3, dtype=torch.int32)
    ref = paged_attention.reference(q, cache, table, cu, ctx, sm)
    bound = attention_bound(q, cache, table, cu, ctx, ref, sm, dtype, p_split=True, splits=4)
    for split_ex, reduce_ex in ((JitLauncher(), ReferenceLauncher()), (ReferenceLauncher(), JitLauncher())):
        (split, merge), out = _calls(q.to(device), to(cache, device), table.to(device), ctx.to(device), 4)
        assert split.kernel.name == "paged_decode_split" and merge.kernel.name == "paged_decode_reduce"
        for name in ("part_m_ptr", "part_l_ptr", "part_acc_ptr"):
            split.args[name].fill_(float("nan"))
        split_ex.run(split)
        for name in ("part_m_ptr", "part_l_ptr", "part_acc_ptr"):
            assert_written(split.args[name], name)
        part_l = split.args["part_l_ptr"].cpu()
        assert bool((part_l[0, :, 3] == 0).all() and (part_l[1, :, 2:] == 0).all())  # empty splits: l = 0
        assert bool((part_l[0, :, :3] > 0).all() and (part_l[1, :, :2] > 0).all())
        reduce_ex.run(merge)
        assert_written(out, "merged")
        assert_within(out.cpu(), ref, bound, f"split {type(split_ex).__name__} + merge {type(reduce_ex).__name__}")
    m, total, acc = paged_attention.decode_partials_reference(q.to(device), to(cache, device), table.to(device),
                                                              ctx.to(device), sm, 4, 1)
    # the last round's split ran the reference call: the same states as the function
    assert torch.equal(split.args["part_m_ptr"], m) and torch.equal(split.args["part_l_ptr"], total)
    assert torch.equal(split.args["part_acc_ptr"], acc)


def test_one_program_per_kv_head_and_split(gen, device):
    """GQA: the grid is (KV heads, splits, sequences): each KV block is read by one program, whatever
    the number of query heads sharing it."""
    cache, table = make_cache([40, 40, 40], 2, 64, 16, torch.bfloat16, torch.bfloat16, gen)
    q = torch.randn(3, 8, 64, generator=gen).bfloat16()
    (split, merge), _ = _calls(q, cache, table, torch.full((3,), 40, dtype=torch.int32), 5)
    assert split.grid(split.kernel.default_config(split.shape)) == (2, 5, 3)
    assert split.kernel.default_config(split.shape)["BLOCK_G"] == 16  # 4 heads padded to an MMA tile
    assert merge.grid(merge.kernel.default_config(merge.shape)) == (8, 3, 1)
    (split,), _ = _calls(q, cache, table, torch.full((3,), 40, dtype=torch.int32), 1)  # unsplit: no merge


def test_bound_catches_a_lost_split(gen):
    """The bound is tight enough to catch a merge that drops one split (sanity of the test)."""
    dtype, hq, hkv, d = torch.bfloat16, 4, 2, 64
    cache, table = make_cache([256], hkv, d, 16, dtype, dtype, gen)
    ctx = torch.tensor([256], dtype=torch.int32)
    q = torch.randn(1, hq, d, generator=gen).to(dtype)
    sm = 1 / math.sqrt(d)
    m, total, acc = paged_attention.decode_partials_reference(q, cache, table, ctx, sm, 4, 1)
    lost = paged_attention.merge_partials_reference(m[..., 1:], total[..., 1:], acc[..., 1:, :]).to(dtype)
    cu = torch.arange(2, dtype=torch.int32)
    ref = paged_attention.reference(q, cache, table, cu, ctx, sm)
    full = paged_attention.merge_partials_reference(m, total, acc).to(dtype)
    bound = attention_bound(q, cache, table, cu, ctx, ref, sm, dtype, p_split=True, splits=4)
    assert_within(full, ref, bound, "reference merge")
    with pytest.raises(AssertionError):
        assert_within(lost, ref, bound, "lost split")


H200_SMS = 132


@pytest.mark.parametrize("batch,hkv,ctx,expect", [
    (64, 8, 4096, 1),  # 512 programs already fill 132 SMs twice: unsplit, no merge launch
    (1, 8, 4096, None),  # 8 programs: split until the SMs are full
    (16, 8, 4096, None),
    (1, 8, 100, 1),  # shorter than one split's minimum
    (4, 1, 32768, None),
])
def test_split_heuristic(batch, hkv, ctx, expect):
    s = paged_attention.decode_splits(batch, hkv, ctx, H200_SMS, 16)
    if expect is not None:
        assert s == expect
        return
    slots = paged_attention.CTAS_PER_SM * H200_SMS
    assert s > 1
    assert batch * hkv * s >= 0.8 * slots or s == paged_attention.MAX_SPLITS  # the grid fills the GPU
    assert ctx / s >= paged_attention.MIN_SPLIT_TOKENS  # each split keeps enough keys to pay for its state
    pages = -(-ctx // 16)
    assert -(-pages // -(-pages // s)) == s  # no split left empty at the bound


def test_split_heuristic_edges():
    assert paged_attention.decode_splits(3, 2, 8192, 1, 16) == 1  # CPU: one "SM", nothing to fill
    assert paged_attention.decode_splits(0, 8, 4096, H200_SMS, 16) == 1
    small = [paged_attention.decode_splits(b, 8, 4096, H200_SMS, 16) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert small == sorted(small, reverse=True)  # larger batches never split more
    assert paged_attention.device_sm_count(torch.device("cpu")) == 1


def test_gpu_benchmark_decode_section_shapes():
    """benchmarks/gpu_kernels.py (GPU only) imports on CPU, and its paged-decode section's shapes
    (gpu_attention_sections.py), byte counts and split choices are what the comparison claims."""
    bench = gpu_kernels_benchmark()
    attention = bench.gpu_attention_sections
    cases = attention.decode_cases(90, quick=False)
    assert {(c["B"], c["ctx"]) for c in cases} == {(1, 4096), (16, 4096), (64, 4096)}
    assert {c["kv"] for c in cases} == {"bf16", "i8", "fp8e4nv"}
    assert {c["kv"] for c in attention.decode_cases(80, quick=False)} == {"bf16", "i8"}  # no fp8 before sm_89
    big = next(c for c in cases if c["B"] == 64 and c["kv"] == "bf16")
    kv = 2 * 64 * 4096 * 8 * 128 * 2  # K and V, bf16: 1 GiB
    moved = attention.decode_bytes(big)
    assert moved["sdpa"] == kv + 2 * 64 * 32 * 128 * 2
    assert moved["paged"] == moved["sdpa"] + 64 * 256 * 4 + 64 * 4  # + block table and lengths
    int8 = attention.decode_bytes({**big, "kv": "i8"})
    assert int8["paged"] - 64 * 256 * 4 - 64 * 4 - 2 * 64 * 32 * 128 * 2 == kv // 2
    splits = {c["B"]: paged_attention.decode_splits(c["B"], c["Hkv"], c["ctx"], H200_SMS, c["PAGE"]) for c in cases}
    assert splits[64] == 1 and splits[16] > 1 and splits[1] > splits[16]
    # every decode case of the per-kernel table builds its example (CPU tensors; checked on the GPU)
    for kernel, types, sem, shape, rows in bench.cases(80, quick=True):
        if kernel.startswith("paged_decode"):
            shape = bench.bench_shape(kernel, shape, 2)
            assert shape["B"] == 2 and shape["ctx"] == 2048
            ex = harness.build(kernel, types, sem, {**shape, "ctx": 40}, "cpu")  # short: built on CPU
            assert ex.call.kernel.name == kernel and ex.bytes > 0 and not rows
