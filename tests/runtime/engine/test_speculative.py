"""Speculative decoding (prompt lookup and draft model) against plain decoding on toy models:
identical greedy and seeded outputs, drafts actually accepted and rejected, and no KV block kept
for a rejected draft or a finished sequence."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import reference_greedy
from toy import byte_tokenizer, toy_model

from lmfoundry.errors import UserError
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.engine.speculative import ngram_lookup

EOS = 258
GREEDY = SamplingParams(max_tokens=40, temperature=0)


@pytest.fixture(scope="module")
def model():
    return toy_model(seed=1)


@pytest.fixture(scope="module")
def other_model():
    return toy_model(seed=7)


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random snippet a few times, so prompt lookup has something to find."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        snippet = torch.randint(0, 256, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        out.append(snippet * 3 + snippet[: len(snippet) // 2])
    return out


def engine(model, draft=None, **cfg) -> LLMEngine:
    base = dict(num_kv_blocks=300, block_size=4, max_num_batched_tokens=32)
    base.update(cfg)
    return LLMEngine(model, None, EngineConfig(**base), draft_model=draft)


def assert_pool_full(e: LLMEngine) -> None:
    bm = e.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    if e.config.speculative == "draft":
        dbm = e.speculator.proposer.block_manager
        assert dbm.num_free_blocks == dbm.num_blocks and not e.speculator.proposer.states


def tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def test_ngram_lookup_takes_the_longest_latest_match() -> None:
    t = torch.tensor
    assert ngram_lookup(t([1, 2, 3, 9, 8, 1, 2, 3]), 3, 3, 1) == [9, 8, 1]
    # The latest occurrence of the 2-gram [5, 6] wins over the earlier one.
    assert ngram_lookup(t([5, 6, 1, 5, 6, 2, 5, 6]), 2, 3, 1) == [2, 5]
    # No 3-gram or 2-gram match: falls back to the last 1-gram, and k caps the proposal.
    assert ngram_lookup(t([4, 7, 7, 1, 4]), 2, 3, 1) == [7, 7]
    assert ngram_lookup(t([1, 2, 3]), 4, 3, 1) == []
    assert ngram_lookup(t([1, 2, 3]), 4, 3, 2) == []
    assert ngram_lookup(t([3, 3]), 4, 3, 1) == [3]  # overlapping occurrence: its continuation only


def test_ngram_greedy_equals_plain_decoding_and_frees_blocks(model) -> None:
    ps = repetitive_prompts(6, seed=1)
    plain = engine(model).generate(ps, GREEDY)
    spec = engine(model, speculative="ngram", num_speculative_tokens=4)
    outs = spec.generate(ps, GREEDY)
    assert tokens(outs) == tokens(plain)
    for p, out in zip(ps, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(model, p, 40, eos=EOS)
    s = spec.speculator
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # drafts were both accepted and rejected
    stats = spec.stats()
    assert stats["spec_acceptance_rate"] == pytest.approx(s.num_accepted_tokens / s.num_draft_tokens)
    assert_pool_full(spec)


def test_no_block_outlives_its_tokens_after_any_step(model) -> None:
    """Blocks grown for drafts come back when the drafts are rejected: after every step each
    running sequence holds at most the blocks its tokens need."""
    e = engine(model, speculative="ngram", num_speculative_tokens=6, block_size=2, max_num_batched_tokens=20)
    for p in repetitive_prompts(4, seed=2):
        e.add_request(None, p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    bm = e.block_manager
    while e.has_unfinished():
        e.step()
        for seq in e.scheduler.running:
            assert len(seq.block_table) <= bm.blocks_for(len(seq)), seq
            assert not seq.draft_token_ids
    assert e.speculator.num_draft_tokens > e.speculator.num_accepted_tokens > 0
    assert_pool_full(e)


@pytest.mark.parametrize("same", [True, False])
def test_draft_model_greedy_equals_plain_decoding(model, other_model, same: bool) -> None:
    ps = repetitive_prompts(4, seed=3)
    draft = model if same else other_model
    spec = engine(model, draft, speculative="draft", num_speculative_tokens=3)
    outs = spec.generate(ps, GREEDY)
    for p, out in zip(ps, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(model, p, 40, eos=EOS)
    s = spec.speculator
    if same:  # the draft is the target: every draft is what the target picks
        assert s.num_accepted_tokens == s.num_draft_tokens > 0
    else:
        assert s.num_accepted_tokens < s.num_draft_tokens
    assert_pool_full(spec)


def test_seeded_sampling_is_unchanged_by_speculation(model) -> None:
    """Verification draws each token from the target with the request's generator, one draw per
    token: a seeded request gives the same tokens with or without speculation."""
    ps = repetitive_prompts(4, seed=4)
    params = [SamplingParams(max_tokens=32, temperature=0.7, top_p=0.95, seed=11 + i, n=2) for i in range(4)]
    plain = engine(model).generate(ps, params)
    spec = engine(model, speculative="ngram", num_speculative_tokens=4)
    assert tokens(spec.generate(ps, params)) == tokens(plain)
    assert spec.speculator.num_accepted_tokens > 0
    assert_pool_full(spec)


def test_penalties_stops_logprobs_and_small_budgets_match(model) -> None:
    """Per-position processing (repetition penalty, min_tokens, stop strings, max_tokens) sees the
    tokens accepted before it; a budget smaller than the drafts cuts them, and logprobs match."""
    tok = byte_tokenizer()
    ps = repetitive_prompts(5, seed=5)
    params = [
        SamplingParams(max_tokens=33, temperature=0, repetition_penalty=1.3, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0, min_tokens=20, logprobs=1),
        SamplingParams(max_tokens=25, temperature=0, stop=["a", "b", "c", "e"], ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, frequency_penalty=0.5, presence_penalty=0.2, n=2),
    ]
    for budget in (3, 64):
        cfg = dict(max_num_batched_tokens=budget)
        plain = LLMEngine(model, tok, EngineConfig(num_kv_blocks=300, block_size=4, **cfg)).generate(ps, params)
        spec = LLMEngine(model, tok, EngineConfig(num_kv_blocks=300, block_size=4, speculative="ngram",
                                                  num_speculative_tokens=5, **cfg))
        outs = spec.generate(ps, params)
        assert tokens(outs) == tokens(plain)
        for a, b in zip(outs, plain, strict=True):
            for x, y in zip(a.outputs, b.outputs, strict=True):
                assert (x.text, x.finish_reason) == (y.text, y.finish_reason)
                if y.logprobs is not None:
                    assert [lp.token_id for lp in x.logprobs] == [lp.token_id for lp in y.logprobs]
                    assert [lp.logprob for lp in x.logprobs] == pytest.approx([lp.logprob for lp in y.logprobs],
                                                                             abs=1e-4)
        assert spec.speculator.num_accepted_tokens > 0
        assert_pool_full(spec)


def test_preemption_and_prefix_caching_with_drafts(model) -> None:
    """A pool too small for every sequence forces preemption while drafts are in flight; a shared
    prefix is served from the cache. Outputs still equal the reference."""
    shared = repetitive_prompts(1, seed=6)[0]
    ps = [shared + p for p in repetitive_prompts(6, seed=7)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    e = engine(model, speculative="ngram", num_speculative_tokens=4, num_kv_blocks=60, max_num_batched_tokens=48)
    outs = e.generate(ps, params)
    assert e.scheduler.num_preemptions > 0
    assert e.block_manager.prefix_hit_tokens > 0
    for p, out in zip(ps, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(model, p, 30)
    assert_pool_full(e)


def test_streaming_events_flag_the_request_end_once(model) -> None:
    """A speculative step gives one event per sequence with all its new tokens; with n > 1, only
    the request's last event says request_finished (a stream ends there)."""
    e = engine(model, speculative="ngram", num_speculative_tokens=4)
    p = repetitive_prompts(1, seed=14)[0]
    rid = e.add_request(None, p, SamplingParams(max_tokens=20, temperature=0, n=2, ignore_eos=True))
    got: dict[int, list[int]] = {0: [], 1: []}
    finished_flags = 0
    multi = False
    while e.has_unfinished():
        events = e.step()
        assert len({ev.index for ev in events}) == len(events)
        for ev in events:
            assert ev.request_id == rid
            got[ev.index].extend(ev.token_ids)
            multi |= len(ev.token_ids) > 1
            finished_flags += ev.request_finished
    assert finished_flags == 1 and multi
    assert got[0] == got[1] == reference_greedy(model, p, 20)
    assert_pool_full(e)


