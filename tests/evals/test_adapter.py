"""The lm-eval adapter scores exactly what a plain forward of the same model gives, and what
lm-eval's own `hf` backend gives on the same checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmfoundry.errors import UserError
from lmfoundry.evals.lm_adapter import RuntimeLM, ScoreRequest, parse_add_bos
from lmfoundry.runtime.loader import load_model


def _direct_loglikelihood(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """Reference: one unbatched forward of context+continuation, float64 log-softmax."""
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logits = model(ids)[0, len(ctx) - 1 : -1].double()
    lp = F.log_softmax(logits, -1)
    target = torch.tensor(cont)
    return float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


class _Req:
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir)


def test_score_matches_direct_forward_across_batches(tiny):
    model, tok = tiny
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    jobs = []
    for _ in range(23):
        n_ctx = int(torch.randint(1, 40, (1,), generator=g))
        n_cont = int(torch.randint(1, 6, (1,), generator=g))
        ids = torch.randint(0, vocab, (n_ctx + n_cont,), generator=g).tolist()
        jobs.append(ScoreRequest(ids[:n_ctx], ids[n_ctx:]))
    for k in range(5):  # multiple choice: one context, several continuations of 1..4 tokens
        ctx = jobs[k].context
        for n in (1, 2, 3, 4):
            jobs.append(ScoreRequest(ctx, torch.randint(0, vocab, (n,), generator=g).tolist()))
    jobs.append(ScoreRequest(jobs[0].context, jobs[0].continuation))  # duplicate: deduplicated run
    jobs.append(ScoreRequest(jobs[1].context + jobs[1].continuation[:-1], jobs[1].continuation[-1:]))
    # a small token budget forces many right-padded batches of different widths
    lm = RuntimeLM(model, tok, batch_tokens=64)
    got = lm.score(jobs)
    assert len(got) == len(jobs)
    for job, (ll, greedy) in zip(jobs, got, strict=True):
        ref, ref_greedy = _direct_loglikelihood(model, job.context, job.continuation)
        # float32 logits over <= 45 positions: rounding ~1e-6 relative per term
        assert math.isfinite(ll)
        assert abs(ll - ref) <= 1e-5 * max(1.0, abs(ref)), (ll, ref)
        assert greedy == ref_greedy
    assert got[-2] == got[0]


def test_score_truncates_long_inputs_from_the_left_like_lm_eval(tiny):
    model, tok = tiny
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=g).tolist()
    lm = RuntimeLM(model, tok, max_length=16)
    jobs = [ScoreRequest(ids[:37], ids[37:]), ScoreRequest(ids[:37], ids[37:39])]
    got = lm.score(jobs)
    for job, (ll, _) in zip(jobs, got, strict=True):
        seq = (job.context + job.continuation)[-17:]  # max_length + 1 tokens, last one only predicted
        ref, _ = _direct_loglikelihood(model, seq[: len(seq) - len(job.continuation)], job.continuation)
        assert abs(ll - ref) <= 1e-5 * abs(ref)


def test_prefix_cache_applies_the_kv_round_trip(tiny):
    """A KV quantizer set on the attention modules is applied on the shared-prefix path too."""
    model, tok = tiny
    calls = []

    def coarse(k, v):
        calls.append(1)
        return (k * 8).round() / 8, (v * 8).round() / 8

    for layer in model.model.layers:
        layer.self_attn.kv_round_trip = coarse
    try:
        ctx = tok.encode("Question: What do plants need to grow?")
        jobs = [ScoreRequest(ctx, tok.encode(" water and light")), ScoreRequest(ctx, tok.encode(" a dog"))]
        got = RuntimeLM(model, tok).score(jobs)
        assert calls
        for job, (ll, _) in zip(jobs, got, strict=True):
            ref, _ = _direct_loglikelihood(model, job.context, job.continuation)
            assert abs(ll - ref) <= 1e-4 * abs(ref)
    finally:
        for layer in model.model.layers:
            layer.self_attn.kv_round_trip = None


def test_greedy_flag_is_true_for_the_argmax_continuation(tiny):
    model, tok = tiny
    ctx = tok.encode("The quick brown")
    with torch.no_grad():
        nxt = int(model(torch.tensor([ctx]))[0, -1].argmax())
    lm = RuntimeLM(model, tok)
    (_, greedy), = lm.score([ScoreRequest(ctx, [nxt])])
    (_, other), = lm.score([ScoreRequest(ctx, [(nxt + 1) % model.config.vocab_size])])
    assert greedy and not other


def test_loglikelihood_rolling_sums_disjoint_windows(tiny):
    model, tok = tiny
    text = " ".join(["Paired statistics compare two models on the same documents."] * 6)
    lm = RuntimeLM(model, tok, max_length=16)
    (total,) = lm.loglikelihood_rolling([_Req(text)], disable_tqdm=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 3 * 16  # several windows
    # reference: predict every token once; window k sees at most 16 tokens of left context
    ref = 0.0
    seq = [lm.prefix_token_id] + ids
    for start in range(0, len(ids), 16):
        end = min(start + 16, len(ids))
        ctx_start = max(0, end - 16)  # the window holds the last 16 tokens of prefix+text before `end`
        window = seq[ctx_start : end + 1]
        with torch.no_grad():
            logits = model(torch.tensor([window[:-1]]))[0].double()
        lp = F.log_softmax(logits, -1)
        n = end - start
        tgt = torch.tensor(window[-n:])
        ref += float(lp[-n:].gather(1, tgt[:, None]).sum())
    assert abs(total - ref) <= 1e-5 * abs(ref)


def test_loglikelihood_api_matches_lm_eval_hf_backend(tiny, tiny_model_dir):
    """The same (context, continuation) strings through lm-eval's HFLM on the same folder."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tok = tiny
    pairs = [("Question: What do plants need to grow?\nAnswer:", " water and light"),
             ("Question: What do plants need to grow?\nAnswer:", " a lazy dog"),
             ("The quick brown fox", " jumps over"), ("", "Perplexity is the exponential"),
             ("A model that is ", "quantized must")]
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    ours = RuntimeLM(model, tok, add_bos="tokenizer").loglikelihood(reqs, disable_tqdm=True)
    hf = HFLM(pretrained=str(tiny_model_dir), device="cpu", dtype="float32", batch_size=2)
    theirs = hf.loglikelihood(reqs, disable_tqdm=True)
    for (a, ga), (b, gb) in zip(ours, theirs, strict=True):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (a, b)
        assert ga == gb


