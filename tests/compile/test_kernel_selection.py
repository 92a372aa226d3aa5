"""Specializations and fusions derived from a checkpoint (no compilation)."""

from __future__ import annotations

import pytest

from lmfoundry.compile.kernel_selection import select_kernels
from lmfoundry.compile.source import load_checkpoint
from lmfoundry.errors import UserError
from lmfoundry.kernels import tiles


def fusion(build, name):
    return next(f for f in build.fusions if f.name == name)


def test_w4a16_plan(make_checkpoint):
    ck = load_checkpoint(make_checkpoint(scheme="w4a16", group=32, weights=False))
    build = select_kernels(ck, [90, 80])
    assert fusion(build, "self_attn.qkv_proj").applied and fusion(build, "mlp.gate_up_proj").applied
    assert not fusion(build, "input_layernorm+qkv_proj.input_quant").applied  # weight-only: nothing to quantize
    gemms = {g.name: (g.n, g.k) for g in build.gemms}
    assert gemms["self_attn.qkv_proj"] == ((2 + 2 * 1) * 64, 128)
    assert gemms["mlp.gate_up_proj"] == (512, 128) and gemms["mlp.down_proj"] == (128, 256)
    kernels = {(s.capability, s.kernel) for s in build.specs}
    for cap in (90, 80):
        for k in ("w4a16_tiled", "rmsnorm_quant", "silu_mul", "rotary", "store_kv", "paged_prefill",
                  "paged_decode_split", "paged_decode_reduce"):
            assert (cap, k) in kernels
        assert (cap, "w4a16_gemm") not in kernels and (cap, "w4a16_gemv") not in kernels  # the tiled layout's kernel
        assert (cap, "paged_decode") not in kernels  # the unsplit decode kernel is only the benchmark's baseline
    # Every GEMM shape is covered for every row count, exactly once per arch and kernel.
    for cap in (90, 80):
        for name, (n, k) in gemms.items():
            if name == "lm_head":
                continue
            rows = sorted(tuple(c["rows"]) for s in build.specs if s.capability == cap and s.kernel.startswith("w4a16")
                          for c in s.covers if c["shape"] == {"N": n, "K": k, "bits": 4, "group": 32})
            assert rows[0][0] == 1 and rows[-1][1] == tiles.UNBOUNDED
            assert all(a[1] + 1 == b[0] for a, b in zip(rows, rows[1:], strict=False))
    # Hopper W4A16 tiles are wgmma-sized: 64+ weight rows (the MMA's M side), any number of tokens.
    tiled = [s for s in build.specs if s.capability == 90 and s.kernel == "w4a16_tiled"]
    assert all(s.config["BLOCK_N"] >= 64 and s.expected_sass() == ("HGMMA",) for s in tiled)
    assert min(s.config["BLOCK_M"] for s in tiled) == 16
    assert all(s.semantics == {"BITS": 4, "GROUP_SIZE": 32, "HAS_ZP": False, "HAS_BIAS": False} for s in tiled)
    assert len({s.key() for s in build.specs}) == len(build.specs)


def test_alignment_assumptions_follow_the_shapes(make_checkpoint):
    # K = 128 (qkv, gate_up), 256 (down): activation rows and K are multiples of 16 -> assumed.
    ck = load_checkpoint(make_checkpoint(scheme="w4a16", group=32, weights=False))
    spec = next(s for s in select_kernels(ck, [90]).specs if s.kernel == "w4a16_tiled")
    assert {"N", "K", "stride_xm", "stride_qn", "stride_sg", "stride_om"} <= set(spec.aligned)
    # hidden 72 -> K = 72: the activation row stride is not a multiple of 16: not assumed; the tiled
    # weight's strides are (N and K padded to its panels).
    ck = load_checkpoint(make_checkpoint(scheme="w4a16", group=0, hidden=72, intermediate=144, heads=1, kv_heads=1,
                                         weights=False))
    spec = next(s for s in select_kernels(ck, [90]).specs if s.kernel == "w4a16_tiled" and
                any(c["shape"]["K"] == 72 for c in s.covers))
    assert "stride_xm" not in spec.aligned and "K" not in spec.aligned
    assert {"stride_qn", "stride_sg"} <= set(spec.aligned)


