"""eval-gate: score a candidate and its baseline on the same units, decide with paired statistics.

Flow: load the gate spec (`gate_spec.py`: thresholds, tiers, pinned prompt settings) -> evaluate
the baseline: load it with the runtime loader in the dtype `serve` would run it in, and drive it
through the serving engine (`RuntimeLM` with `serving`: the module swaps, attention kernels and
step budget of `serve`, deterministic when asked): run the tier's lm-eval tasks, score the
perplexity windows while keeping its next-token distributions as the reference (`divergence.py`),
decode the generation prompts greedily (`generation.py`) -> evaluate the candidate the same way,
scoring its distributions against the reference token by token -> pair the results and decide
each gated statistic (`comparison.py`, `stats.py`) -> one overall verdict, the report (which
records the execution path and dtype), the promotion record. So the gate's numbers are the ones
the served candidate produces: with `deterministic`, `lm_eval --model local-completions` against
`serve --deterministic` in the same dtype scores the same tasks identically.

With a LoRA adapter (`eval-gate --lora NAME=PATH`) both models run it on every row of every
forward (`runtime.engine.lora.attach_adapter`: the serving engine's gathered LoRA products on top
of each base's own linears), so the gate answers whether the adapter on the quantized base
(QLoRA's deployment) matches the adapter on the float base; the adapter's files are part of
each model's cache key.

Per-model results are cached under `<cache>/eval-gate/`, keyed by the sha256 of the model's
weights, config and tokenizer, the task files, the tier and prompt settings and the library
versions; a baseline's reference is cached beside its results and a candidate's key includes the
reference's digest. Gating five candidates against one baseline evaluates the baseline once. The
cache only skips recomputation of a deterministic function of those inputs; `--no-cache`
recomputes.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.metadata
import io
import json
import logging
import os
import tempfile
import time
import unittest.mock
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from lmfoundry.errors import UserError
from lmfoundry.evals import stats
from lmfoundry.evals.comparison import compare
from lmfoundry.evals.divergence import DivergenceScorer, Reference, ReferenceRecorder, TokenStatistics, summary
from lmfoundry.evals.gate_memory import MemoryPlan, Phases, imported_process_bytes, model_memory
from lmfoundry.evals.gate_spec import GateSpec, TaskSpec, Tier, load_gate
from lmfoundry.evals.generation import Prompt, common_prefix, generate, tier_prompts, validity
from lmfoundry.heap import release_free_heap
from lmfoundry.resources import shipped

TASKS_DIR = shipped("lmfoundry.evals", "tasks")
SCHEMA_VERSION = 2
PPL_BATCH = 1  # perplexity windows per engine call (part of the cache key: batching changes rounding)


# ---- tasks ----------------------------------------------------------------------------------
def materialize_tasks(workdir: Path) -> tuple[Path, dict[str, str]]:
    """Copy the shipped task YAMLs into `workdir` with data_files made absolute (lm-eval needs
    absolute paths); returns the include path and a sha256 per task over its YAML and data."""
    out = workdir / "lmfoundry-tasks"
    out.mkdir(parents=True, exist_ok=True)
    hashes = {}
    for yml in sorted(TASKS_DIR.glob("*/*.yaml")):
        cfg = yaml.safe_load(yml.read_text())
        h = hashlib.sha256(yml.read_bytes())
        files = cfg.get("dataset_kwargs", {}).get("data_files", {})
        for split, rel in files.items():
            path = (yml.parent / rel).resolve()
            if not path.exists():
                raise UserError(f"{yml}: data file {path} is missing (reinstall lmfoundry)")
            files[split] = str(path)
            h.update(path.read_bytes())
        (out / yml.name).write_text(yaml.safe_dump(cfg, sort_keys=False))
        hashes[cfg["task"]] = h.hexdigest()
    return out, hashes


def task_manager(names: list[str], include_paths: list[Path]) -> Any:
    """lm-eval TaskManager over our tasks (+ the user's include paths); lm-eval's built-in task
    index (16 s to build) is only loaded when a requested name is not found locally."""
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=[str(p) for p in include_paths], include_defaults=False)
    if all(n in tm.all_tasks for n in names):
        return tm
    tm = TaskManager(include_path=[str(p) for p in include_paths], include_defaults=True)
    missing = [n for n in names if n not in tm.all_tasks]
    if missing:
        raise UserError(f"unknown lm-eval task(s): {', '.join(missing)} (add --include-path for your own task YAMLs)")
    return tm


def check_gated_metrics(tasks: list[TaskSpec], include_paths: list[Path]) -> None:
    """Refuse, before any model is evaluated, a gate on a metric its task does not report (a typo
    such as `acc_nrom` used to surface only after both models had run). The tasks' configs are read
    through lm-eval itself, so a user task's own metric_list and filters count as lm-eval reports
    them (`metric` for the unfiltered result, `metric,filter` otherwise)."""
    from lmfoundry.evals.comparison import FLIPS

    gated = [t for t in tasks if t.gate]
    if not gated:
        return
    loaded = task_manager([t.name for t in gated], include_paths).load([t.name for t in gated])["tasks"]
    for t in gated:
        task = loaded.get(t.name)
        if task is None:  # a group: its members report per member; checked after evaluation
            continue
        filters = [f.name for f in getattr(task, "_filters", [])] or ["none"]
        reported = {m if f == "none" else f"{m},{f}" for m in task._metric_fn_list for f in filters}
        asked = {m[: -len(FLIPS)] if m.endswith(FLIPS) else m for m in t.gate}
        unknown = sorted(asked - reported)
        if unknown:
            raise UserError(f"{t.name}: gated metric(s) {', '.join(unknown)} not produced by the task (it reports "
                            f"{', '.join(sorted(reported))}); nothing was evaluated")


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """Nothing lm-eval (or the datasets library under it) writes reaches the terminal: progress
    bars whatever their `disable` argument (tqdm reads TQDM_DISABLE only when it is imported, and
    an explicit disable=False wins over it), prints and warnings all go to the current
    sys.stdout/sys.stderr, which are swapped for a sink. Errors still raise."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def run_lm_eval(lm: Any, tasks: list[TaskSpec], gate: GateSpec, include_paths: list[Path],
                progress: bool = False) -> dict[str, dict[str, Any]]:
    """Run lm-eval on `lm` and return per-task, per-document results, ordered by doc id."""
    from lm_eval import simple_evaluate

    if not tasks:
        return {}
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.WARNING if progress else logging.ERROR)
    names = [t.name for t in tasks]
    tm = task_manager(names, include_paths)
    samples = {t.name: list(range(t.limit)) for t in tasks if t.limit is not None}
    # lm-eval records its own git commit by running `git describe` in the working directory: outside
    # a checkout git prints `fatal: not a git repository` on our stderr (fd 2, past `_silenced`), and
    # inside one it records the user's repository, not lm-eval's. The installed version is in the
    # report already (tool versions), so the lookup is skipped.
    import lm_eval.evaluator

    with contextlib.nullcontext() if progress else _silenced(), \
            unittest.mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None):
        res = simple_evaluate(model=lm, tasks=names, num_fewshot=gate.num_fewshot, samples=samples or None,
                              log_samples=True, bootstrap_iters=0, apply_chat_template=gate.chat_template,
                              random_seed=gate.seed, numpy_random_seed=gate.seed, torch_random_seed=gate.seed,
                              fewshot_random_seed=gate.seed, task_manager=tm)
    if res is None:
        raise RuntimeError("lm-eval returned no results")
    out = {}
    for task in names:
        rows = sorted(res["samples"].get(task, []), key=lambda r: r["doc_id"])
        if not rows:
            raise UserError(f"lm-eval task {task} produced no documents (is the tier's limit beyond its data?)")
        metrics: dict[str, list[Any]] = {}
        for r in rows:
            suffix = "" if r.get("filter", "none") == "none" else f",{r['filter']}"
            for m in r["metrics"]:
                v = r[m]
                metrics.setdefault(m + suffix, []).append(list(v) if isinstance(v, (tuple, list)) else float(v))
        lls = [[float(x[0]) if isinstance(x, (tuple, list)) else x for x in r["filtered_resps"]] for r in rows]
        out[task] = {
            "doc_ids": [int(r["doc_id"]) for r in rows],
            "doc_hashes": [r.get("doc_hash") for r in rows],
            "metrics": metrics,
            "responses": lls,
            "higher_is_better": dict(res.get("higher_is_better", {}).get(task, {})),
            "n_docs": len(rows),
        }
    return out


