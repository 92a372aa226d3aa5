"""The engine on the real default model (SmolLM2-135M) and its W4A16 checkpoint (slow tier)."""

from __future__ import annotations

import pytest
import torch
from helpers import reference_greedy, w4a16_checkpoint

from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three facts about the Moon:\n1.",
]


@pytest.fixture(scope="module")
def smollm():
    from lmfoundry.runtime.loader import load_model

    return load_model("smollm2-135m")


def test_greedy_matches_transformers_generate(smollm) -> None:
    from transformers import AutoModelForCausalLM

    from lmfoundry.checkpoint.sources import resolve_model

    model, tok = smollm
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the tallest mountain?"}],
                                   tokenize=False, add_generation_prompt=True)
    prompts = [tok(p).input_ids for p in PROMPTS] + [tok(chat, add_special_tokens=False).input_ids]
    # Small token budget: prompts are prefilled in chunks while other sequences already decode.
    engine = LLMEngine(model, tok, EngineConfig(kv_cache_memory_gb=0.1, max_num_batched_tokens=16))
    outs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0))
    hf = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m"), dtype=torch.float32).eval()
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, tok.decode(ids)
    assert sum(len(o.outputs[0].token_ids) for o in outs) >= 3 * 64  # most prompts ran the full 64 tokens


def test_w4a16_engine_equals_reference_execution() -> None:
    from lmfoundry.runtime.loader import load_model

    model, tok = load_model(str(w4a16_checkpoint()))
    prompts = [tok(p).input_ids for p in PROMPTS[:3]]
    engine = LLMEngine(model, tok, EngineConfig(kv_cache_memory_gb=0.05, max_num_batched_tokens=32))
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(model, ids, 32)


def test_loglikelihood_matches_reference_on_real_model(smollm) -> None:
    model, tok = smollm
    ctx = tok("Question: What color is the sky on a clear day?\nAnswer:").input_ids
    conts = [tok(" blue").input_ids, tok(" green").input_ids, tok(" a deep shade of red").input_ids]
    engine = LLMEngine(model, tok, EngineConfig(kv_cache_memory_gb=0.05))
    scores = engine.loglikelihood([(ctx, c) for c in conts])
    for cont, (total, _) in zip(conts, scores, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ctx + cont]))[0], -1)
        want = sum(float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))
        assert total == pytest.approx(want, abs=1e-3)
    assert scores[0][0] > scores[1][0]  # the model prefers "blue"
