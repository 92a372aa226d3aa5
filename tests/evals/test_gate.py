"""eval-gate end to end: fast tests on a tiny random model; slow tests on the real default model
(float vs itself, W8A16 RTN, and two planted regressions)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from lmfoundry.calibration.job import QuantizeJob, run_job
from lmfoundry.errors import UserError
from lmfoundry.evals.gate import run_gate
from lmfoundry.evals.gate_spec import load_gate
from lmfoundry.evals.lm_eval_runner import materialize_tasks
from lmfoundry.manifest import read_manifest
from lmfoundry.recipe import Recipe

TEXT = ("Perplexity is the exponential of the mean negative log-likelihood per token. " * 40 + "\n") * 4


PROMPTS = """
chat:
  - {id: fox, prompt: "The quick brown fox"}
json:
  - {id: person, prompt: "A person as JSON", schema: {type: object}}
"""


def _tiny_gate(tmp: Path, **defaults) -> Path:
    text = tmp / "ppl.txt"
    text.write_text(TEXT)
    prompts = tmp / "prompts.yaml"
    prompts.write_text(PROMPTS)
    gate = {
        "name": "tiny", "seed": 0, "confidence": 0.95, "resamples": 500,
        "prompt": {"add_bos": "tokenizer", "chat_template": False, "num_fewshot": 0},
        "defaults": {"min_recovery": 0.95, "max_ppl_ratio": 1.05, "max_mean_kld": 0.05, "min_same_top": 0.9,
                     **defaults},
        "tiers": {"quick": {"tasks": {"lmf_arc_easy": {"limit": 12, "gate": ["acc"]},
                                      "lmf_piqa": {"limit": 10, "gate": {"acc": defaults.get("min_recovery", 0.95)}}},
                            "perplexity": {"text": str(text), "ctx": 32, "windows": 6, "top_k": 16},
                            "generation": {"prompts": str(prompts), "max_tokens": 4}}},
    }
    path = tmp / "gate.yaml"
    path.write_text(yaml.safe_dump(gate))
    return path


def _artifact(tiny_model_dir: Path, tmp: Path) -> Path:
    """A copy of the tiny model that carries an lmfoundry.json, as quantize writes one."""
    out = tmp / "candidate"
    shutil.copytree(tiny_model_dir, out)
    from lmfoundry.manifest import hash_folder

    (out / "lmfoundry.json").write_text(json.dumps({"kind": "quantized-checkpoint", "files": hash_folder(out)}))
    return out


def test_default_gate_file_parses_and_tasks_materialize(tmp_path):
    gate = load_gate(None)
    quick = gate.tier("quick")
    tasks, ppl = quick.tasks, quick.perplexity
    assert {t.name for t in tasks} == {"lmf_arc_easy", "lmf_piqa", "lmf_hellaswag"}
    assert ppl.windows == 20 and ppl.max_ratio == 1.05 and gate.min_recovery == 0.95
    full = gate.tier("full").tasks
    assert "lmf_arc_challenge" in {t.name for t in full}
    with pytest.raises(UserError):
        gate.tier("nightly")
    include, hashes = materialize_tasks(tmp_path)
    assert set(hashes) == {"lmf_arc_easy", "lmf_arc_challenge", "lmf_piqa", "lmf_hellaswag"}
    for yml in include.glob("*.yaml"):
        cfg = yaml.safe_load(yml.read_text())
        for f in cfg["dataset_kwargs"]["data_files"].values():
            assert Path(f).is_absolute() and Path(f).exists()


def test_gate_file_errors_are_user_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntiers: {quick: {}}\nthresholds: 1\n")
    with pytest.raises(UserError, match="unknown gate key"):
        load_gate(str(bad))
    with pytest.raises(UserError, match="no such gate"):
        load_gate(str(tmp_path / "missing.yaml"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("gate:\n  defaults: {min_recovery: 0.9}\n")
    g = load_gate(str(recipe))  # a recipe's gate section overlays the default gate
    assert g.min_recovery == 0.9 and "quick" in g.tiers


def test_tiny_model_against_itself_passes_and_records_promotion(tiny_model_dir, tmp_path):
    cand = _artifact(tiny_model_dir, tmp_path)
    res = run_gate(str(cand), str(tiny_model_dir), str(_tiny_gate(tmp_path)), "quick", tmp_path / "out",
                   use_cache=False)
    assert res.verdict == "pass" and res.exit_code == 0
    gated = [m for m in res.report["metrics"] if m["gated"]]
    assert [m["name"] for m in gated] == ["lmf_arc_easy/acc", "lmf_piqa/acc", "perplexity/" +
                                         str(tmp_path / "ppl.txt") + "@32", "divergence/mean_kld",
                                         "divergence/same_top"]
    for m in gated:
        ideal = 0.0 if m["statistic"] == "mean_kld" else 1.0
        assert m["point"] == ideal and m["low"] == ideal and m["high"] == ideal
    reported = {m["name"]: m for m in res.report["metrics"] if not m["gated"]}
    assert reported["lmf_arc_easy/acc_flips"]["point"] == 0 and reported["generation/exact_match"]["point"] == 1
    assert res.report["divergence"]["tokens"] == 6 * 31 and res.report["divergence"]["max_kld"] == 0
    assert [a["id"] for a in res.report["generation"]] == ["fox", "person"]
    assert "## Next-token distributions" in res.markdown_path.read_text()
    assert res.report["candidate"]["sha256"] == res.report["baseline"]["sha256"]
    assert res.report["prompt"]["add_bos"] == "tokenizer"
    assert res.report["candidate"]["prompt"]["bos_prepended"] is False
    assert res.plot_path.stat().st_size > 1000 and res.markdown_path.read_text().startswith("# eval-gate: **PASS**")
    promo = read_manifest(cand)["promotion"]
    from lmfoundry.manifest import sha256_file

    assert promo["verdict"] == "pass" and promo["report_sha256"] == sha256_file(res.json_path)


def test_gate_on_tensor_parallel_ranks_matches_one_process(tiny_model_dir, tmp_path):
    """`eval-gate --tp 2`: both models split over two ranks, tasks scored through the serving
    engine; the numbers are one process's, to float32 rounding of the ranks' partial sums."""
    cand = _artifact(tiny_model_dir, tmp_path)
    gate = str(_tiny_gate(tmp_path))
    kw = dict(use_cache=False, write_promotion=False, dtype="float32")
    one = run_gate(str(cand), str(tiny_model_dir), gate, "quick", tmp_path / "one", **kw)
    two = run_gate(str(cand), str(tiny_model_dir), gate, "quick", tmp_path / "two", tp=2, **kw)
    assert two.verdict == "pass" and two.exit_code == 0
    by_name = {m["name"]: m for m in one.report["metrics"]}
    for m in two.report["metrics"]:
        ref = by_name[m["name"]]
        if m["name"].startswith("perplexity/"):
            assert abs(m["baseline"] / ref["baseline"] - 1) < 1e-4, (m, ref)
        elif m["name"].endswith("/acc"):
            assert m["baseline"] == ref["baseline"] and m["candidate"] == ref["candidate"], (m, ref)
    assert [a["baseline"] for a in two.report["generation"]] == [a["baseline"] for a in one.report["generation"]]


def test_violated_threshold_fails_with_exit_1_and_names_the_metric(tiny_model_dir, tmp_path):
    """An impossible bar (perplexity ratio <= 0.9 for a model against itself) must fail."""
    cand = _artifact(tiny_model_dir, tmp_path)
    gate = _tiny_gate(tmp_path, max_ppl_ratio=0.9)
    from click.testing import CliRunner

    from lmfoundry.commands.eval_gate import eval_gate

    out = CliRunner().invoke(eval_gate, [str(cand), "--baseline", str(tiny_model_dir), "--gate", str(gate),
                                         "-o", str(tmp_path / "out"), "--quiet"])
    assert out.exit_code == 1, out.output
    assert "FAIL" in out.output and "failing: perplexity/" in out.output
    report = json.loads((tmp_path / "out" / "eval-gate.json").read_text())
    assert report["verdict"] == "fail" and report["failing"] == [m["name"] for m in report["metrics"]
                                                                 if m["gated"] and m["name"].startswith("perplexity/")]
    assert read_manifest(cand)["promotion"]["verdict"] == "fail"


# ---- slow: the real default model ------------------------------------------------------------
BASE = "smollm2-135m"


def _quantize(out: Path, scheme: str, group_size: int | None, per_channel: bool = False) -> Path:
    rec = Recipe().with_overrides(method="rtn", scheme=scheme, group_size=group_size, per_channel=per_channel or None)
    run_job(QuantizeJob(BASE, out, rec, overwrite=True, progress=False))
    return out


def _scale_one_linear(folder: Path, name: str, factor: float) -> None:
    """Plant a regression: multiply one quantized linear's scales in place."""
    from safetensors.torch import load_file, save_file

    for f in sorted(folder.glob("*.safetensors")):
        tensors = load_file(f)
        if f"{name}.weight_scale" in tensors:
            tensors[f"{name}.weight_scale"] = tensors[f"{name}.weight_scale"] * factor
            save_file(tensors, f, metadata={"format": "pt"})
            return
    raise AssertionError(f"{name}.weight_scale not found in {folder}")