# ---- models ---------------------------------------------------------------------------------
FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
# Encoded by both tokenizers of a gate: equal vocabularies can still split text differently
# (merges, normalizer, pre-tokenizer), and then no paired per-document comparison is meaningful.
TOKENIZER_PROBE = ("The quick brown fox jumps over the lazy dog. 1234567890, naïve café — ¿qué? 日本語\n"
                   "\tdef f(x):\n\t\treturn x ** 2  # comment  ")


@dataclass
class CheckedModel:
    """What the up-front check learned about a model spec: where it lives, its config, its tokenizer."""

    spec: str
    folder: Path
    config: Any  # lmfoundry.model.config.ModelConfig
    tokenizer: Any
    bundle: bool = False  # an engine bundle: its compiled kernels run it

    @property
    def context_limit(self) -> int:
        """The longest window the runtime computes exactly for this model (a bundle of a
        sliding-window model: its window; see ModelConfig.kernel_context_limit)."""
        return self.config.kernel_context_limit if self.bundle else self.config.max_position_embeddings


def check_model(spec: str, allow_bundle: bool = False) -> CheckedModel:
    """Resolve `spec` and load its config and tokenizer (not its weights), so that a missing model,
    a folder without a usable config or tokenizer, or one of two mismatched models is reported in
    seconds, before minutes of evaluating the other. With `allow_bundle`, an engine bundle (which
    `load_model` runs) is read from its weights/ folder (rank 0's of a tensor-parallel bundle,
    with the whole model's config)."""
    from lmfoundry.checkpoint.sources import resolve_model
    from lmfoundry.checkpoint.tokenizer import load_tokenizer
    from lmfoundry.model.config import ModelConfig
    from lmfoundry.runtime.bundle_manifest import is_engine_bundle, weights_folder
    from lmfoundry.runtime.loader import whole_model_config

    path = Path(spec).expanduser()
    bundle = allow_bundle and is_engine_bundle(path)
    if bundle:
        folder = weights_folder(path)
        config = whole_model_config(path)
    else:
        folder = resolve_model(spec)
        config = ModelConfig.from_file(folder)
    return CheckedModel(spec, folder, config, load_tokenizer(folder), bundle)


