"""eval-gate's memory: one model at a time, chunked full-vocabulary temporaries, the dry-run plan."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from lmfoundry.evals.divergence import DivergenceScorer, ReferenceRecorder, _by_rows
from lmfoundry.evals.gate import plan_gate, run_gate
from lmfoundry.evals.gate_memory import MemoryPlan, ModelMemory, weight_bytes
from lmfoundry.evals.perplexity import summed_nll
from tests.evals.test_gate import _artifact, _tiny_gate


def test_candidate_loads_only_after_the_baseline_model_is_released(tiny_model_dir, tmp_path, monkeypatch):
    import lmfoundry.evals.cached_evaluation as evaluation  # where evaluate_model finds load_model

    real, loaded, alive_at_load = evaluation.load_model, [], []

    def load_model(*args, **kwargs):
        gc.collect()
        alive_at_load.append([r() is not None for r in loaded])
        model, tok = real(*args, **kwargs)
        loaded.append(weakref.ref(model))
        return model, tok

    monkeypatch.setattr(evaluation, "load_model", load_model)
    cand = _artifact(tiny_model_dir, tmp_path)
    res = run_gate(str(cand), str(tiny_model_dir), str(_tiny_gate(tmp_path)), "quick", tmp_path / "out",
                   use_cache=False, write_promotion=False)
    assert alive_at_load == [[], [False]]  # the baseline's model was gone when the candidate loaded
    for who in ("baseline", "candidate"):
        phases = res.report[who]["memory"]
        assert [p["phase"] for p in phases] == ["start", "loaded", "tasks", "perplexity", "generation", "freed"]
        peaks = [p["peak_bytes"] for p in phases]
        # the kernel's per-thread RSS counters are folded in lazily: both figures jitter by pages
        assert all(b >= 0.99 * a for a, b in zip(peaks, peaks[1:], strict=False))
        assert all(0 < p["rss_bytes"] <= 1.01 * p["peak_bytes"] for p in phases)


def test_chunked_nll_and_reference_match_the_whole_batch():
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 37, 50), torch.randint(0, 50, (2, 37))
    whole = F.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1), reduction="none").view(2, -1)
    assert torch.allclose(summed_nll(logits, targets, rows=5), whole.double().sum(1), rtol=1e-12, atol=1e-9)
    rec = ReferenceRecorder(top_k=8)
    one = _by_rows(rec._record, logits, targets, rows=1000)
    for chunked, full in zip(_by_rows(rec._record, logits, targets, rows=6), one, strict=True):
        assert chunked.shape == full.shape and np.array_equal(chunked, full)
    rec(logits, targets)
    ref = rec.reference()
    scorer = DivergenceScorer(ref)
    scorer(logits[:1], targets[:1])
    scorer(logits[1:], targets[1:])
    stats = scorer.statistics()
    assert stats.kld.shape == (2, 37) and np.abs(stats.kld).max() < 1e-9 and stats.same_top.all()


def test_weight_bytes_counts_the_tensors_as_run(tiny_model_dir):
    from lmfoundry.model.config import ModelConfig
    from lmfoundry.runtime.loader import load_model

    config = ModelConfig.from_file(tiny_model_dir)
    model, _ = load_model(tiny_model_dir, dtype=torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.is_floating_point())
    assert weight_bytes(tiny_model_dir, config, 2, packed=True) == held
    assert weight_bytes(tiny_model_dir, config, 4, packed=False) == 2 * held


def test_plan_is_the_process_plus_the_larger_model(tiny_model_dir, tmp_path):
    plan = plan_gate(str(_artifact(tiny_model_dir, tmp_path)), str(tiny_model_dir), str(_tiny_gate(tmp_path)),
                     dtype="float32")
    base, cand = plan.models
    assert base.reference == 0 and cand.reference == 6 * 31 * (16 * 8 + 8)  # windows x positions x top-k
    assert cand.weights == base.weights and plan.peak == plan.process + cand.total
    assert plan.lines()[-1].startswith("plan: predicted peak resident memory")
    two = MemoryPlan(100, [ModelMemory("a", 10, 1, 1, 1), ModelMemory("b", 50, 1, 1, 1, reference=2)])
    assert two.peak == 100 + 55  # one model at a time, never both