@pytest.fixture(scope="module")
def slow_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gate-slow")


def _gate(candidate: str | Path, out: Path, tier: str = "quick", **kw):
    res = run_gate(str(candidate), BASE, None, tier, out, **kw)
    for m in res.report["metrics"]:
        if m["gated"]:
            print(f"{m['verdict']:>12} {m['name']}: {m['statistic']} {m['point']:.4f} [{m['low']:.4f}, {m['high']:.4f}]"
                  f" baseline {m['baseline']:.4f} candidate {m['candidate']:.4f}")
    return res


@pytest.mark.slow
@pytest.mark.heavy
def test_float_model_against_itself_passes(slow_dir):
    res = _gate(BASE, slow_dir / "float")
    assert res.verdict == "pass" and res.exit_code == 0


def _kld(res) -> dict:
    return next(m for m in res.report["metrics"] if m["name"] == "divergence/mean_kld")


@pytest.mark.slow
@pytest.mark.heavy
def test_w8a16_rtn_passes_the_quick_tier_and_the_verdict_is_reproducible(slow_dir):
    cand = _quantize(slow_dir / "w8a16", "w8a16", None, per_channel=True)  # 576 is not a multiple of 128
    # near-lossless: accuracy on 200 documents could not decide it; the per-token divergence does
    first = _gate(cand, slow_dir / "w8a16-gate")
    assert first.verdict == "pass", first.report["failing"] or first.report["inconclusive"]
    assert read_manifest(cand)["promotion"]["verdict"] == "pass"
    # the second run recomputes the candidate (no cache) and must give the same numbers
    second = _gate(cand, slow_dir / "w8a16-gate-2", use_cache=False)
    assert second.report["candidate"]["from_cache"] is None
    assert second.verdict == first.verdict
    assert second.report["metrics"] == first.report["metrics"]
    assert first.report["candidate"]["seconds"]["cpu"] < 10 * 60  # the budget per model