def tokenizer_difference(a: Any, b: Any) -> str | None:
    """None when tokenizers `a` and `b` map text to the same ids (same vocabulary, same special
    token ids, same encoding of a probe text), else what differs."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        diff = sorted(set(va.items()) ^ set(vb.items()))
        return f"vocabularies differ: {len(va)} vs {len(vb)} tokens, e.g. {diff[0][0]!r}"
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        if getattr(a, attr, None) != getattr(b, attr, None):
            return f"{attr} {getattr(a, attr, None)} vs {getattr(b, attr, None)}"
    if a(TOKENIZER_PROBE).input_ids != b(TOKENIZER_PROBE).input_ids:
        return "the same text is split into different tokens"
    return None


def check_context(ctx: int, model: CheckedModel, option: str) -> None:
    """Refuse windows longer than the model's position limit: the model never saw such positions
    (the numbers would mean nothing), and on CPU a long window costs minutes before failing."""
    limit = model.context_limit
    if ctx > limit:
        what = ("max_position_embeddings" if limit == model.config.max_position_embeddings
                else "sliding window (the bundle's kernels attend causally over everything)")
        raise UserError(f"{option} {ctx} exceeds {model.spec}'s {what} ({limit}); use {limit} or less")


def fingerprint(folder: Path) -> dict[str, Any]:
    """sha256 of the files that determine what a model computes (weights, config, tokenizer)."""
    from lmfoundry.checkpoint.sources import safetensors_files
    from lmfoundry.manifest import sha256_file

    files = {p.relative_to(folder).as_posix(): sha256_file(p) for p in safetensors_files(folder)}
    for name in FINGERPRINT_FILES:
        if (folder / name).exists():
            files[name] = sha256_file(folder / name)
    return _fingerprint_of(files)


def _fingerprint_of(files: dict[str, str]) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest(), "files": files}


def bundle_fingerprint(engine: Path) -> dict[str, Any]:
    """`fingerprint` of an engine bundle's weights (every rank's of a tensor-parallel bundle) and
    of each engine.json, which holds the sha256 of every kernel and compiled step the bundle
    runs: two bundles of the same weights with other kernels compute other numbers."""
    from lmfoundry.manifest import sha256_file
    from lmfoundry.runtime.bundle_manifest import MANIFEST_NAME, bundle_degree, rank_bundle

    degree = bundle_degree(engine)
    files = {MANIFEST_NAME: sha256_file(engine / MANIFEST_NAME)}
    for r in range(degree):
        rank = rank_bundle(engine, r) if degree > 1 else engine
        prefix = f"rank{r}/" if degree > 1 else ""
        files.update({f"{prefix}{name}": sha for name, sha in fingerprint(rank / "weights")["files"].items()})
        if degree > 1:
            files[f"{prefix}{MANIFEST_NAME}"] = sha256_file(rank / MANIFEST_NAME)
    return _fingerprint_of(files)


def adapter_fingerprint(folder: str | Path) -> dict[str, Any]:
    """sha256 of a PEFT LoRA folder's config and weights (what the adapter computes)."""
    from lmfoundry.checkpoint.lora_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from lmfoundry.manifest import sha256_file

    return _fingerprint_of({name: sha256_file(Path(folder) / name) for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)})


