"""eval-gate: score a candidate and its baseline on the same units, decide with paired statistics.

Flow: load the gate spec (`gate_spec.py`: thresholds, tiers, pinned prompt settings) -> check
both models up front (`checked_model.py`: config, tokenizer, context; seconds, before minutes of
evaluation) -> evaluate the baseline (`cached_evaluation.py`): load it with the runtime loader in
the dtype `serve` would run it in, and drive it through the serving engine (`RuntimeLM` with
`serving`: the module swaps, attention kernels and step budget of `serve`, deterministic when
asked): run the tier's lm-eval tasks (`lm_eval_runner.py`), score the perplexity windows while
keeping its next-token distributions as the reference (`divergence.py`), decode the generation
prompts greedily (`generation.py`) -> evaluate the candidate the same way, scoring its
distributions against the reference token by token -> pair the results and decide each gated
statistic (`comparison.py`, `stats.py`) -> one overall verdict, the report (`gate_report.py`,
which records the execution path and dtype), the promotion record (`promotion.py`). So the gate's
numbers are the ones the served candidate produces: with `deterministic`, `lm_eval --model
local-completions` against `serve --deterministic` in the same dtype scores the same tasks
identically.

With a LoRA adapter (`eval-gate --lora NAME=PATH`) both models run it on every row of every
forward (`runtime.engine.lora_adapters.attach_adapter`: the serving engine's gathered LoRA
products on top of each base's own linears), so the gate answers whether the adapter on the
quantized base (QLoRA's deployment) matches the adapter on the float base; the adapter's files
are part of each model's cache key.

Per-model results are cached (`cached_evaluation.py`), keyed by the sha256 of the model's files
(`fingerprints.py`) and every other input; gating five candidates against one baseline evaluates
the baseline once. The cache only skips recomputation of a deterministic function of those
inputs; `--no-cache` recomputes.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmfoundry.checkpoint.lora_adapter import check_adapter
from lmfoundry.engine_bundle.engine_manifest import read_manifest
from lmfoundry.errors import UserError
from lmfoundry.evals import stats
from lmfoundry.evals.cached_evaluation import SCHEMA_VERSION, evaluate_model
from lmfoundry.evals.checked_model import CheckedModel, check_context, check_model, tokenizer_difference
from lmfoundry.evals.comparison import compare
from lmfoundry.evals.divergence import TokenStatistics, summary
from lmfoundry.evals.gate_memory import MemoryPlan, imported_process_bytes, model_memory
from lmfoundry.evals.gate_report import write_markdown, write_plot
from lmfoundry.evals.gate_spec import TaskSpec, load_gate
from lmfoundry.evals.generation import Prompt, common_prefix, tier_prompts, validity
from lmfoundry.evals.lm_eval_runner import check_gated_metrics, materialize_tasks
from lmfoundry.evals.promotion import record_promotion
from lmfoundry.manifest import tool_versions
from lmfoundry.output_paths import refuse_overlap
from lmfoundry.runtime.loader import resolve_dtype


@dataclass
class GateResult:
    """One gate's outcome: the verdict and the exit code `eval-gate` exits with, the report as
    written to `json_path` (beside its markdown and plot), and whether the verdict went into the
    candidate's manifest."""

    verdict: str
    exit_code: int
    report: dict[str, Any]
    json_path: Path
    markdown_path: Path
    plot_path: Path
    promotion_written: bool


