"""Embedding requests as scheduled work (runtime/engine/embedding.py): the vectors are the whole
prompt's last hidden state however the prompt was cut into chunks or taken from the prefix cache;
a request keeps about one step's budget of inputs in the scheduler, so a request that arrives
after it is served within a step or two; an aborted request leaves nothing behind."""

from __future__ import annotations

import torch
from toy import byte_tokenizer, toy_model

from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams

BUDGET = 32


def engine(**config) -> LLMEngine:
    cfg = dict(num_kv_blocks=256, block_size=8, max_model_len=512, max_num_batched_tokens=BUDGET, max_num_seqs=8)
    cfg.update(config)
    return LLMEngine(toy_model(seed=2), byte_tokenizer(), EngineConfig(**cfg))


def whole_prompt(llm: LLMEngine, ids: list[int]) -> list[float]:
    """The definition: the final-norm hidden state of the prompt's last token, one dense forward."""
    with torch.inference_mode():
        hidden = llm.model.hidden_states(torch.tensor([ids]))[0, -1].float()
    return torch.nn.functional.normalize(hidden, dim=-1).tolist()


def test_embeddings_equal_the_whole_prompt_forward_chunked_and_cached() -> None:
    llm = engine()
    long = [(7 * i) % 250 for i in range(150)]  # five chunks of the 32-token budget
    prompts = [long, long, long[:100] + [3, 4, 5], [42]]  # again (cached), a shared prefix, one token
    got = llm.embed(prompts)
    assert llm.block_manager.prefix_hit_tokens >= 96  # the repeats read their prefix from the cache
    for ids, vector in zip(prompts, got, strict=True):
        torch.testing.assert_close(torch.tensor(vector), torch.tensor(whole_prompt(llm, ids)), rtol=0, atol=2e-5)
    assert llm.block_manager.num_used_blocks == 0 and not llm.has_unfinished()


def test_a_request_after_a_large_embedding_is_served_within_a_couple_of_steps() -> None:
    llm = engine()
    inputs = [[5 + i % 200] * 20 for i in range(60)]  # 1200 tokens: about 40 steps of the budget
    llm.add_embedding("emb", inputs)
    llm.step()
    llm.add_request("gen", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    steps, first_token, results = 0, None, []
    while llm.has_unfinished():
        events = llm.step()
        steps += 1
        queued = [s for s in [*llm.scheduler.waiting, *llm.scheduler.running] if s.pooling]
        assert len(queued) <= 8 and sum(s.num_uncomputed_tokens for s in queued) < BUDGET + 20
        if first_token is None and any(ev.request_id == "gen" and ev.token_ids for ev in events):
            first_token = steps
        results += llm.take_embeddings()
    assert first_token is not None and first_token <= 2, first_token
    assert steps >= 1200 // BUDGET  # the embedding took its steps; "gen" did not wait for them
    assert [r.request_id for r in results] == ["emb"] and len(results[0].embeddings) == 60
    assert results[0].num_tokens == 1200


def test_an_aborted_embedding_leaves_nothing_behind() -> None:
    llm = engine()
    llm.add_embedding("emb", [[9] * 30 for _ in range(40)])
    llm.step()
    llm.step()
    assert llm.block_manager.num_used_blocks > 0
    assert llm.abort("emb")
    assert not llm.has_unfinished() and llm.block_manager.num_used_blocks == 0
    assert not llm.scheduler.has_work() and llm.step() == [] and llm.take_embeddings() == []
