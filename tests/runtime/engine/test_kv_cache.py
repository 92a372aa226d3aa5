"""Quantized and low-precision KV storage: encode/decode against plain PyTorch, and the engine
with a quantized KV cache against the reference execution that simulates the same quantization."""

from __future__ import annotations

import pytest
import torch
from helpers import reference_greedy
from toy import toy_model

from lmfoundry.errors import UserError
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.engine.kv_cache import FP8, KVCacheLayers, KVFormat


def ref_int8(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(x / s), -128, 127) * s


def ref_fp8(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x / s, -448, 448).to(FP8).float() * s


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_storage_roundtrip(kind: str, per_head: bool) -> None:
    torch.manual_seed(0)
    heads, dim, slots = 3, 16, 40
    x = torch.randn(10, heads, dim) * torch.tensor([0.5, 2.0, 8.0])[:, None]
    absmax = x.abs().amax(dim=(0, 2)) if per_head else x.abs().max()
    qmax = 127.0 if kind == "int8" else 448.0
    scale = (absmax / qmax).reshape(heads, 1) if per_head else absmax / qmax
    fmt = KVFormat(torch.int8 if kind == "int8" else FP8, torch.float32, scale, scale * 2,
                   "int" if kind == "int8" else "float")
    block = 4
    cache = KVCacheLayers([fmt], slots // block, block, heads, dim)
    slots_used = torch.randperm(slots)[:10]
    cache.write(0, slots_used, x, x)
    k_all, v_all = cache.read(0, torch.arange(slots // block))  # every block, in order: slot order
    k, v = k_all[slots_used], v_all[slots_used]
    assert cache.k[0].dtype == fmt.storage_dtype
    ref = ref_int8 if kind == "int8" else ref_fp8
    torch.testing.assert_close(k, ref(x, scale), rtol=0, atol=0)
    torch.testing.assert_close(v, ref(x, scale * 2), rtol=0, atol=0)
    # Error bound from the arithmetic: half a step for int8; 2^-4 relative (3 mantissa bits) for
    # e4m3 normals, plus half the smallest subnormal step.
    if kind == "int8":
        assert bool(((k - x).abs() <= scale / 2 * (1 + 1e-5)).all())
    else:
        assert bool(((k - x).abs() <= x.abs() * 2**-4 + scale * 2**-10).all())
    # unwritten slots stay untouched
    others = torch.ones(slots, dtype=torch.bool)
    others[slots_used] = False
    assert bool((k_all[others] == 0).all()) and bool((v_all[others] == 0).all())
    # reading a [2, 3] table of blocks gives two 12-token sequences
    table = torch.tensor([[2, 0, 5], [1, 1, 9]])
    k2, _ = cache.read(0, table)
    assert k2.shape == (2, 3 * block, heads, dim)
    torch.testing.assert_close(k2[1, block:2 * block], k_all[block:2 * block], rtol=0, atol=0)


def _calibrate(model, ids: list[int], qmax: float, per_head: bool) -> None:
    """Per-layer K/V absmax from one reference forward, turned into scales on each Attention."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in model.model.layers:
        attn = layer.self_attn

        def record(k, v, i=attn.layer_idx):
            dims = (0, 1, 3) if per_head else (0, 1, 2, 3)
            seen[i] = (k.abs().amax(dim=dims), v.abs().amax(dim=dims))
            return k, v

        attn.kv_round_trip = record
    with torch.no_grad():
        model(torch.tensor([ids]))
    for layer in model.model.layers:
        attn = layer.self_attn
        k_abs, v_abs = seen[attn.layer_idx]
        attn.register_buffer("k_scale", k_abs / qmax)
        attn.register_buffer("v_scale", v_abs / qmax)
        ks, vs = attn.k_scale, attn.v_scale
        if per_head:
            ks, vs = ks.reshape(-1, 1), vs.reshape(-1, 1)
        q = ref_int8 if qmax == 127.0 else ref_fp8
        attn.kv_round_trip = lambda k, v, ks=ks, vs=vs, q=q: (q(k, ks), q(v, vs))


@pytest.mark.parametrize("kind,per_head", [("int8", False), ("int8", True), ("fp8", False), ("fp8", True)])
def test_engine_with_quantized_kv_equals_reference(kind: str, per_head: bool) -> None:
    model = toy_model(seed=3)
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 23, 31)]
    _calibrate(model, ps[2] + ps[1], 127.0 if kind == "int8" else 448.0, per_head)
    model.config.raw["quantization_config"] = {
        "kv_cache_scheme": {"num_bits": 8, "type": "int" if kind == "int8" else "float",
                            "strategy": "attn_head" if per_head else "tensor", "symmetric": True}}
    cfg = EngineConfig(num_kv_blocks=100, block_size=4, max_num_batched_tokens=8)
    engine = LLMEngine(model, None, cfg)
    assert engine.runner.cache.k[0].dtype == (torch.int8 if kind == "int8" else FP8)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0)
    outs = engine.generate(ps, params)
    for p, out in zip(ps, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(model, p, 20)
    ids = outs[1].outputs[0].token_ids
    got = torch.tensor([lp.logprob for lp in outs[1].outputs[0].logprobs])

    def ref_logprobs() -> torch.Tensor:
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ps[1] + ids]))[0], -1)
        return lp[len(ps[1]) - 1 : -1].gather(1, torch.tensor(ids)[:, None])[:, 0]

    torch.testing.assert_close(got, ref_logprobs(), atol=1e-4, rtol=0)
    # The quantization is real: the float model (no round trip) gives other logprobs.
    for layer in model.model.layers:
        layer.self_attn.kv_round_trip = None
    assert (got - ref_logprobs()).abs().max() > 1e-3


@pytest.mark.parametrize("kind,strategy", [("int", "tensor"), ("float", "attn_head")])
def test_engine_with_checkpoint_round_trip(kind: str, strategy: str) -> None:
    """The loader's path: a kv_round_trip built from checkpoint scales (quantizers.kv_scales) is
    enough for the engine to pick the storage dtype and scales on its own ("auto")."""
    from lmfoundry.model.kv_quant import kv_round_trip_from_checkpoint
    from lmfoundry.quantformat.scheme import QuantArgs

    model = toy_model(seed=5)
    ids = list(range(30, 60))
    _calibrate(model, ids, 127.0 if kind == "int" else 448.0, per_head=strategy != "tensor")
    args = QuantArgs(8, kind, True, strategy, None)
    for layer in model.model.layers:
        attn = layer.self_attn
        ks, vs = attn.k_scale, attn.v_scale
        del attn.k_scale, attn.v_scale  # only the round trip knows them, as after load_model
        attn.kv_round_trip = kv_round_trip_from_checkpoint(args, ks, vs)
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=40, block_size=4, max_num_batched_tokens=8))
    assert engine.runner.cache.k[0].dtype == (torch.int8 if kind == "int" else FP8)
    out = engine.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == reference_greedy(model, ids, 16)


def test_int8_cache_without_scales_is_a_user_error() -> None:
    with pytest.raises(UserError, match="k_scale"):
        LLMEngine(toy_model(), None, EngineConfig(num_kv_blocks=10, kv_cache_dtype="int8"))
    with pytest.raises(UserError, match="unknown kv cache dtype"):
        LLMEngine(toy_model(), None, EngineConfig(num_kv_blocks=10, kv_cache_dtype="int4"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_float_cache(dtype: str) -> None:
    model = toy_model(seed=4)
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=50, block_size=4, kv_cache_dtype=dtype))
    assert engine.runner.cache.k[0].dtype == getattr(torch, dtype)
    p = list(range(40, 70))
    out = engine.generate([p], SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True))[0]
    ids = out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([p + ids]))[0], -1)
    want = ref[len(p) - 1 : -1].gather(1, torch.tensor(ids)[:, None])[:, 0]
    got = torch.tensor([lp.logprob for lp in out.outputs[0].logprobs])
    # K/V rounded to 8 (bf16) or 11 (fp16) mantissa bits perturb the logits by a few 1e-2 at most here.
    torch.testing.assert_close(got, want, atol=0.1, rtol=0)
    assert engine.runner.kv_cache_bytes == 50 * 4 * 2 * 2 * 2 * 16 * 2