def run_gate(candidate: str, baseline: str, gate_spec: str | None = None, tier: str = "quick",
             output: str | Path = "eval-gate", extra_tasks: tuple[str, ...] = (),
             include_paths: tuple[str, ...] = (), use_cache: bool = True, inconclusive_exit: int | None = None,
             write_promotion: bool = True, progress: bool = False, device: str = "cpu",
             dtype: str = "auto", tp: int = 1, deterministic: bool = False,
             lora: tuple[str, str] | None = None) -> GateResult:
    """Evaluate, compare, write eval-gate.json + eval-gate.md + eval-gate.png, record the verdict.
    With `lora` (name, PEFT folder), both models run the adapter (see the module doc)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    gate = load_gate(gate_spec)
    plan = gate.tier(tier)
    tasks, ppl = plan.tasks, plan.perplexity
    for name in extra_tasks:
        if name not in {t.name for t in tasks}:
            tasks.append(TaskSpec(name, None, {}))
    prompts = None if plan.generation is None else tier_prompts(plan.generation)  # a broken file: an error now
    user_paths = [Path(p).expanduser().resolve() for p in include_paths]
    for p in user_paths:
        if not p.is_dir():
            raise UserError(f"--include-path {p}: not a folder")
    out = Path(output)
    _check_output_folder(out, [candidate, baseline, gate.source, *user_paths])
    # Both models up front: evaluating the baseline takes minutes, and a missing candidate, one
    # without a usable config or tokenizer, or one that tokenizes differently would make all of
    # it wasted work.
    cand_model, base_model = check_model(candidate, allow_bundle=True), check_model(baseline, allow_bundle=True)
    why = tokenizer_difference(cand_model.tokenizer, base_model.tokenizer)
    if why is not None:
        raise UserError(f"candidate {candidate} and baseline {baseline} have different tokenizers ({why}); "
                        "the gate compares them document by document on the same tokens")
    if ppl is not None:
        for m in (cand_model, base_model):
            check_context(ppl.ctx, m, f"{gate.source}: tiers.{tier}.perplexity.ctx")
    if lora is not None:
        _check_adapter(lora, (cand_model, base_model), tp, device)
    del cand_model, base_model
    with tempfile.TemporaryDirectory(prefix="lmfoundry-gate-") as tmp:
        ours, task_hashes = materialize_tasks(Path(tmp))
        paths = [ours, *user_paths]
        check_gated_metrics(tasks, paths)
        base = evaluate_model(baseline, plan, gate, paths, task_hashes, use_cache, progress, device, dtype,
                              prompts=prompts, tp=tp, deterministic=deterministic, lora=lora)
        cand = evaluate_model(candidate, plan, gate, paths, task_hashes, use_cache, progress, device, dtype,
                              reference=base.get("reference"), prompts=prompts, tp=tp, deterministic=deterministic,
                              lora=lora)
    metrics = compare(cand, base, plan, gate, prompts or [])
    gated = [m for m in metrics if m["gated"]]
    verdict = stats.combine([m["verdict"] for m in gated])
    code = {stats.PASS: 0, stats.FAIL: 1}.get(verdict)
    if code is None:
        code = gate.inconclusive_exit_code if inconclusive_exit is None else inconclusive_exit
    report = {
        "schema": SCHEMA_VERSION,
        "verdict": verdict,
        "exit_code": code,
        "failing": [m["name"] for m in gated if m["verdict"] == stats.FAIL],
        "inconclusive": [{"name": m["name"], "samples_needed": m["samples_needed"]}
                         for m in gated if m["verdict"] == stats.INCONCLUSIVE],
        "gate": {"name": gate.name, "file": gate.source, "sha256": gate.sha256, "tier": tier, "seed": gate.seed,
                 "confidence": gate.confidence, "resamples": gate.resamples,
                 "rule": "fail if the interval lies entirely on the wrong side of the threshold; pass if "
                         "entirely on the right side; else inconclusive",
                 "defaults": {"min_recovery": gate.min_recovery, "max_ppl_ratio": gate.max_ppl_ratio,
                              "max_flip_rate": gate.max_flip_rate, **gate.limits}},
        "prompt": {"add_bos": gate.add_bos, "chat_template": gate.chat_template, "num_fewshot": gate.num_fewshot},
        "metrics": metrics,
        "candidate": _model_summary(cand),
        "baseline": _model_summary(base),
        "tasks": {t.name: {"limit": t.limit, "n_docs": cand["tasks"][t.name]["n_docs"],
                           "sha256": task_hashes.get(t.name, "user task")} for t in tasks},
        "perplexity_text": None if ppl is None else {k: cand["perplexity"][k] for k in
                                                     ("source", "source_sha256", "token_sha256", "ctx", "windows")},
        "divergence": None if ppl is None else summary(TokenStatistics.from_lists(cand["divergence"])),
        "generation": None if prompts is None else _answers(prompts, cand["generation"], base["generation"]),
        "versions": {**tool_versions(), "lm-eval": importlib.metadata.version("lm_eval")},
        "lora": cand.get("lora"),
    }
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = out / "eval-gate.json", out / "eval-gate.md", out / "eval-gate.png"
    json_path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    write_plot(report, png_path)
    write_markdown(report, md_path, png_path.name)
    promoted = False
    if write_promotion:
        promoted = record_promotion(candidate, report, json_path, md_path)
    return GateResult(verdict, code, report, json_path, md_path, png_path, promoted)


def plan_gate(candidate: str, baseline: str, gate_spec: str | None = None, tier: str = "quick",
              device: str = "cpu", dtype: str = "auto") -> MemoryPlan:
    """What `run_gate` will hold in memory at its peak (`gate_memory.py`), from the models'
    configs and safetensors headers, without loading either: CI sizes its runner from this line
    before spending an hour on a model that does not fit."""
    plan = load_gate(gate_spec).tier(tier)
    parts = []
    for spec, is_base in ((baseline, True), (candidate, False)):
        m = check_model(spec, allow_bundle=True)
        if m.bundle:
            raise UserError(f"{spec}: --dry-run plans checkpoints run on the CPU engine, not engine bundles")
        parts.append(model_memory(spec, m.folder, m.config, plan, resolve_dtype(dtype, spec, device), device,
                                  baseline=is_base))
    return MemoryPlan(imported_process_bytes(), parts)


def _check_adapter(lora: tuple[str, str], models: tuple[CheckedModel, ...], tp: int, device: str) -> None:
    """Refuse, before either model is evaluated, an adapter either base cannot run (one line)."""
    if tp > 1:
        raise UserError("--lora with --tp: the runtime serves LoRA adapters on one process")
    name, path = lora
    for m in models:
        try:
            rank = check_adapter(path, m.config)
        except UserError as exc:
            raise UserError(f"--lora {name} on {m.spec}: {exc}") from None
        if m.bundle and device != "cpu":
            record = read_manifest(Path(m.spec)).get("lora")
            if record is None or rank > record["max_rank"]:
                raise UserError(f"{m.spec}: the bundle has no LoRA kernels for rank {rank}; compile it with "
                                f"--max-loras 1 --max-lora-rank {rank} (or more)")


def _answers(prompts: list[Prompt], cand: list[dict[str, Any]], base: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prompt by prompt: where the candidate's greedy answer left the baseline's, and validity."""
    return [{"id": c["id"], "kind": c["kind"], "tokens": len(b["tokens"]),
             "same_until": common_prefix(c["tokens"], b["tokens"]), "identical": c["tokens"] == b["tokens"],
             "candidate_valid": cv, "baseline_valid": bv, "candidate": c["text"], "baseline": b["text"]}
            for c, b, cv, bv in zip(cand, base, validity(prompts, cand), validity(prompts, base), strict=True)]


def _check_output_folder(out: Path, inputs: list[Any]) -> None:
    """Refuse an -o that cannot take the report before evaluating anything, without creating it
    yet (a refused or failed gate leaves no empty report folder behind): one that is, lies inside
    or links into an input (the report inside the candidate would break its manifest)."""
    refuse_overlap(out, inputs, holds_inputs_ok=True)
    if out.exists() and not out.is_dir():
        raise UserError(f"-o {out}: exists and is not a folder")
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"-o {out}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"-o {out}: {existing} is not writable")


def _model_summary(ev: dict[str, Any]) -> dict[str, Any]:
    return {"spec": ev["spec"], "path": ev["path"], "sha256": ev["fingerprint"]["sha256"],
            "files": ev["fingerprint"]["files"], "dtype": ev["dtype"], "execution": ev.get("execution"),
            "prompt": ev["prompt"], "memory": ev.get("memory"),
            "threads": ev["threads"], "seconds": ev["seconds"], "from_cache": ev.get("from_cache")}