@pytest.mark.slow
@pytest.mark.heavy
def test_fp8_dynamic_passes_the_quick_tier(slow_dir):
    rec = Recipe().with_overrides(method="fp8", scheme="fp8-dynamic")
    run_job(QuantizeJob(BASE, slow_dir / "fp8", rec, overwrite=True, progress=False))
    res = _gate(slow_dir / "fp8", slow_dir / "fp8-gate")
    assert res.verdict == "pass" and res.exit_code == 0, res.report["failing"] or res.report["inconclusive"]


@pytest.mark.slow
@pytest.mark.heavy
def test_2bit_rtn_fails(slow_dir):
    cand = _quantize(slow_dir / "w2a16", "w2a16", 64)
    res = _gate(cand, slow_dir / "w2a16-gate")
    assert res.verdict == "fail" and res.exit_code == 1
    assert "divergence/mean_kld" in res.report["failing"]


@pytest.mark.slow
@pytest.mark.heavy
def test_w4a16_with_one_linear_scaled_by_3_fails(slow_dir):
    cand = _quantize(slow_dir / "w4a16-x3", "w4a16", 64)
    ok = _gate(cand, slow_dir / "w4a16-gate")  # the unmodified W4A16 g64 checkpoint
    _scale_one_linear(cand, "model.layers.10.mlp.down_proj", 3.0)
    res = _gate(cand, slow_dir / "w4a16-x3-gate")
    assert res.verdict == "fail" and res.exit_code == 1
    assert res.report["candidate"]["sha256"] != ok.report["candidate"]["sha256"]
    assert _kld(res)["low"] > _kld(ok)["high"]  # the planted damage shows beyond the 4-bit rounding


@pytest.mark.slow
@pytest.mark.heavy
def test_w4a16_gptq_has_a_lower_kld_than_rtn(slow_dir):
    rtn = _gate(_quantize(slow_dir / "w4a16-rtn", "w4a16", 64), slow_dir / "w4a16-rtn-gate")
    run_job(QuantizeJob(BASE, slow_dir / "w4a16-gptq", Recipe.from_yaml("smollm2-w4a16-gptq"), overwrite=True,
                        progress=False))
    gptq = _gate(slow_dir / "w4a16-gptq", slow_dir / "w4a16-gptq-gate")
    assert _kld(gptq)["high"] < _kld(rtn)["low"], (_kld(gptq), _kld(rtn))