def test_bos_policy(tiny):
    model, tok = tiny
    bos = tok.bos_token_id
    assert RuntimeLM(model, tok, add_bos=True).tok_encode("The fox")[0] == bos
    assert RuntimeLM(model, tok, add_bos=True).tok_encode("<s>The fox").count(bos) == 1
    assert bos not in RuntimeLM(model, tok, add_bos="false").tok_encode("The fox")
    assert RuntimeLM(model, tok, add_bos=True).bos_prepended()
    assert parse_add_bos(None) == "tokenizer"
    with pytest.raises(UserError):
        parse_add_bos("sometimes")


def test_generate_until_is_greedy_and_cuts_stop_strings(tiny):
    model, tok = tiny
    lm = RuntimeLM(model, tok)
    prompt = "The quick brown"
    ids = tok.encode(prompt)
    ref = list(ids)
    with torch.no_grad():
        for _ in range(8):
            ref.append(int(model(torch.tensor([ref]))[0, -1].argmax()))
    ref_text = tok.decode(ref[len(ids):], skip_special_tokens=True)
    (text,) = lm.generate_until([_Req(prompt, {"until": [], "max_gen_toks": 8, "do_sample": False})])
    eos = tok.eos_token_id
    if eos in ref[len(ids):]:  # greedy stops at EOS
        ref_text = tok.decode(ref[len(ids): ref.index(eos, len(ids))], skip_special_tokens=True)
    assert text == ref_text
    if len(ref_text) > 2:
        stop = ref_text[1:3]
        (cut,) = lm.generate_until([_Req(prompt, {"until": [stop], "max_gen_toks": 8, "do_sample": False})])
        assert cut == ref_text.split(stop)[0]
