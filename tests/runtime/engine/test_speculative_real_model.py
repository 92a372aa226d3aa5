"""Speculative decoding on the real default model (SmolLM2-135M, slow tier): greedy output is token
for token that of plain decoding, with prompt-lookup drafts and with a draft model (the model
itself, which must then accept every draft), and every KV block comes back."""

from __future__ import annotations

import pytest

from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow

SNIPPET = "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n"
ASKS = [
    f"Repeat this Python code exactly, renaming `mean` to `average`:\n```python\n{SNIPPET}```",
    "Copy this text word for word: \"The quick brown fox jumps over the lazy dog. The five boxing wizards "
    "jump quickly. Pack my box with five dozen liquor jugs.\"",
    "The capital of France is",
]
# ignore_eos: no draft is wasted past the end of a sequence, so a self-draft must accept them all.
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm():
    from lmfoundry.runtime.loader import load_model

    return load_model("smollm2-135m")


def prompts(tok) -> list[list[int]]:
    chats = [tok.apply_chat_template([{"role": "user", "content": a}], tokenize=False, add_generation_prompt=True)
             for a in ASKS[:2]]
    return [tok(c, add_special_tokens=False).input_ids for c in chats] + [tok(ASKS[2]).input_ids]


def run(model, tok, draft=None, **spec) -> tuple[LLMEngine, list[list[int]]]:
    # A small token budget: drafts are cut to it and prompts are prefilled in chunks meanwhile.
    engine = LLMEngine(model, tok, EngineConfig(kv_cache_memory_gb=0.05, max_num_batched_tokens=24, **spec),
                       draft_model=draft)
    outs = engine.generate(prompts(tok), GREEDY)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return engine, [o.outputs[0].token_ids for o in outs]


def test_speculative_greedy_is_identical_on_smollm2(smollm) -> None:
    model, tok = smollm
    _, plain = run(model, tok)
    ngram, got = run(model, tok, speculative="ngram", num_speculative_tokens=4)
    assert got == plain
    assert ngram.speculator.acceptance_rate > 0.25  # the answers quote their prompts
    draft, got = run(model, tok, draft=model, speculative="draft", num_speculative_tokens=3)
    assert got == plain
    s = draft.speculator
    assert s.num_accepted_tokens == s.num_draft_tokens > 0
    assert not draft.speculator.proposer.states