@pytest.mark.slow
@pytest.mark.heavy
def test_adapter_matches_lm_eval_hf_backend_on_the_quick_tier(tmp_path):
    """lm-eval's own `hf` backend on the float model gives the same loglikelihoods (1e-4 relative)
    for every request of the quick tier's tasks."""
    from lm_eval.models.huggingface import HFLM

    from lmfoundry.checkpoint.sources import resolve_model
    from lmfoundry.evals.lm_adapter import RuntimeLM
    from lmfoundry.evals.lm_eval_runner import run_lm_eval
    from lmfoundry.runtime.loader import load_model

    gate = load_gate(None)
    tasks = gate.tier("quick").tasks
    include, _ = materialize_tasks(tmp_path)
    folder = resolve_model(BASE)
    model, tok = load_model(folder)
    ours = run_lm_eval(RuntimeLM(model, tok, add_bos=gate.add_bos), tasks, gate, [include])
    del model
    hf = HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=16)
    theirs = run_lm_eval(hf, tasks, gate, [include])
    worst = 0.0
    for t in tasks:
        a, b = ours[t.name], theirs[t.name]
        assert a["doc_ids"] == b["doc_ids"]
        for ra, rb in zip(a["responses"], b["responses"], strict=True):
            for x, y in zip(ra, rb, strict=True):
                worst = max(worst, abs(x - y) / max(abs(y), 1e-6))
        assert a["metrics"]["acc"] == b["metrics"]["acc"]
    print(f"worst relative loglikelihood difference: {worst:.2e}")
    assert worst <= 1e-4


def test_tiny_gate_twice_gives_identical_numbers(tiny_model_dir, tmp_path):
    """Recomputing both models (no cache) reproduces every number; the candidate differs from the
    baseline (one linear perturbed), so the intervals are not trivially [1, 1]."""
    from safetensors.torch import load_file, save_file

    cand = tmp_path / "perturbed"
    shutil.copytree(tiny_model_dir, cand)
    f = cand / "model.safetensors"
    tensors = load_file(f)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, f, metadata={"format": "pt"})
    gate = _tiny_gate(tmp_path)
    one = run_gate(str(cand), str(tiny_model_dir), str(gate), "quick", tmp_path / "a", use_cache=False)
    two = run_gate(str(cand), str(tiny_model_dir), str(gate), "quick", tmp_path / "b", use_cache=False)
    assert one.report["metrics"] == two.report["metrics"] and one.verdict == two.verdict
    ppl = [m for m in one.report["metrics"] if m["name"].startswith("perplexity/")][0]
    assert ppl["point"] != 1.0 and ppl["low"] < ppl["high"]


def test_kld_threshold_fails_a_perturbed_candidate_and_the_baseline_reference_is_cached(
        tiny_model_dir, tmp_path, monkeypatch):
    """A candidate whose next-token distributions moved fails on mean KLD with exit 1; a second
    candidate against the same baseline reuses the baseline's cached reference (not recomputed)."""
    from safetensors.torch import load_file, save_file

    import lmfoundry.evals.cached_evaluation as evaluation  # where evaluate_model finds load_model

    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path / "cache"))
    cand = tmp_path / "perturbed"
    shutil.copytree(tiny_model_dir, cand)
    tensors = load_file(cand / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] *= 3.0
    save_file(tensors, cand / "model.safetensors", metadata={"format": "pt"})
    gate = _tiny_gate(tmp_path, max_mean_kld=1e-4)
    res = run_gate(str(cand), str(tiny_model_dir), str(gate), "quick", tmp_path / "a")
    kld = next(m for m in res.report["metrics"] if m["name"] == "divergence/mean_kld")
    assert kld["verdict"] == "fail" and kld["low"] > 1e-4 and "divergence/mean_kld" in res.report["failing"]
    assert res.exit_code == 1
    assert len(list((tmp_path / "cache" / "eval-gate").glob("*.reference.npz"))) == 1
    evaluated: list[str] = []  # models the gate loaded
    original = evaluation.load_model
    monkeypatch.setattr(evaluation, "load_model", lambda folder, **kw: evaluated.append(str(folder)) or original(folder, **kw))
    again = run_gate(str(cand), str(tiny_model_dir), str(gate), "quick", tmp_path / "b", use_cache=False)
    assert len(evaluated) == 2  # without the cache both are evaluated again ...
    evaluated.clear()
    _artifact(tiny_model_dir, tmp_path)  # a second candidate (same weights, another folder)
    third = run_gate(str(tmp_path / "candidate"), str(tiny_model_dir), str(gate), "quick", tmp_path / "c")
    assert evaluated == [str(tmp_path / "candidate")]  # ... with it, only the new candidate is
    assert third.report["baseline"]["from_cache"] and third.verdict == "pass"
    assert again.report["metrics"] == res.report["metrics"]


