"""KL divergence, same-top rate and Δp of a candidate against a baseline reference, checked against a
direct float64 computation on the tiny model's real logits.

Bounds: the scorer takes log-softmax in float32 (as the gate does on bf16/float32 logits), so each
log-probability carries an absolute error of a few float32 ulps of its magnitude (|log p| < 20
here: ~1e-6 at most); KL = sum_v p_b (log p_b - log p_c) mixes them with weights summing to 1, so
its error per token stays within ~2e-6 plus the tail terms' rounding: 1e-5 absolute is the bound.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from lmfoundry.evals.divergence import DivergenceScorer, Reference, ReferenceRecorder, TokenStatistics, summary
from lmfoundry.evals.perplexity import perplexity
from lmfoundry.runtime.loader import load_model

KLD_ATOL = 1e-5


@pytest.fixture(scope="module")
def two_models(tiny_model_dir, tmp_path_factory):
    """The tiny model and a copy with one MLP projection scaled (a clearly different candidate)."""
    from safetensors.torch import load_file, save_file

    cand = tmp_path_factory.mktemp("divergence") / "perturbed"
    shutil.copytree(tiny_model_dir, cand)
    tensors = load_file(cand / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name] * 1.7
    save_file(tensors, cand / "model.safetensors", metadata={"format": "pt"})
    base, tok = load_model(tiny_model_dir, dtype=torch.float32)
    other, _ = load_model(cand, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    stream = torch.randint(0, len(tok), (5 * 24,), generator=gen)
    return base, other, stream


def _logits(model, stream, ctx=24):
    wins = stream.view(-1, ctx)
    with torch.no_grad():
        return model(wins)[:, :-1].double(), wins[:, 1:]


def _run(model, stream, observe):
    return perplexity(model, stream, ctx=24, batch_size=2, progress=False, observe=observe)


def _score(base, cand, stream, top_k) -> tuple[Reference, TokenStatistics]:
    rec = ReferenceRecorder(top_k)
    _run(base, stream, rec)
    ref = rec.reference()
    scorer = DivergenceScorer(ref)
    _run(cand, stream, scorer)
    return ref, scorer.statistics()


def test_kld_with_the_whole_vocabulary_matches_float64(two_models):
    base, cand, stream = two_models
    vocab = base.config.vocab_size
    ref, got = _score(base, cand, stream, top_k=vocab)
    lb, targets = _logits(base, stream)
    lc, _ = _logits(cand, stream)
    pb, lpb, lpc = lb.softmax(-1), lb.log_softmax(-1), lc.log_softmax(-1)
    want = (pb * (lpb - lpc)).sum(-1).numpy()
    assert got.kld.shape == want.shape == (5, 23)  # every position of every window was scored
    assert np.isfinite(got.kld).all() and (got.kld > 0).all()
    np.testing.assert_allclose(got.kld, want, rtol=0, atol=KLD_ATOL)
    assert (got.rest_mass == 0).all()  # nothing coarsened
    np.testing.assert_array_equal(got.same_top, (lc.argmax(-1) == lb.argmax(-1)).numpy())
    dp = (lpc.gather(-1, targets.unsqueeze(-1)).exp() - lpb.gather(-1, targets.unsqueeze(-1)).exp()).squeeze(-1)
    np.testing.assert_allclose(got.delta_p, dp.numpy(), rtol=0, atol=1e-6)
    assert 0 < got.same_top.mean() < 1  # the perturbed model disagrees sometimes, not always


def test_topk_kld_is_the_coarsened_kl_and_a_lower_bound(two_models):
    base, cand, stream = two_models
    k = 8
    ref, got = _score(base, cand, stream, top_k=k)
    _, full = _score(base, cand, stream, top_k=base.config.vocab_size)
    lb, _ = _logits(base, stream)
    lc, _ = _logits(cand, stream)
    # the two distributions merged into (top-k of the baseline) + one rest bucket, in float64
    ids = lb.topk(k, dim=-1).indices
    pb, pc = lb.softmax(-1), lc.softmax(-1)
    qb = torch.cat([pb.gather(-1, ids), (1 - pb.gather(-1, ids).sum(-1, keepdim=True))], -1)
    qc = torch.cat([pc.gather(-1, ids), (1 - pc.gather(-1, ids).sum(-1, keepdim=True))], -1)
    want = (qb * (qb.log() - qc.log())).sum(-1).numpy()
    np.testing.assert_allclose(got.kld, want, rtol=0, atol=KLD_ATOL)
    assert (got.kld <= full.kld + KLD_ATOL).all() and got.kld.mean() < full.kld.mean()
    np.testing.assert_allclose(got.rest_mass, (1 - pb.gather(-1, ids).sum(-1)).numpy(), rtol=1e-5, atol=1e-7)
    assert ref.top_k == k and ref.ids.shape == (5, 23, k)


def test_a_model_against_itself_scores_zero(two_models):
    base, _, stream = two_models
    _, got = _score(base, base, stream, top_k=16)
    assert (got.kld == 0).all() and got.same_top.all() and (got.delta_p == 0).all()
    s = summary(got)
    assert s["mean_kld"] == s["p99_kld"] == s["max_kld"] == 0 and s["same_top"] == 1 and s["tokens"] == 5 * 23


def test_reference_round_trips_and_refuses_other_windows(two_models, tmp_path):
    base, cand, stream = two_models
    rec = ReferenceRecorder(16)
    _run(base, stream, rec)
    ref = rec.reference()
    ref.save(tmp_path / "ref.npz")
    back = Reference.load(tmp_path / "ref.npz")
    assert back.digest() == ref.digest() and not list(tmp_path.glob("*.tmp*"))
    stats = TokenStatistics.from_lists(_score(base, cand, stream, 16)[1].to_lists())
    assert stats.kld.dtype == np.float64 and stats.same_top.dtype == bool
    with pytest.raises(ValueError, match="windows differ"):
        perplexity(cand, stream, ctx=12, batch_size=2, progress=False, observe=DivergenceScorer(back))
    short = DivergenceScorer(back)
    perplexity(cand, stream[:48], ctx=24, progress=False, observe=short)
    with pytest.raises(ValueError, match="scored 2 windows"):
        short.statistics()


def test_tied_top_tokens_count_as_the_same_top():
    """bf16 logits tie often; which of two equal maxima topk or argmax picks is arbitrary."""
    base = torch.tensor([[[2.0, 5.0, 5.0, 1.0], [3.0, 0.0, 1.0, 1.0]]])
    cand = torch.tensor([[[2.0, 5.0, 5.0, 1.0], [0.0, 3.0, 1.0, 1.0]]])
    targets = torch.tensor([[1, 0]])
    rec = ReferenceRecorder(2)
    rec(base, targets)
    scorer = DivergenceScorer(rec.reference())
    scorer(cand, targets)
    got = scorer.statistics()
    assert got.same_top.tolist() == [[True, False]] and got.kld[0, 0] == 0 and got.kld[0, 1] > 0
