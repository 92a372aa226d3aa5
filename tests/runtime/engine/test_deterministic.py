"""The engine's deterministic mode (`EngineConfig.deterministic`, `serve --deterministic`): one
greedy request gives the same tokens and logprobs, bit for bit, alone, inside batches of other
requests, and after its prompt's blocks were put in the prefix cache, in bfloat16 and float32.
The real model's run through the server is in test_deterministic_real_model.py."""

from __future__ import annotations

import pytest
import torch
from checkpoints import write_checkpoint
from toy import byte_tokenizer, toy_model

from lmfoundry.errors import UserError
from lmfoundry.runtime.cpu.native.paged_decode import load_paged_decode
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(load_paged_decode() is None, reason="no C attention kernel here")

PARAMS = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)


def prompts(n: int, seed: int, lo: int = 5, hi: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def model(dtype: torch.dtype) -> torch.nn.Module:
    """The toy model with heads of 64 (the attention kernel's bf16 dot-product path)."""
    return toy_model(seed=5, dtype=dtype, hidden_size=256, intermediate_size=512)


def answer(engine: LLMEngine, prompt: list[int], others: list[list[int]]) -> tuple:
    """The first request's tokens and logprobs (chosen and top), run with `others` beside it."""
    out = engine.generate([prompt, *others], [PARAMS] * (1 + len(others)))[0].outputs[0]
    return tuple(out.token_ids), tuple((lp.token_id, lp.logprob, tuple(lp.top)) for lp in out.logprobs)


def answers(engine: LLMEngine, prompt: list[int]) -> dict[str, tuple]:
    """The prompt alone, inside batches of 2, 7 and 31 other requests, then after a request that
    put its prompt's blocks in the prefix cache (a hit: the rest of the prompt is a short chunk)."""
    others = prompts(31, seed=7)
    got = {"alone": answer(engine, prompt, [])}
    for n in (2, 7, 31):
        got[f"with {n}"] = answer(engine, prompt, others[:n])
    hits = engine.block_manager.prefix_hit_tokens
    got["cached prefix"] = answer(engine, prompt, [])
    assert engine.block_manager.prefix_hit_tokens > hits  # the prompt's blocks did come from the cache
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_request_is_bit_identical_alone_in_batches_and_from_the_cache(dtype) -> None:
    prompt = prompts(1, seed=3, lo=45, hi=46)[0]
    # a small step budget: the prompt is prefilled in chunks whose boundaries move with the batch
    config = EngineConfig(num_kv_blocks=256, block_size=8, max_num_batched_tokens=24, deterministic=True)
    got = answers(LLMEngine(model(dtype), byte_tokenizer(), config), prompt)
    for case, value in got.items():
        assert value == got["alone"], case
    assert len(got["alone"][0]) == PARAMS.max_tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_without_the_mode_batches_change_the_logprobs(dtype) -> None:
    """What the mode fixes: the default engine's logprobs for the same request move with the
    batch (BLAS sums by the row count, prompt chunks run another attention than decodes)."""
    from lmfoundry.runtime.cpu.isa import isa

    if dtype == torch.bfloat16 and isa() == "avx2":
        pytest.skip("the AVX2 path computes bf16 in float32 and rounds to bf16, where this request's "
                    "batch-dependent last bits vanish; the float32 case keeps the control on every path")
    prompt = prompts(1, seed=3, lo=45, hi=46)[0]
    config = EngineConfig(num_kv_blocks=256, block_size=8, max_num_batched_tokens=24)
    got = answers(LLMEngine(model(dtype), byte_tokenizer(), config), prompt)
    assert any(value[1] != got["alone"][1] for value in got.values())


def test_packed_int4_weights_are_batch_invariant(tmp_path) -> None:
    """A W4A16 checkpoint (packed int4 linears, per-row kernel at every row count)."""
    from lmfoundry.checkpoint.folder import CheckpointReader
    from lmfoundry.runtime.checkpoint_model import load_causal_lm
    from lmfoundry.runtime.cpu.weight_only_linears import Int4PackLinear

    folder = write_checkpoint(tmp_path / "w4", "w4a16", bits=4, group=32, vocab=320)
    model = load_causal_lm(CheckpointReader(folder), torch.bfloat16)
    assert any(isinstance(m, Int4PackLinear) for m in model.modules())
    config = EngineConfig(num_kv_blocks=256, block_size=8, max_num_batched_tokens=200, deterministic=True)
    engine = LLMEngine(model, None, config)
    prompt = prompts(1, seed=4, lo=140, hi=141)[0]  # a whole-prompt chunk of more than 128 rows
    got = answers(engine, prompt)
    for case, value in got.items():
        assert value == got["alone"], case


def test_what_has_no_batch_invariant_form_is_refused_in_one_line() -> None:
    with pytest.raises(UserError, match="float16 has no batch-invariant kernels"):
        LLMEngine(toy_model(dtype=torch.float16), None, EngineConfig(num_kv_blocks=16, deterministic=True))
    with pytest.raises(UserError, match="KV cache stored"):
        LLMEngine(toy_model(dtype=torch.float32), None,
                  EngineConfig(num_kv_blocks=16, kv_cache_dtype="bfloat16", deterministic=True))
    from lmfoundry.runtime.cpu.dense_linears import PrepackedLinear

    model = toy_model(dtype=torch.bfloat16)
    LLMEngine(model, None, EngineConfig(num_kv_blocks=16))  # prepared for the default mode ...
    prepacked = [m for m in model.modules() if isinstance(m, PrepackedLinear)]
    assert prepacked
    if not all(m.batch_invariant for m in prepacked):  # oneDNN's bf16 GEMM (AVX512-BF16, AMX) picks its kernel by rows
        with pytest.raises(UserError, match="load the model again"):  # ... so its linears are not the invariant ones
            LLMEngine(model, None, EngineConfig(num_kv_blocks=16, deterministic=True))
    else:  # AVX2: the FMA panels serve every row count in one order, so the same model serves the mode
        LLMEngine(model, None, EngineConfig(num_kv_blocks=16, deterministic=True))