def test_quiet_gate_prints_only_its_verdict_and_records_the_execution(tiny_model_dir, tmp_path, capsys):
    """`eval-gate --quiet --deterministic`: nothing from lm-eval (its "Tokenizing inputs" bars
    pass disable=False explicitly, which TQDM_DISABLE does not override) and only the verdict
    lines on stdout; the report says how the models ran."""
    from helpers import run_cli

    cand = _artifact(tiny_model_dir, tmp_path)
    code, out, err = run_cli(["eval-gate", str(cand), "--baseline", str(tiny_model_dir), "--gate",
                              str(_tiny_gate(tmp_path)), "-o", str(tmp_path / "out"), "--quiet", "--no-cache",
                              "--no-promotion", "--deterministic", "--dtype", "bfloat16"], capsys)
    assert code == 0, err
    assert err == ""
    lines = out.strip().splitlines()
    assert lines[-2] == "verdict: PASS" and lines[-1].startswith("report: ")
    assert all(line.strip().startswith("pass ") for line in lines[:-2]), out
    report = json.loads((tmp_path / "out" / "eval-gate.json").read_text())
    want = {"path": "serving engine", "dtype": "bfloat16", "deterministic": True}
    assert report["candidate"]["execution"] == report["baseline"]["execution"] == want
    assert "- execution: serving engine in bfloat16, deterministic" in (tmp_path / "out" / "eval-gate.md").read_text()

# eval-gate prints nothing of its tools' own outside --verbose (issue #61): lm-eval looks up its git
# commit with `git describe`, whose `fatal: not a git repository` reaches fd 2 directly.
@pytest.mark.skipif(shutil.which("git") is None, reason="the noise comes from git")
def test_a_gate_outside_a_git_checkout_prints_no_git_error(tiny_model_dir, tmp_path, monkeypatch, capfd):
    work = tmp_path / "not-a-checkout"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # git may not look above it
    cand = _artifact(tiny_model_dir, tmp_path)
    res = run_gate(str(cand), str(tiny_model_dir), str(_tiny_gate(tmp_path)), "quick", tmp_path / "out",
                   use_cache=False, progress=False)
    assert res.verdict == "pass"
    out, err = capfd.readouterr()
    assert "not a git repository" not in out + err
    assert "fatal:" not in out + err


def test_a_swapped_cache_entry_is_evaluated_again_not_served(tiny_model_dir, tmp_path, monkeypatch):
    """The cached results are named by their key's digest, but a name proves nothing: two entries
    swapped under each other's names (a restored CI cache, a copy) are re-evaluated, and a
    reference whose bytes changed is not read back (issue #57)."""
    import lmfoundry.evals.cached_evaluation as evaluation  # where evaluate_model finds load_model

    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path / "cache"))
    cand = _artifact(tiny_model_dir, tmp_path)
    gate = _tiny_gate(tmp_path)
    first = run_gate(str(cand), str(tiny_model_dir), str(gate), "quick", tmp_path / "a", write_promotion=False)
    entries = sorted(p for p in (tmp_path / "cache" / "eval-gate").glob("*.json"))
    assert len(entries) == 2  # the baseline's and the candidate's
    a, b = (p.read_bytes() for p in entries)
    entries[0].write_bytes(b)
    entries[1].write_bytes(a)
    evaluated: list[str] = []
    original = evaluation.load_model
    monkeypatch.setattr(evaluation, "load_model", lambda folder, **kw: evaluated.append(str(folder)) or original(folder, **kw))
    second = run_gate(str(cand), str(tiny_model_dir), str(gate), "quick", tmp_path / "b", write_promotion=False)
    assert len(evaluated) == 2 and second.report["metrics"] == first.report["metrics"]
    evaluated.clear()
    ref = next((tmp_path / "cache" / "eval-gate").glob("*.reference.npz"))
    data = bytearray(ref.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    ref.write_bytes(bytes(data))
    third = run_gate(str(cand), str(tiny_model_dir), str(gate), "quick", tmp_path / "c", write_promotion=False)
    assert evaluated == [str(tiny_model_dir)]  # the baseline again; the candidate's entry still holds
    assert third.report["metrics"] == first.report["metrics"]
