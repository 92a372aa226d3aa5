"""Issue 16, cases 8 and 9 for `eval ppl` and `eval-gate`: user mistakes are one `error:` line
with a non-zero exit and no traceback, and they are caught before any model is loaded or
evaluated (the tests make loading/evaluating raise to prove it), leaving no report folder behind.

| case | before | after | test |
|---|---|---|---|
| 8 gate YAML wrong types (confidence/seed/resamples/num_fewshot a word, prompt/defaults/tier/tasks/task body/perplexity not mappings, threshold or ctx a word, recipe `gate:` a number) | ValueError / AttributeError traceback | `error: <file>: <field> must be ...` | test_gate_yaml_wrong_types_are_user_errors[*] |
| 8 gate YAML values that passed silently (chat_template "no" read as true, limit true, seed -1 or >= 2**32, resamples 0, num_fewshot -1, max_ratio .nan, a typo'd tier key, a broken tier other than the one run) | accepted | refused, one line | test_gate_yaml_wrong_types_are_user_errors[*] |
| 8 same, through the CLI | traceback, exit 1 | exit 2, one line, no -o folder | test_eval_gate_cli_bad_gate_yaml_is_one_line |
| 8 `eval ppl --batch-size 0` / `-3` | model loaded, then RuntimeError traceback | exit 2, one line, nothing loaded | test_eval_ppl_bad_options_are_refused_before_loading[batch-size-*] |
| 8 `eval ppl --ctx 1` / `0` | refused only after loading the model | refused before loading | test_eval_ppl_bad_options_are_refused_before_loading[ctx-*] |
| 8 `perplexity(batch_size=0)` (library) | RuntimeError | UserError | test_perplexity_function_refuses_batch_size_zero |
| 9 `eval ppl --ctx` > max_position_embeddings | loads and evaluates (minutes on real models) | exit 2 before loading, names the limit | test_eval_ppl_bad_options_are_refused_before_loading[ctx-beyond-limit] |
| 9 `eval ppl GOOD MISSING` | evaluates GOOD, then fails on MISSING | fails before loading either | test_eval_ppl_checks_every_model_first |
| 9 eval-gate candidate missing / without config.json / without a tokenizer | whole baseline evaluated first (output folder created) | refused before any evaluation, no -o folder | test_eval_gate_checks_both_models_before_evaluating[*] |
| 9 eval-gate candidate with another tokenizer | baseline evaluated, then both, then "tokenize differently" | refused up front, names what differs | test_eval_gate_checks_both_models_before_evaluating[other-tokenizer] |
| 9 eval-gate tier perplexity ctx > a model's max_position_embeddings | evaluates both models | refused up front | test_eval_gate_checks_both_models_before_evaluating[ctx-beyond-limit] |
| 9 `run_gate` with -o an existing file (the CLI's click.Path refuses it itself) | FileExistsError traceback | one line, before evaluating, file untouched | test_eval_gate_output_that_is_a_file |
| control: `eval ppl` with good options and tokenizer comparison of identical tokenizers | works | still works | test_eval_ppl_good_options_still_run, test_identical_tokenizers_have_no_difference |
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from lmfoundry.errors import UserError
from lmfoundry.evals import gate as gate_mod
from lmfoundry.evals.checked_model import check_model, tokenizer_difference
from lmfoundry.evals.gate_spec import load_gate

TEXT = ("Perplexity is the exponential of the mean negative log-likelihood per token. " * 40 + "\n") * 4


def _cli(args: list[str], capsys) -> tuple[int | None, str, str]:
    """Run `lmfoundry ARGS` in-process; (exit code or None when it returned, stdout, stderr)."""
    from lmfoundry.cli import main

    try:
        main(args)
        code = None
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _assert_one_line_error(code, err, needle: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err


@pytest.fixture
def no_loading(monkeypatch):
    """Make loading weights or evaluating a model fail the test: the checks must come first."""
    import lmfoundry.runtime.loader as runtime_loader

    def refuse(*a, **k):
        raise AssertionError("a model was loaded or evaluated before the inputs were checked")

    monkeypatch.setattr(runtime_loader, "load_model", refuse)
    monkeypatch.setattr(gate_mod, "evaluate_model", refuse)


# ---- gate YAML (case 8) -----------------------------------------------------------------------
def _gate_dict(tmp: Path) -> dict:
    text = tmp / "ppl.txt"
    text.write_text(TEXT)
    return {
        "name": "tiny", "seed": 0, "confidence": 0.95, "resamples": 500,
        "prompt": {"add_bos": "tokenizer", "chat_template": False, "num_fewshot": 0},
        "defaults": {"min_recovery": 0.95, "max_ppl_ratio": 1.05},
        "tiers": {"quick": {"tasks": {"lmf_arc_easy": {"limit": 12, "gate": ["acc"]},
                                      "lmf_piqa": {"limit": 10, "gate": {"acc": 0.95}}},
                            "perplexity": {"text": str(text), "ctx": 32, "windows": 6}},
                  "full": {"tasks": {"lmf_piqa": {"limit": 20, "gate": ["acc"]}}}},
    }


def _quick(g: dict) -> dict:
    return g["tiers"]["quick"]


GATE_BREAKAGE = {
    # raised a ValueError/AttributeError traceback before
    "confidence-a-word": (lambda g: g.update(confidence="high"), "confidence must be a number"),
    "seed-a-word": (lambda g: g.update(seed="abc"), "seed must be an integer"),
    "resamples-a-word": (lambda g: g.update(resamples="many"), "resamples must be an integer"),
    "exit-code-a-word": (lambda g: g.update(inconclusive_exit_code="two"), "must be an integer"),
    "prompt-a-number": (lambda g: g.update(prompt=3), "prompt must be a mapping"),
    "num-fewshot-a-word": (lambda g: g["prompt"].update(num_fewshot="two"), "num_fewshot must be an integer"),
    "defaults-a-list": (lambda g: g.update(defaults=[1]), "defaults must be a mapping"),
    "min-recovery-a-word": (lambda g: g["defaults"].update(min_recovery="x"), "min_recovery must be a number"),
    "tier-a-list": (lambda g: g["tiers"].update(quick=[1, 2]), "tiers.quick must be a mapping"),
    "tasks-a-list": (lambda g: _quick(g).update(tasks=["lmf_piqa"]), "tasks must be a mapping"),
    "task-body-a-number": (lambda g: _quick(g)["tasks"].update(lmf_piqa=5), "lmf_piqa must be a mapping"),
    "threshold-a-word": (lambda g: _quick(g)["tasks"]["lmf_piqa"].update(gate={"acc": "high"}),
                         "gate.acc must be a number"),
    "perplexity-a-word": (lambda g: _quick(g).update(perplexity="yes"), "perplexity must be a mapping"),
    "ctx-a-word": (lambda g: _quick(g)["perplexity"].update(ctx="long"), "ctx must be an integer"),
    # accepted before, wrong or failing later
    "chat-template-a-string": (lambda g: g["prompt"].update(chat_template="no"), "must be true or false"),
    "limit-true": (lambda g: _quick(g)["tasks"]["lmf_piqa"].update(limit=True), "limit must be an integer"),
    "seed-negative": (lambda g: g.update(seed=-1), "seed must be between"),
    "seed-beyond-32-bits": (lambda g: g.update(seed=2**40), "seed must be between"),
    "resamples-zero": (lambda g: g.update(resamples=0), "resamples must be between"),
    "num-fewshot-negative": (lambda g: g["prompt"].update(num_fewshot=-1), "num_fewshot must be at least 0"),
    "max-ratio-nan": (lambda g: _quick(g)["perplexity"].update(max_ratio=float("nan")), "max_ratio must be a number"),
    "tier-key-typo": (lambda g: _quick(g).update(perplexty=_quick(g).pop("perplexity")), "unknown key(s) perplexty"),
    "other-tier-broken": (lambda g: g["tiers"]["full"]["tasks"].update(lmf_piqa={"limit": "all"}),
                          "tiers.full.tasks.lmf_piqa.limit must be an integer"),
    # issue 46: rates above 1 (never met, or never missed) were accepted
    "same-top-rate-above-one": (lambda g: g["defaults"].update(min_same_top=1.5), "min_same_top is a rate"),
    "flip-rate-above-one": (lambda g: _quick(g)["tasks"]["lmf_piqa"].update(gate={"acc_flips": 2}),
                            "gate.acc_flips is a rate"),
    "tier-exact-match-above-one": (lambda g: _quick(g).update(generation={"min_exact_match": 3}),
                                   "min_exact_match is a rate"),
}


@pytest.mark.parametrize("case", sorted(GATE_BREAKAGE))
def test_gate_yaml_wrong_types_are_user_errors(tmp_path, case):
    g = _gate_dict(tmp_path)
    change, expected = GATE_BREAKAGE[case]
    change(g)
    path = tmp_path / "gate.yaml"
    path.write_text(yaml.safe_dump(g))
    with pytest.raises(UserError) as exc:
        load_gate(str(path)).tier("quick")  # what run_gate does first
    msg = str(exc.value)
    assert "\n" not in msg and expected in msg and str(path) in msg, msg


def test_recipe_gate_section_of_the_wrong_type(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("gate: 5\n")
    with pytest.raises(UserError, match="gate must be a mapping"):
        load_gate(str(recipe))


def test_good_gate_file_still_loads(tmp_path):
    path = tmp_path / "gate.yaml"
    path.write_text(yaml.safe_dump(_gate_dict(tmp_path)))
    quick = load_gate(str(path)).tier("quick")
    tasks, ppl = quick.tasks, quick.perplexity
    assert [t.name for t in tasks] == ["lmf_arc_easy", "lmf_piqa"] and tasks[1].gate == {"acc": 0.95}
    assert ppl.ctx == 32 and ppl.windows == 6 and ppl.max_ratio == 1.05


def test_eval_gate_cli_bad_gate_yaml_is_one_line(tiny_model_dir, tmp_path, capsys, no_loading):
    g = _gate_dict(tmp_path)
    g["confidence"] = "high"
    path = tmp_path / "gate.yaml"
    path.write_text(yaml.safe_dump(g))
    out = tmp_path / "report"
    code, _, err = _cli(["eval-gate", str(tiny_model_dir), "--baseline", str(tiny_model_dir), "--gate", str(path),
                         "-o", str(out), "--quiet"], capsys)
    _assert_one_line_error(code, err, "confidence must be a number")
    assert not out.exists()


def test_duplicate_keys_in_a_gate_or_recipe_are_refused(tmp_path):
    """Issue 46: YAML keeps the last of two equal keys silently; a doubled threshold is a mistake."""
    g = _gate_dict(tmp_path)
    text = yaml.safe_dump(g).replace("  max_ppl_ratio: 1.05\n", "  max_ppl_ratio: 1.05\n  max_ppl_ratio: 2.0\n")
    path = tmp_path / "gate.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match="key 'max_ppl_ratio' appears twice"):
        load_gate(str(path))
    from lmfoundry.recipe import Recipe

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("quantize: {scheme: w4a16, scheme: w8a16}\n")
    with pytest.raises(UserError, match="key 'scheme' appears twice"):
        Recipe.from_yaml(recipe)


def test_a_gated_metric_the_task_lacks_is_refused_before_evaluating(tiny_model_dir, tmp_path, capsys, no_loading):
    """Issue 46: `gate: [acc_nrom]` was refused only after both models were evaluated (and cached)."""
    g = _gate_dict(tmp_path)
    _quick(g)["tasks"]["lmf_piqa"]["gate"] = {"acc_nrom": 0.9, "acc_flips": 0.2}
    path = tmp_path / "gate.yaml"
    path.write_text(yaml.safe_dump(g))
    out = tmp_path / "report"
    code, _, err = _cli(["eval-gate", str(tiny_model_dir), "--baseline", str(tiny_model_dir), "--gate", str(path),
                         "-o", str(out), "--quiet"], capsys)
    _assert_one_line_error(code, err, "gated metric(s) acc_nrom not produced by the task")
    assert "acc, acc_norm" in err and not out.exists()


# ---- eval ppl bounds (cases 8 and 9) -----------------------------------------------------------
PPL_BAD_OPTIONS = {
    "batch-size-zero": (["--batch-size", "0"], "--batch-size must be at least 1"),
    "batch-size-negative": (["--batch-size", "-3"], "--batch-size must be at least 1"),
    "ctx-one": (["--ctx", "1"], "--ctx must be at least 2"),
    "ctx-zero": (["--ctx", "0"], "--ctx must be at least 2"),
    "ctx-beyond-limit": (["--ctx", "4096"], "exceeds"),
    "deterministic-tp": (["--deterministic", "--tp", "2"], "--deterministic runs the CPU engine in one process"),
}


@pytest.mark.parametrize("case", sorted(PPL_BAD_OPTIONS))
def test_eval_ppl_bad_options_are_refused_before_loading(tiny_model_dir, tmp_path, capsys, no_loading, case):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    extra, expected = PPL_BAD_OPTIONS[case]
    code, _, err = _cli(["eval", "ppl", str(tiny_model_dir), "--text", str(text), *extra], capsys)
    _assert_one_line_error(code, err, expected)
    if case == "ctx-beyond-limit":
        assert "max_position_embeddings (512)" in err


def test_eval_ppl_checks_every_model_first(tiny_model_dir, tmp_path, capsys, no_loading):
    code, _, err = _cli(["eval", "ppl", str(tiny_model_dir), str(tmp_path / "missing-model")], capsys)
    _assert_one_line_error(code, err, "missing-model")


def test_eval_ppl_good_options_still_run(tiny_model_dir, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    code, out, err = _cli(["eval", "ppl", str(tiny_model_dir), "--text", str(text), "--ctx", "32",
                           "--max-windows", "3", "--batch-size", "2", "--json"], capsys)
    assert code is None, err
    res = json.loads(out)
    assert res["windows"] == 3 and res["ctx"] == 32 and res["ppl"] > 1


def test_perplexity_function_refuses_batch_size_zero():
    import torch

    from lmfoundry.evals.perplexity import perplexity

    with pytest.raises(UserError, match="--batch-size must be at least 1"):
        perplexity(None, torch.arange(100), ctx=10, batch_size=0, progress=False)


# ---- eval-gate: both models checked before evaluating either (case 9) -------------------------
def _no_tokenizer(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        if "token" in f.name or f.name in ("vocab.json", "merges.txt"):
            f.unlink()
    return dst


def _no_config(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "config.json").unlink()
    return dst


def _other_tokenizer(src: Path, dst: Path) -> Path:
    from helpers import tiny_model_folder

    return tiny_model_folder(dst, "llama")  # a word-level tokenizer, not the fixture's BPE


GATE_MODEL_PROBLEMS = {
    "candidate-missing": (lambda src, dst: dst, "no such file or folder"),
    "candidate-without-config": (_no_config, "no config.json"),
    "candidate-without-tokenizer": (_no_tokenizer, "no tokenizer files"),
    "other-tokenizer": (_other_tokenizer, "different tokenizers (vocabularies differ"),
    "ctx-beyond-limit": (lambda src, dst: shutil.copytree(src, dst) and dst, "exceeds"),
}


@pytest.mark.parametrize("case", sorted(GATE_MODEL_PROBLEMS))
def test_eval_gate_checks_both_models_before_evaluating(tiny_model_dir, tmp_path, capsys, no_loading, case):
    make, expected = GATE_MODEL_PROBLEMS[case]
    candidate = make(tiny_model_dir, tmp_path / "candidate")
    g = _gate_dict(tmp_path)
    if case == "ctx-beyond-limit":
        _quick(g)["perplexity"]["ctx"] = 1024  # the tiny models' max_position_embeddings is 512
    path = tmp_path / "gate.yaml"
    path.write_text(yaml.safe_dump(g))
    out = tmp_path / "report"
    code, _, err = _cli(["eval-gate", str(candidate), "--baseline", str(tiny_model_dir), "--gate", str(path),
                         "-o", str(out), "--quiet", "--no-cache"], capsys)
    _assert_one_line_error(code, err, expected)
    assert not out.exists()  # nothing half-done left behind


def test_eval_gate_output_that_is_a_file(tiny_model_dir, tmp_path, capsys, no_loading):
    path = tmp_path / "gate.yaml"
    path.write_text(yaml.safe_dump(_gate_dict(tmp_path)))
    out = tmp_path / "report"
    out.write_text("not a folder")
    with pytest.raises(UserError, match="exists and is not a folder"):
        gate_mod.run_gate(str(tiny_model_dir), str(tiny_model_dir), str(path), "quick", out, use_cache=False)
    assert out.read_text() == "not a folder"


def test_identical_tokenizers_have_no_difference(tiny_model_dir, tmp_path):
    a = check_model(str(tiny_model_dir))
    b = check_model(str(shutil.copytree(tiny_model_dir, tmp_path / "copy")))
    assert tokenizer_difference(a.tokenizer, b.tokenizer) is None
    assert a.config.max_position_embeddings == 512
