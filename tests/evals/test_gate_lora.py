"""`eval-gate --lora NAME=PATH`: both models run the adapter on every path the gate scores
(lm-eval tasks, perplexity windows, generation), which equals scoring the adapter merged into the
weights; an adapter either base cannot run is refused before anything is evaluated."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import merge_lora, write_lora_adapter
from safetensors.torch import save_file

from lmfoundry.calibration.job import QuantizeJob, run_job
from lmfoundry.errors import UserError
from lmfoundry.evals.cached_evaluation import evaluate_model
from lmfoundry.evals.gate import run_gate
from lmfoundry.evals.gate_spec import load_gate
from lmfoundry.evals.lm_eval_runner import materialize_tasks
from lmfoundry.manifest import read_manifest
from lmfoundry.model.config import ModelConfig
from lmfoundry.recipe import Recipe
from lmfoundry.runtime.loader import load_model

from .test_gate import _artifact, _tiny_gate


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory) -> Path:
    return write_lora_adapter(tmp_path_factory.mktemp("lora") / "ad", ModelConfig.from_file(tiny_model_dir), rank=4,
                              seed=5, strength=0.5)


def merged_folder(tiny_model_dir: Path, adapter: Path, out: Path) -> Path:
    """The tiny model with the adapter merged into its weights, as an HF folder."""
    model, _ = load_model(tiny_model_dir, dtype=torch.float32)
    merged = merge_lora(model, adapter)
    shutil.copytree(tiny_model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    state = {k: v.contiguous() for k, v in merged.state_dict().items() if not k.endswith("inv_freq")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_the_adapter_runs_on_every_scored_path(tiny_model_dir, adapter, tmp_path) -> None:
    gate = load_gate(str(_tiny_gate(tmp_path)))
    tier = gate.tier("quick")
    ours, hashes = materialize_tasks(tmp_path / "tasks")
    kw = dict(use_cache=False, dtype="float32")
    with_adapter = evaluate_model(str(tiny_model_dir), tier, gate, [ours], hashes, lora=("ad", str(adapter)), **kw)
    merged = evaluate_model(str(merged_folder(tiny_model_dir, adapter, tmp_path / "merged")), tier, gate, [ours],
                            hashes, **kw)
    plain = evaluate_model(str(tiny_model_dir), tier, gate, [ours], hashes, **kw)
    ppl = [r["perplexity"]["ppl"] for r in (with_adapter, merged, plain)]
    assert abs(ppl[0] / ppl[1] - 1) < 1e-4 and abs(ppl[0] / ppl[2] - 1) > 1e-3, ppl
    for task in ("lmf_arc_easy", "lmf_piqa"):
        a, m = with_adapter["tasks"][task]["responses"], merged["tasks"][task]["responses"]
        assert torch.allclose(torch.tensor(a), torch.tensor(m), atol=1e-3), task  # per-choice log-likelihoods
    assert [g["tokens"] for g in with_adapter["generation"]] == [g["tokens"] for g in merged["generation"]]
    assert with_adapter["lora"]["name"] == "ad" and len(with_adapter["lora"]["sha256"]) == 64


def test_adapter_on_a_quantized_candidate_against_the_float_base(tiny_model_dir, adapter, tmp_path) -> None:
    rec = Recipe().with_overrides(method="rtn", scheme="w4a16", group_size=32)
    cand = tmp_path / "w4a16"
    run_job(QuantizeJob(str(tiny_model_dir), cand, rec, overwrite=True, progress=False))
    res = run_gate(str(cand), str(tiny_model_dir), str(_tiny_gate(tmp_path)), "quick", tmp_path / "out",
                   use_cache=False, lora=("ad", str(adapter)))
    assert res.report["lora"]["name"] == "ad" and res.report["divergence"]["mean_kld"] > 0
    assert "LoRA adapter `ad`" in res.markdown_path.read_text()
    assert read_manifest(cand)["promotion"]["lora"]["sha256"] == res.report["lora"]["sha256"]


def test_the_same_model_with_the_adapter_passes(tiny_model_dir, adapter, tmp_path) -> None:
    cand = _artifact(tiny_model_dir, tmp_path)
    res = run_gate(str(cand), str(tiny_model_dir), str(_tiny_gate(tmp_path)), "quick", tmp_path / "out",
                   use_cache=False, write_promotion=False, lora=("ad", str(adapter)))
    assert res.verdict == "pass" and res.report["divergence"]["max_kld"] == 0


def test_an_adapter_a_model_cannot_run_is_refused_up_front(tiny_model_dir, tmp_path) -> None:
    other = ModelConfig.from_dict({**ModelConfig.from_file(tiny_model_dir).raw, "hidden_size": 96})
    wrong = write_lora_adapter(tmp_path / "wrong", other, rank=4)
    with pytest.raises(UserError, match="--lora w on .*another base"):
        run_gate(str(tiny_model_dir), str(tiny_model_dir), str(_tiny_gate(tmp_path)), "quick", tmp_path / "out",
                 use_cache=False, lora=("w", str(wrong)))
    assert not (tmp_path / "out").exists()


def test_the_cli_takes_name_equals_path(tiny_model_dir, adapter, tmp_path, capsys) -> None:
    from helpers import assert_one_error, run_cli

    code, _, err = run_cli(["eval-gate", str(tiny_model_dir), "--baseline", str(tiny_model_dir), "--lora", str(adapter),
                            "-o", str(tmp_path / "out")], capsys)
    assert_one_error(code, err, "expected NAME=PATH")
    code, _, err = run_cli(["eval-gate", str(tiny_model_dir), "--baseline", str(tiny_model_dir), "--gate",
                            str(_tiny_gate(tmp_path)), "--lora", f"ad={adapter}", "--tp", "2", "-o", str(tmp_path / "o")],
                           capsys)
    assert_one_error(code, err, "--lora with --tp")