def _versions() -> dict[str, str]:
    from lmfoundry.manifest import tool_versions

    return tool_versions()


def _key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _cache_path(key: dict[str, Any]) -> Path:
    from lmfoundry.resources import cache_dir

    return cache_dir() / "eval-gate" / f"{_key_digest(key)}.json"


def _read_cached(cache: Path, key: dict[str, Any], ref_file: Path | None) -> dict[str, Any] | None:
    """The cached results for `key`, or None (a miss; a damaged or foreign entry is removed). The
    file's name is the key's digest, but a name proves nothing: a file copied or swapped under it
    (another model's results, a restored CI cache) would be served as this model's. So each entry
    records its key digest and its reference's sha256, and both are compared before use."""
    from lmfoundry.manifest import sha256_file

    try:
        cached = json.loads(cache.read_text())
        if not isinstance(cached, dict) or cached.pop("cache_key", None) != _key_digest(key):
            raise ValueError("written for another key")
        ref_sha = cached.pop("reference_sha256", None)
        if ref_file is not None:
            if ref_sha != sha256_file(ref_file):
                raise ValueError("reference does not match")
            cached["reference"] = Reference.load(ref_file)
        return cached
    except (json.JSONDecodeError, OSError, ValueError, KeyError, UnicodeDecodeError):
        cache.unlink(missing_ok=True)
        return None