def test_w4a16_split_k_fills_the_sms():
    """Decode-sized buckets split K so n-tiles x splits give every SM MIN_WAVES programs (the
    weight-only GEMM streams its weight: one program per SM leaves HBM idle); batched rows (above
    w4a16_tiled.SPLIT_MAX_M, where the op passes no workspace) never split."""
    from lmfoundry.gpus import SM_COUNT
    from lmfoundry.kernels import w4a16_tiled

    for cap in (80, 89, 90):
        for n, k in [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]:
            for lo, hi, c in tiles.buckets(cap, "w4a16_tiled", {"N": n, "K": k, "bits": 4, "group": 128}):
                programs = -(-hi // c["BLOCK_M"]) * -(-n // c["BLOCK_N"]) * c["SPLIT_K"]
                if hi <= w4a16_tiled.SPLIT_MAX_M:
                    assert programs >= tiles.MIN_WAVES * SM_COUNT[cap] or c["SPLIT_K"] == tiles.MAX_SPLIT_K, \
                        (cap, n, k, lo, c)
                else:
                    assert c["SPLIT_K"] == 1
    b = tiles.buckets(90, "w4a16_tiled", {"N": 4096, "K": 4096, "bits": 4, "group": 128})
    # 64 tiles of 64 rows x 5 splits on 132 SMs (the first split count reaching 2 programs per SM)
    assert b[0][:2] == (1, 16) and (b[0][2]["BLOCK_M"], b[0][2]["BLOCK_N"], b[0][2]["SPLIT_K"]) == (16, 64, 5)
    # INT8 / FP8 decode on Hopper: 16-token tiles with the weight as the wgmma's 128-row side, split-K
    from lmfoundry.kernels import registry

    for kernel, mma in (("w8a8_gemm", "IGMMA"), ("fp8_gemm", "QGMMA")):
        lo, hi, c = tiles.buckets(90, kernel, {"N": 4096, "K": 4096})[0]
        assert (lo, hi, c["BLOCK_M"], c["BLOCK_N"], c["SWAP_AB"]) == (1, 16, 16, 128, 1) and c["SPLIT_K"] > 1
        assert registry.kernel(kernel).expect_sass(90, c, {}, {}) == (mma,)
        assert all(c["SPLIT_K"] == 1 for lo, hi, c in tiles.buckets(90, kernel, {"N": 4096, "K": 4096}) if hi > 64)


def test_w8a8_fuses_norm_with_quantization(make_checkpoint):
    ck = load_checkpoint(make_checkpoint(scheme="w8a8", weights=False))
    build = select_kernels(ck, [80])
    assert fusion(build, "input_layernorm+qkv_proj.input_quant").applied
    assert fusion(build, "post_attention_layernorm+gate_up_proj.input_quant").applied
    norms = [s.semantics for s in build.specs if s.kernel == "rmsnorm_quant"]
    assert {"APPLY_NORM": True, "HAS_RESIDUAL": True, "QUANT": 1, "STATIC_SCALE": False} in norms
    assert {"APPLY_NORM": False, "HAS_RESIDUAL": False, "QUANT": 1, "STATIC_SCALE": False} in norms  # o/down inputs
    gemm = next(s for s in build.specs if s.kernel == "w8a8_gemm")
    assert gemm.semantics == {"A_PER_TOKEN": True, "B_PER_CHANNEL": True, "HAS_BIAS": False, "ACC_INT": True}
    assert gemm.expected_sass() == ("IMMA",)


def test_fp8_is_refused_on_ampere(make_checkpoint):
    ck = load_checkpoint(make_checkpoint(scheme="fp8", weights=False))
    with pytest.raises(UserError, match="FP8 needs sm_89"):
        select_kernels(ck, [90, 80])
    build = select_kernels(ck, [89, 90])
    assert {s.expected_sass() for s in build.specs if s.kernel == "fp8_gemm"} == {("QMMA",), ("QGMMA",)}
    ck = load_checkpoint(make_checkpoint(scheme="w4a16", kv_cache="fp8", weights=False))
    with pytest.raises(UserError, match="KV cache"):
        select_kernels(ck, [80])


def test_fusion_refusals(make_checkpoint):
    # Different schemes for q and k/v.
    ck = load_checkpoint(make_checkpoint(
        scheme="w4a16", group=32, weights=False,
        overrides={"re:.*q_proj$": {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                                    "input_activations": None}}))
    f = fusion(select_kernels(ck, [90]), "self_attn.qkv_proj")
    assert not f.applied and "schemes differ" in f.reason
    # Act-order: fused only when every member's g_idx is identical (read from the safetensors).
    ck = load_checkpoint(make_checkpoint(scheme="w4a16", group=32, actorder=True, same_gidx=True))
    assert fusion(select_kernels(ck, [90]), "self_attn.qkv_proj").applied
    ck = load_checkpoint(make_checkpoint(scheme="w4a16", group=32, actorder=True, same_gidx=False))
    f = fusion(select_kernels(ck, [90]), "mlp.gate_up_proj")
    assert not f.applied and "g_idx differ" in f.reason
    ck = load_checkpoint(make_checkpoint(scheme="w4a16", group=32, actorder=True, weights=False))
    assert "not present" in fusion(select_kernels(ck, [90]), "self_attn.qkv_proj").reason
    # Asymmetric 4-bit: zero points pack 8 rows per int32; a 4-row member cannot be concatenated.
    ck = load_checkpoint(make_checkpoint(scheme="w4a16", group=32, symmetric=False, weights=False, head_dim=64,
                                         heads=2, kv_heads=1))
    assert fusion(select_kernels(ck, [90]), "self_attn.qkv_proj").applied  # 64-row members: fine


def test_unfused_attention_strides(make_checkpoint):
    ck = load_checkpoint(make_checkpoint(
        scheme="w4a16", group=32, weights=False,
        overrides={"re:.*v_proj$": {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                                    "input_activations": None}}))
    build = select_kernels(ck, [90])
    rot = next(s for s in build.specs if s.kernel == "rotary")
    assert rot.semantics == {"NUM_Q_HEADS": 2, "NUM_KV_HEADS": 1, "HEAD_DIM": 64}
    # Separate q [T, 128] and k [T, 64] tensors: token strides 128 and 64, both multiples of 16.
    assert {"stride_qt", "stride_kt"} <= set(rot.aligned)


def test_unsupported_head_dim(make_checkpoint):
    ck = load_checkpoint(make_checkpoint(scheme="w4a16", head_dim=48, hidden=96, weights=False))
    with pytest.raises(UserError, match="head_dim"):
        select_kernels(ck, [90])


def test_tune_candidates_and_merge():
    from lmfoundry.compile.kernel_selection import Spec
    from lmfoundry.compile.tune import _candidates, _merge
    from lmfoundry.kernels.spec import TileConfig

    base = TileConfig.make(num_warps=4, num_stages=3, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64)
    cands = list(_candidates(base, "w4a16_gemm"))
    assert base in cands and len(cands) == len(set(cands)) == 4 * 3 * 3 * 2 * 3
    a = Spec(90, "w4a16_gemm", {"act": "bf16"}, {"BITS": 4}, base, [{"shape": {"N": 1}, "rows": [5, 128]}], ["N", "K"])
    b = Spec(90, "w4a16_gemm", {"act": "bf16"}, {"BITS": 4}, base, [{"shape": {"N": 2}, "rows": [5, 128]}], ["N"])
    merged, = _merge([a, b])
    assert [c["shape"]["N"] for c in merged.covers] == [1, 2] and merged.aligned == ["N"]


def test_tile_tables_cover_every_gemm_kernel_and_arch():
    from lmfoundry.kernels import registry

    for kernel, archs in tiles.GEMM_TABLES.items():
        assert registry.kernel(kernel).rows == "M"
        for cap in archs:
            b = tiles.buckets(cap, kernel, {"N": 4096, "K": 4096, "bits": 4})
            assert (b[0][0], b[-1][1]) == tiles.ROW_RANGE.get(kernel, (1, tiles.UNBOUNDED))
            assert all(x[1] + 1 == y[0] for x, y in zip(b, b[1:], strict=False))
    assert tiles.table_arch(86) == 80 and tiles.table_arch(89) == 89 and tiles.table_arch(100) == 90
