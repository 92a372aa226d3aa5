"""The CPU runtime on SmolLM2-135M (slow tier): the packed W4A16 model scores what the dense
dequantized one scores, and its `--arch cpu` bundle decodes what the checkpoint decodes."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_greedy_up_to_bf16_ties, w4a16_checkpoint

from lmfoundry.runtime.cpu import features as cpu_isa
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.loader import load_model

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not cpu_isa.native_bf16(), reason="needs bf16 arithmetic")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


def test_packed_w4a16_scores_like_the_dense_dequantized_model() -> None:
    """Perplexity of the same windows: int4pack in bf16 against the dense weight in bf16 (the
    same codes and scales; only the kernels' rounding differs, well under 1 %)."""
    from lmfoundry.calibration.data import eval_token_stream
    from lmfoundry.evals.perplexity import perplexity
    from lmfoundry.runtime import checkpoint_model
    from lmfoundry.runtime.cpu.weight_only_linears import Int4PackLinear

    ckpt = w4a16_checkpoint()
    packed, tok = load_model(ckpt, dtype=torch.bfloat16)
    assert isinstance(packed.model.layers[0].self_attn.q_proj, Int4PackLinear)
    stream, _, _ = eval_token_stream(None, tok)
    a = perplexity(packed, stream, ctx=256, max_windows=8, progress=False).ppl
    del packed
    real = checkpoint_model.packs_weights
    try:
        checkpoint_model.packs_weights = lambda dtype: False  # type: ignore[assignment]
        dense, _ = load_model(ckpt, dtype=torch.bfloat16)
    finally:
        checkpoint_model.packs_weights = real  # type: ignore[assignment]
    b = perplexity(dense, stream, ctx=256, max_windows=8, progress=False).ppl
    assert abs(a / b - 1) < 0.01, (a, b)


def test_cpu_bundle_decodes_what_the_checkpoint_decodes(tmp_path) -> None:
    from lmfoundry.compile.cpu_step import build_cpu_engine

    ckpt = w4a16_checkpoint()
    engine_dir, manifest, _ = build_cpu_engine(ckpt, tmp_path / "engine", max_tokens=256)
    bundle, tok = load_model(engine_dir, dtype=torch.bfloat16)
    assert bundle.compiled_step is not None
    checkpoint, _ = load_model(ckpt, dtype=torch.bfloat16)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    cfg = EngineConfig(kv_cache_memory_gb=0.25, max_num_batched_tokens=64)
    got = LLMEngine(bundle, tok, cfg).generate(PROMPTS, params)
    want = LLMEngine(checkpoint, tok, cfg).generate(PROMPTS, params)
    # the same bf16 model through other kernels: equal tokens, or a divergence at a bf16 tie
    assert_greedy_up_to_bf16_ties(checkpoint, [g.outputs[0].token_ids for g in got], want)