def evaluate_model(spec: str, tier: Tier, gate: GateSpec, include_paths: list[Path], task_hashes: dict[str, str],
                   use_cache: bool = True, progress: bool = False, device: str = "cpu", dtype: str = "auto",
                   reference: Reference | None = None, prompts: list[Prompt] | None = None, tp: int = 1,
                   deterministic: bool = False, lora: tuple[str, str] | None = None) -> dict[str, Any]:
    """Per-document results of one model on the tier (from the cache when the inputs match). An
    engine bundle runs its compiled kernels on `device` (what `serve` would run); a checkpoint runs
    in `dtype` (`auto`: what `serve` picks on this CPU), split over `tp` ranks as `serve --tp`
    runs it (its results are cached apart: the ranks' partial sums round differently); everything
    goes through the serving engine, batch-invariant with `deterministic` (`serve --deterministic`).

    Without `reference` the model is a baseline: its next-token distributions on the perplexity
    windows are kept (`data["reference"]`, cached beside the results). With one, the model is a
    candidate scored against it token by token (`data["divergence"]`), and the reference's digest
    is part of the cache key. With `lora` (name, PEFT folder), the model runs that adapter on every
    row (see the module doc)."""
    import torch

    from lmfoundry.checkpoint.sources import resolve_model
    from lmfoundry.manifest import sha256_file
    from lmfoundry.runtime.bundle_manifest import is_engine_bundle
    from lmfoundry.runtime.loader import resolve_dtype

    tasks, ppl, gen = tier.tasks, tier.perplexity, tier.generation
    bundle = is_engine_bundle(spec)
    run_dtype = resolve_dtype(dtype, spec, device)
    folder = Path(spec) if bundle else resolve_model(spec)
    fp = bundle_fingerprint(folder) if bundle else fingerprint(folder)
    if gen is not None and prompts is None:
        prompts = tier_prompts(gen)
    adapter = None if lora is None else {"name": lora[0], "path": lora[1], "sha256": adapter_fingerprint(lora[1])["sha256"]}
    key = {"schema": SCHEMA_VERSION, "model": fp["sha256"], "versions": _versions(),
           "tasks": [[t.name, t.limit, task_hashes.get(t.name)] for t in tasks],
           "ppl": None if ppl is None else [ppl.text, ppl.ctx, ppl.windows, ppl.top_k, PPL_BATCH],
           "reference": None if reference is None else reference.digest(),
           "generation": None if gen is None else [gen.max_tokens, [p.__dict__ for p in prompts or []]],
           "prompt": [gate.add_bos, gate.chat_template, gate.num_fewshot], "seed": gate.seed,
           "threads": torch.get_num_threads(), **({"device": device} if bundle else {}),
           **({"dtype": str(run_dtype)} if run_dtype is not None else {}), **({"tp": tp} if tp > 1 else {}),
           "execution": {"path": "serving engine", "deterministic": deterministic},
           **({"lora": adapter["sha256"]} if adapter is not None else {})}
    cache = _cache_path(key)
    keeps_reference = ppl is not None and reference is None
    ref_file = cache.with_name(cache.stem + ".reference.npz")
    if use_cache and cache.exists() and (ref_file.exists() or not keeps_reference):
        cached = _read_cached(cache, key, ref_file if keeps_reference else None)
        if cached is not None:
            # the cached numbers belong to these exact files, wherever they were found then
            cached.update(spec=spec, path=str(folder), from_cache=str(cache))
            return cached

    from lmfoundry.calibration.data import eval_token_stream, token_hash
    from lmfoundry.evals.lm_adapter import RuntimeLM
    from lmfoundry.evals.perplexity import perplexity
    from lmfoundry.runtime.loader import load_model

    phases = Phases()
    phases.mark("start")
    t0, cpu0 = time.time(), time.process_time()
    if tp > 1:
        from lmfoundry.runtime.engine.ranks import ShardSpec, load_sharded

        model, tokenizer = load_sharded(ShardSpec.on(str(folder), run_dtype, tp, max(1, torch.get_num_threads() // tp),
                                                     device))
    else:
        model, tokenizer = load_model(folder, dtype=run_dtype, device=device)
    lm = RuntimeLM(model, tokenizer, add_bos=gate.add_bos, serving=True, deterministic=deterministic,
                   progress=progress)
    if lora is not None:
        from lmfoundry.runtime.engine.lora_adapters import attach_adapter

        # the engine's executor first: its serving swap (prepacked, fused q/k/v) is the model the adapter wraps
        attach_adapter(lm.engine().runner.executor, model.config, lora[1])
    data: dict[str, Any] = {"spec": spec, "path": str(folder), "fingerprint": fp, "dtype": str(model.dtype),
                            "execution": lm.execution(),
                            **({"lora": adapter} if adapter is not None else {}),
                            "prompt": {**lm.prompt_settings(), "chat_template": gate.chat_template,
                                       "num_fewshot": gate.num_fewshot},
                            "threads": torch.get_num_threads()}
    phases.mark("loaded")
    t1 = time.time()
    data["tasks"] = run_lm_eval(lm, tasks, gate, include_paths, progress=progress)
    phases.mark("tasks")
    t2 = time.time()
    recorder: ReferenceRecorder | None = None
    scorer: DivergenceScorer | None = None
    if ppl is not None:
        stream, source, digest = eval_token_stream(ppl.text, tokenizer)
        observe: Callable[[torch.Tensor, torch.Tensor], None]
        if reference is None:
            observe = recorder = ReferenceRecorder(ppl.top_k)
        else:
            observe = scorer = DivergenceScorer(reference)
        # one window at a time: its float32 logits over a 128k-152k vocabulary are a third of a GB
        res = perplexity(lm, stream, ctx=ppl.ctx, max_windows=ppl.windows, batch_size=PPL_BATCH, progress=progress,
                         observe=observe)
        used = stream[: res.windows * ppl.ctx]
        data["perplexity"] = {"source": source, "source_sha256": digest, "token_sha256": token_hash(used),
                              "ctx": ppl.ctx, "windows": res.windows, "ppl": res.ppl,
                              "window_nll": res.window_nll, "window_tokens": [ppl.ctx - 1] * res.windows}
        if scorer is not None:
            data["divergence"] = scorer.statistics().to_lists()
        phases.mark("perplexity")
    t3 = time.time()
    if gen is not None and prompts is not None:
        data["generation"] = generate(lm, prompts, gen.max_tokens)
        phases.mark("generation")
    data["seconds"] = {"load": round(t1 - t0, 2), "tasks": round(t2 - t1, 2), "perplexity": round(t3 - t2, 2),
                       "generation": round(time.time() - t3, 2),
                       "cpu": round(time.process_time() - cpu0, 2)}  # this process's CPU seconds, all threads
    if tp > 1:
        model.close()  # the worker ranks' CPU time is not in "cpu" above
    del model, lm
    gc.collect()  # the next model (an 8B candidate after its baseline) must find this one's memory free
    # glibc keeps freed heap pages mapped for reuse; the candidate's weights would then be counted
    # on top of the baseline's in resident memory even though the baseline is gone
    release_free_heap()
    phases.mark("freed")
    data["memory"] = phases.rows
    kept = None if recorder is None else recorder.reference()
    if use_cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
        entry = {**data, "cache_key": _key_digest(key)}
        if kept is not None:
            kept.save(ref_file)
            entry["reference_sha256"] = sha256_file(ref_file)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(entry))
        tmp.replace(cache)
    if kept is not None:
        data["reference"] = kept
    data["from_cache"] = None
    return data