def test_abort_mid_speculation_frees_draft_cache(model, other_model) -> None:
    e = engine(model, other_model, speculative="draft", num_speculative_tokens=3)
    rid = e.add_request(None, repetitive_prompts(1, seed=9)[0], SamplingParams(max_tokens=30, temperature=0))
    for _ in range(3):
        e.step()
    assert e.speculator.proposer.states
    e.abort(rid)
    assert_pool_full(e)


def test_bad_speculative_settings_are_refused(model, other_model) -> None:
    with pytest.raises(UserError, match="speculative"):
        engine(model, speculative="medusa")
    with pytest.raises(UserError, match="num_speculative_tokens"):
        engine(model, speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(UserError, match="draft model"):
        engine(model, speculative="draft")
    with pytest.raises(UserError, match="vocabulary"):
        engine(model, toy_model(seed=3, vocab_size=300), speculative="draft")


def test_a_failing_proposer_only_costs_the_drafts(model, other_model, monkeypatch) -> None:
    """Drafts are optional: a proposer error is logged and the step decodes plainly."""
    ps = repetitive_prompts(3, seed=10)
    e = engine(model, other_model, speculative="draft", num_speculative_tokens=3)
    calls = 0
    real = e.speculator.proposer.propose

    def flaky(seqs, limits):
        nonlocal calls
        calls += 1
        if calls % 2:
            real(seqs, limits)  # leaves half-updated draft state behind, then fails
            raise RuntimeError("draft forward failed")
        return real(seqs, limits)

    monkeypatch.setattr(e.speculator.proposer, "propose", flaky)
    outs = e.generate(ps, GREEDY)
    for p, out in zip(ps, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(model, p, 40, eos=EOS)
    assert calls > 2 and e.speculator.num_draft_tokens > 0
    assert_pool_full(e)


@pytest.mark.parametrize("same", [True, False])
def test_draft_model_with_a_budget_smaller_than_the_batch(model, other_model, same: bool, caplog) -> None:
    """Sequences left out of a step keep their draft state and are re-proposed next step; drafts
    are cut to the budget. Every proposal is the draft model's own greedy continuation (its KV
    cache, kept across steps and cut back after rejections, must reproduce full recomputation)."""
    ps = repetitive_prompts(4, seed=11)
    draft = model if same else other_model
    # A budget of k + 2: the oldest decode takes 1 + k, the next one decodes without its drafts.
    e = engine(model, draft, speculative="draft", num_speculative_tokens=4, max_num_batched_tokens=6)
    real = e.speculator.proposer.propose
    checked, wrong = 0, []

    def checked_propose(seqs, limits):  # the engine contains proposer errors: record, do not raise
        nonlocal checked
        proposals = real(seqs, limits)
        for seq, k, drafts in zip(seqs, limits, proposals, strict=True):
            if drafts != reference_greedy(draft, seq.token_ids, k):
                wrong.append((seq.seq_id, len(seq), drafts))
            checked += 1
        return proposals

    e.speculator.proposer.propose = checked_propose
    rids = [e.add_request(None, p, GREEDY) for p in ps]
    e.scheduler.max_num_batched_tokens = 256
    got: dict[str, list[int]] = {rid: [] for rid in rids}
    events = e.step()  # every prompt prefilled at once: from here on four sequences decode on a budget of 6
    e.scheduler.max_num_batched_tokens = 6
    while events or e.has_unfinished():
        for ev in events:
            got[ev.request_id].extend(ev.token_ids)
        events = e.step()
    assert checked > 20 and not wrong
    assert "proposer failed" not in caplog.text
    for p, rid in zip(ps, rids, strict=True):
        assert got[rid] == reference_greedy(model, p, 40, eos=EOS)
    assert e.speculator.num_draft_tokens > 0
    assert_pool_full(e)


def test_structured_output_is_unchanged_by_speculation(model) -> None:
    """Each accepted token advances the sequence's grammar before the next position is masked, so
    constrained output (greedy and seeded) is what plain decoding gives, and still valid JSON."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "tags": {
              "type": "array", "items": {"enum": ["aa", "ab", "ba"]}, "maxItems": 6}}, "required": ["name", "tags"],
              "additionalProperties": False}
    tok = byte_tokenizer()
    ps = ['{"name": "abab", "tags": ["aa", "ab", "aa", "ab"]} ' * 2]
    params = [SamplingParams(max_tokens=120, temperature=0, json_schema=schema),
              SamplingParams(max_tokens=120, temperature=0.9, seed=3, json_schema=schema)]
    outs = []
    for spec in ({}, {"speculative": "ngram", "num_speculative_tokens": 4}):
        e = LLMEngine(model, tok, EngineConfig(num_kv_blocks=300, block_size=4, **spec))
        outs.append([e.generate(ps, p)[0].outputs[0] for p in params])
        assert_pool_full(e)
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[0]]
    assert e.speculator.num_accepted_tokens > 0
    assert all(o.finish_reason == "stop" for o in outs[1])
    for o in outs[1]:
        assert set(json.loads(o.text)) >= {"name", "tags"}
