"""The engine against the plain reference execution (full recompute, no cache) on a toy model."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_greedy_up_to_bf16_ties, reference_greedy
from toy import byte_tokenizer, toy_model

from lmfoundry.runtime.cpu.native.paged_decode import load_paged_decode
from lmfoundry.runtime.cpu.native.paged_prefill import load_paged_prefill
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams

EOS = 258


@pytest.fixture(scope="module")
def model():
    return toy_model(seed=1)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        out.append((prefix or []) + torch.randint(0, 256, (length,), generator=g).tolist())
    return out


GREEDY = SamplingParams(max_tokens=24, temperature=0)


def test_greedy_matches_reference_with_chunking_and_batching(model) -> None:
    ps = prompts(6, seed=1)
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=200, block_size=4, max_num_batched_tokens=16))
    outs = engine.generate(ps, GREEDY)
    for p, out in zip(ps, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(model, p, 24, eos=EOS)
    assert engine.block_manager.num_used_blocks == 0


def test_requests_joining_mid_run_match_reference(model) -> None:
    ps = prompts(5, seed=2, hi=30)
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=200, block_size=4, max_num_batched_tokens=12))
    results: dict[str, list[int]] = {}
    rids = []
    for p in ps:  # a new request every two steps, while the others decode
        rids.append(engine.add_request(None, p, GREEDY))
        for _ in range(2):
            for ev in engine.step():
                results.setdefault(ev.request_id, []).extend(ev.token_ids)
    while engine.has_unfinished():
        for ev in engine.step():
            results.setdefault(ev.request_id, []).extend(ev.token_ids)
    for rid, p in zip(rids, ps, strict=True):
        assert results[rid] == reference_greedy(model, p, 24, eos=EOS)


def test_prefix_reuse_gives_identical_outputs(model) -> None:
    shared = prompts(1, seed=3, lo=37, hi=38)[0]
    ps = prompts(6, seed=4, prefix=shared)
    cfg = dict(num_kv_blocks=300, block_size=4, max_num_batched_tokens=32)
    cold = LLMEngine(model, None, EngineConfig(enable_prefix_caching=False, **cfg)).generate(ps, GREEDY)
    warm_engine = LLMEngine(model, None, EngineConfig(**cfg))
    warm_engine.generate(ps[:1], GREEDY)
    warm = warm_engine.generate(ps, GREEDY)
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
    assert all(o.num_cached_tokens >= 36 for o in warm)
    assert warm_engine.block_manager.prefix_hit_rate > 0.3
    for p, out in zip(ps, warm, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(model, p, 24, eos=EOS)


def test_preemption_by_recompute_keeps_outputs(model) -> None:
    ps = prompts(8, seed=5, lo=10, hi=30)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ample = LLMEngine(model, None, EngineConfig(num_kv_blocks=400, block_size=4)).generate(ps, params)
    tight_engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=30, block_size=4, max_model_len=64,
                                                       max_num_batched_tokens=32))
    tight = tight_engine.generate(ps, params)
    assert tight_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in ample]
    assert tight_engine.block_manager.num_used_blocks == 0


def test_seeded_sampling_is_reproducible_across_batches(model) -> None:
    p = prompts(1, seed=6)[0]
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = LLMEngine(model, None, EngineConfig(num_kv_blocks=200)).generate([p], params)[0]
    others = SamplingParams(max_tokens=20, temperature=1.0)
    batch = LLMEngine(model, None, EngineConfig(num_kv_blocks=200)).generate(
        prompts(3, seed=7) + [p], [others] * 3 + [params])[-1]
    assert alone.outputs[0].token_ids == batch.outputs[0].token_ids
    unseeded = SamplingParams(max_tokens=20, temperature=1.0, n=4)
    out = LLMEngine(model, None, EngineConfig(num_kv_blocks=200)).generate([p], unseeded)[0]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # n samples are different draws


def test_top_k_and_top_p_truncate_the_distribution(model) -> None:
    p = prompts(1, seed=8)[0]
    with torch.no_grad():
        logits = model(torch.tensor([p]))[0, -1]
    top3 = set(logits.topk(3).indices.tolist())
    eng = LLMEngine(model, None, EngineConfig(num_kv_blocks=400))
    outs = eng.generate([p] * 40, SamplingParams(max_tokens=1, temperature=5.0, top_k=3))
    firsts = {o.outputs[0].token_ids[0] for o in outs}
    assert firsts <= top3 and len(firsts) > 1
    probs = logits.softmax(-1)
    nucleus = probs.sort(descending=True)
    keep = int((nucleus.values.cumsum(0) < 0.6).sum()) + 1
    allowed = set(nucleus.indices[:keep].tolist())
    outs = eng.generate([p] * 40, SamplingParams(max_tokens=1, temperature=1.0, top_p=0.6))
    assert {o.outputs[0].token_ids[0] for o in outs} <= allowed
    greedy = reference_greedy(model, p, 1, eos=EOS)
    assert eng.generate([p], SamplingParams(max_tokens=1, temperature=1.0, top_k=1))[0].outputs[0].token_ids == greedy


def test_logprobs_match_reference(model) -> None:
    p = prompts(1, seed=9)[0]
    out = LLMEngine(model, None, EngineConfig(num_kv_blocks=200)).generate(
        [p], SamplingParams(max_tokens=5, temperature=0, logprobs=3, prompt_logprobs=2))[0]
    ids = p + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)
    for j, lp in enumerate(out.outputs[0].logprobs):
        row = ref[len(p) - 1 + j]
        assert lp.token_id == ids[len(p) + j]
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(p)):
        lp = out.prompt_logprobs[pos]
        assert lp.token_id == p[pos]
        assert lp.logprob == pytest.approx(float(ref[pos - 1, p[pos]]), abs=1e-4)
        assert len(lp.top) == 2


def test_loglikelihood_matches_reference_and_uses_the_prefix_cache(model) -> None:
    ctx = prompts(1, seed=10, lo=30, hi=31)[0]
    conts = prompts(4, seed=11, lo=2, hi=6)
    greedy_cont = reference_greedy(model, ctx, 3)
    reqs = [(ctx, c) for c in conts] + [(ctx, greedy_cont)]
    eng = LLMEngine(model, None, EngineConfig(num_kv_blocks=200, block_size=4))
    scores = eng.loglikelihood(reqs)
    for (c, cont), (total, is_greedy) in zip(reqs, scores, strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([c + cont]))[0].float(), -1)
        expect = sum(float(ref[len(c) - 1 + j, t]) for j, t in enumerate(cont))
        assert total == pytest.approx(expect, abs=1e-3)
        ref_greedy = all(int(ref[len(c) - 1 + j].argmax()) == t for j, t in enumerate(cont))
        assert is_greedy == ref_greedy
    assert scores[-1][1]
    assert eng.block_manager.prefix_hit_tokens > 0


def test_stop_conditions(model, tokenizer) -> None:
    eng = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=200))
    p = prompts(1, seed=12)[0]
    full = reference_greedy(model, p, 30)
    text_out = eng.generate([p], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].outputs[0]
    assert text_out.token_ids == full and text_out.finish_reason == "length"
    # stop token id: stops at its first occurrence, inclusive
    stop_tok = full[5]
    out = eng.generate([p], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_tok],
                                           ignore_eos=True))[0].outputs[0]
    assert out.token_ids == full[: full.index(stop_tok) + 1] and out.finish_reason == "stop"
    # min_tokens bans the stop token until then
    out = eng.generate([p], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_tok],
                                           min_tokens=30, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 30 and stop_tok not in out.token_ids
    # stop string: text is cut before it (or kept with include_stop_str_in_output)
    text = text_out.text
    stop = text[6:8]
    if stop and "\ufffd" not in stop:
        out = eng.generate([p], SamplingParams(max_tokens=30, temperature=0, stop=[stop], ignore_eos=True))[0]
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].text == text[: text.index(stop)]


def test_abort_frees_blocks(model) -> None:
    eng = LLMEngine(model, None, EngineConfig(num_kv_blocks=100, block_size=4))
    rid = eng.add_request(None, prompts(1, seed=13)[0], SamplingParams(max_tokens=100, temperature=0))
    for _ in range(3):
        eng.step()
    assert eng.block_manager.num_used_blocks > 0
    assert eng.abort(rid)
    assert eng.block_manager.num_used_blocks == 0 and not eng.has_unfinished()


def test_invalid_requests_raise_value_error(model) -> None:
    eng = LLMEngine(model, None, EngineConfig(num_kv_blocks=100, block_size=4, max_model_len=64))
    for bad in (SamplingParams(max_tokens=0), SamplingParams(temperature=-1.0), SamplingParams(top_p=0.0),
                SamplingParams(max_tokens=60), SamplingParams(n=0), SamplingParams(logprobs=99)):
        with pytest.raises(ValueError):
            eng.add_request(None, [1] * 10, bad)
    with pytest.raises(ValueError):
        eng.add_request(None, [1] * 64, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError):
        eng.add_request(None, [], SamplingParams())
    with pytest.raises(ValueError):
        eng.add_request(None, [100000], SamplingParams())
    assert not eng.has_unfinished()


def test_cascade_attention_over_a_shared_prefix_matches(model, monkeypatch) -> None:
    from lmfoundry.runtime.engine.attention import PagedAttention

    monkeypatch.setenv("LMFOUNDRY_NATIVE_KERNELS", "0")  # the gathered path (cascade is its own)

    shared = prompts(1, seed=14, lo=90, hi=91)[0]
    ps = prompts(5, seed=15, lo=1, hi=12, prefix=shared)
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=0, ignore_eos=True)
    cfg = dict(num_kv_blocks=300, block_size=4, max_num_batched_tokens=64)
    results = {}
    original = PagedAttention._decode_cascade
    for cascade in (False, True):
        engine = LLMEngine(model, None, EngineConfig(cascade_attention=cascade, **cfg))
        engine.generate([shared + [7]], SamplingParams(max_tokens=1, temperature=0))  # cache the prefix
        calls = []
        monkeypatch.setattr(PagedAttention, "_decode_cascade",
                            lambda self, *a, calls=calls: calls.append(1) or original(self, *a))
        results[cascade] = engine.generate(ps, params)
        assert bool(calls) == cascade
    for off, on, p in zip(results[False], results[True], ps, strict=True):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids == reference_greedy(model, p, 20)
        got = torch.tensor([lp.logprob for lp in on.outputs[0].logprobs])
        want = torch.tensor([lp.logprob for lp in off.outputs[0].logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_decodes_sharing_a_prefix_cascade_beside_ones_that_do_not(model, monkeypatch) -> None:
    """A batch where only some sequences share the cached prefix (a system prompt on most
    requests, not all): those form a cascade group, the others a plain group, and every sequence
    decodes as alone."""
    from lmfoundry.runtime.engine.attention import PagedAttention

    monkeypatch.setenv("LMFOUNDRY_NATIVE_KERNELS", "0")  # the gathered path's groups
    shared = prompts(1, seed=14, lo=90, hi=91)[0]
    ps = prompts(4, seed=16, lo=1, hi=12, prefix=shared) + prompts(3, seed=17, lo=20, hi=60)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=400, block_size=4, max_num_batched_tokens=64))
    engine.generate([shared + [7]], SamplingParams(max_tokens=1, temperature=0))  # cache the prefix
    groups: list[int] = []
    original = PagedAttention._decode
    monkeypatch.setattr(PagedAttention, "_decode",
                        lambda self, *a: groups.append(len(self.decodes)) or original(self, *a))
    outs = engine.generate(ps, [params] * len(ps))
    assert max(groups) == 2  # the sharing sequences and the others, side by side in one step
    for out, p in zip(outs, ps, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(model, p, 16)


def with_and_without_native_kernels(monkeypatch, kernel: type, make_model, cfg: EngineConfig, shared: list[int],
                                    ps: list[list[int]], params: SamplingParams) -> dict[str, list]:
    """Outputs of `ps` after caching the prefix `shared`, on an engine over `make_model()` with the
    C kernels (key "1") and without them ("0"); asserts `kernel` ran exactly in the first."""
    results = {}
    for native in ("1", "0"):
        with monkeypatch.context() as m:
            m.setenv("LMFOUNDRY_NATIVE_KERNELS", native)
            calls: list[int] = []
            original = kernel.__call__
            m.setattr(kernel, "__call__",
                      lambda self, *a, calls=calls, original=original, **k: calls.append(1) or original(self, *a, **k))
            engine = LLMEngine(make_model(), None, cfg)
            engine.generate([shared + [7]], SamplingParams(max_tokens=1, temperature=0))  # cache the prefix
            results[native] = engine.generate(ps, params)
            assert bool(calls) == (native == "1")
    return results


@pytest.mark.skipif(load_paged_decode() is None, reason="no C compiler: the in-place decode kernel is not built")
def test_in_place_decode_kernel_matches_the_gathered_path(model, monkeypatch) -> None:
    """Decodes through the C kernel (blocks read in place, one call a layer) and through the
    gathered groups give the same tokens and logprobs, with shared prefixes, distinct prompts and
    chunked prefills in the same steps; the kernel is what runs when it is built."""
    from lmfoundry.runtime.cpu.native.paged_decode import PagedDecode

    shared = prompts(1, seed=14, lo=90, hi=91)[0]
    ps = prompts(4, seed=18, lo=1, hi=12, prefix=shared) + prompts(3, seed=19, lo=20, hi=60)
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=0, ignore_eos=True)
    cfg = EngineConfig(num_kv_blocks=400, block_size=4, max_num_batched_tokens=48)
    results = with_and_without_native_kernels(monkeypatch, PagedDecode, lambda: model, cfg, shared, ps, params)
    for on, off, p in zip(results["1"], results["0"], ps, strict=True):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids == reference_greedy(model, p, 16)
        got = torch.tensor([lp.logprob for lp in on.outputs[0].logprobs])
        want = torch.tensor([lp.logprob for lp in off.outputs[0].logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.skipif(load_paged_prefill() is None, reason="no AVX-512 BF16 prefill kernel here")
def test_native_bf16_step_matches_the_pytorch_path(monkeypatch) -> None:
    """A bf16 model (head_dim 64) served with every C kernel (prefill and decode attention read in
    place, one-pass RMSNorm, SiLU-mul and rotary) and with none (SDPA, PyTorch ops) gives the same greedy
    tokens up to bf16 ties, with prefix-cache hits and chunked prefills in the same steps; the
    prefill kernel is what runs the chunks when it is built."""
    from lmfoundry.runtime.cpu.native.paged_prefill import PagedPrefill

    def bf16_model():  # fresh each time: an engine swaps the model's modules for its own
        return toy_model(seed=3, dtype=torch.bfloat16, hidden_size=256, intermediate_size=512,
                         num_attention_heads=4, num_key_value_heads=2)

    shared = prompts(1, seed=24, lo=70, hi=71)[0]
    ps = prompts(3, seed=25, lo=1, hi=12, prefix=shared) + prompts(3, seed=26, lo=20, hi=90)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    cfg = EngineConfig(num_kv_blocks=400, block_size=16, max_num_batched_tokens=64)
    results = with_and_without_native_kernels(monkeypatch, PagedPrefill, bf16_model, cfg, shared, ps, params)
    assert_greedy_up_to_bf16_ties(bf16_model(), [r.outputs[0].token_ids for r in results["1"]], results["0"])


def test_logit_bias_ids_outside_the_vocabulary_are_refused_up_front(model) -> None:
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=50))
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match="logit_bias token ids"):
        engine.check_request([5, 6], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))
    engine.check_request([5, 6], SamplingParams(max_tokens=2, logit_bias={vocab - 1: 1.0}))