# ---- the whole gate -------------------------------------------------------------------------
@dataclass
class GateResult:
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
    from lmfoundry.evals.gate_report import write_markdown, write_plot

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
        "versions": {**_versions(), "lm-eval": importlib.metadata.version("lm_eval")},
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
    from lmfoundry.runtime.loader import resolve_dtype

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
    from lmfoundry.checkpoint.lora_adapter import check_adapter
    from lmfoundry.runtime.bundle_manifest import read_manifest

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
    from lmfoundry.output_paths import refuse_overlap

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


def record_promotion(candidate: str, report: dict[str, Any], json_path: Path, md_path: Path) -> bool:
    """Write the verdict into the candidate's lmfoundry.json (`promotion`), if it has one."""
    from lmfoundry.manifest import MANIFEST, sha256_file, update_manifest
    from lmfoundry.runtime.bundle_manifest import MANIFEST_NAME

    folder = Path(report["candidate"]["path"])
    engine = folder / MANIFEST_NAME
    if not (folder / MANIFEST).exists() and not engine.is_file():
        return False
    record = {
        "verdict": report["verdict"],
        "exit_code": report["exit_code"],
        "gate": report["gate"]["name"], "gate_sha256": report["gate"]["sha256"], "tier": report["gate"]["tier"],
        "baseline": report["baseline"]["spec"], "baseline_sha256": report["baseline"]["sha256"],
        "candidate_sha256": report["candidate"]["sha256"],
        "failing": report["failing"],
        **({"lora": report["lora"]} if report.get("lora") else {}),
        # the report by name and hash: its folder is local (the manifest holds no local path)
        "report": json_path.name, "report_sha256": sha256_file(json_path),
        "markdown_sha256": sha256_file(md_path),
        "created_unix": int(time.time()),
    }
    if engine.is_file():  # an engine bundle: the verdict goes into engine.json (weights stay as hashed)
        data = json.loads(engine.read_text())
        data["promotion"] = record
        tmp = engine.with_name(f".engine.json.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, engine)
        return True
    update_manifest(folder, "promotion", record)
    return True
