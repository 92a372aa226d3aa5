"""eval-gate: score a candidate and its baseline on the same documents, decide with paired statistics.

Flow: load the gate spec (thresholds, tiers, pinned prompt settings) -> for each model: load it
with the runtime loader (the module tree the server runs), run the tier's lm-eval tasks through
`RuntimeLM`, and score perplexity windows of the held-out text -> pair the per-document results
and decide each gated metric (`lmfoundry.evals.stats`) -> one overall verdict.

Per-model results are cached under `<cache>/eval-gate/`, keyed by the sha256 of the model's
weights, config and tokenizer, the task files, the tier and prompt settings and the library
versions: gating five candidates against one baseline evaluates the baseline once. The cache only
skips recomputation of a deterministic function of those inputs; `--no-cache` recomputes.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lmfoundry.errors import UserError
from lmfoundry.evals import stats
from lmfoundry.evals.lm_adapter import parse_add_bos
from lmfoundry.resources import shipped

# Package data (shipped in the wheel; see lmfoundry.resources.shipped).
TASKS_DIR = shipped("lmfoundry.evals", "tasks")
GATES_DIR = shipped("lmfoundry.recipes", "gates")
DEFAULT_GATE = "default"
SCHEMA_VERSION = 1
PPL_METRICS = ("word_perplexity", "byte_perplexity")


# ---- gate spec ------------------------------------------------------------------------------
@dataclass
class TaskSpec:
    name: str
    limit: int | None
    gate: dict[str, float | None]  # metric -> threshold (None: the gate's default)


@dataclass
class PerplexitySpec:
    text: str | None
    ctx: int
    windows: int
    max_ratio: float


@dataclass
class GateSpec:
    name: str
    source: str
    sha256: str
    seed: int
    confidence: float
    resamples: int
    inconclusive_exit_code: int
    add_bos: str
    chat_template: bool
    num_fewshot: int
    min_recovery: float
    max_ppl_ratio: float
    tiers: dict[str, dict[str, Any]] = field(repr=False)

    def tier(self, name: str) -> tuple[list[TaskSpec], PerplexitySpec | None]:
        """The tasks and perplexity settings of tier `name` (every field type- and range-checked:
        a gate file is hand-written, and a wrong type must be one line naming the field)."""
        if name not in self.tiers:
            raise UserError(f"gate {self.name!r} has no tier {name!r}; tiers: {', '.join(map(str, self.tiers))}")
        where = f"{self.source}: tiers.{name}"
        raw = _mapping(self.tiers[name], where, ("description", "tasks", "perplexity"))
        tasks = []
        for task, body in _mapping(raw.get("tasks"), f"{where}.tasks").items():
            tw = f"{where}.tasks.{task}"
            if not isinstance(task, str):
                raise UserError(f"{tw}: a task name must be a string")
            body = _mapping(body, tw, ("limit", "gate"))
            gate = body.get("gate", [])
            if isinstance(gate, str):
                gate = [gate]
            if isinstance(gate, list):
                gate = {m: None for m in gate if _text(m, f"{tw}.gate")}
            if not isinstance(gate, dict):
                raise UserError(f"{tw}.gate must be a list of metrics or a mapping metric -> threshold")
            limit = body.get("limit")
            if limit is not None:
                limit = _int(limit, f"{tw}.limit", 1)
            thresholds = {_text(k, f"{tw}.gate"): None if v is None else _positive(v, f"{tw}.gate.{k}")
                          for k, v in gate.items()}
            tasks.append(TaskSpec(task, limit, thresholds))
        ppl = raw.get("perplexity")
        pspec = None
        if ppl:
            pw = f"{where}.perplexity"
            ppl = _mapping(ppl, pw, ("text", "ctx", "windows", "max_ratio"))
            text = ppl.get("text")
            if text is not None:
                text = _text(text, f"{pw}.text")
            max_ratio = ppl.get("max_ratio")
            pspec = PerplexitySpec(text, _int(ppl.get("ctx", 512), f"{pw}.ctx", 2),
                                   _int(ppl.get("windows", 20), f"{pw}.windows", 1),
                                   self.max_ppl_ratio if max_ratio is None else _positive(max_ratio, f"{pw}.max_ratio"))
        if not tasks and pspec is None:
            raise UserError(f"{self.source}: tier {name!r} has neither tasks nor perplexity")
        return tasks, pspec


# A gate file is hand-written YAML: every field is checked for type and range here, so that a
# string where a number belongs (or a list where a mapping belongs) is one `error:` line naming
# the field instead of a ValueError/AttributeError traceback, and so that a value that would only
# fail deep inside lm-eval or numpy (seed >= 2**32, a million resamples) is refused up front.
MAX_SEED = 2**32 - 1  # lm-eval seeds numpy's legacy generator, which takes 32-bit seeds
RESAMPLES_RANGE = (100, 100_000)  # fewer: a meaningless interval; more: GBs of bootstrap indices


def _show(value: Any) -> str:
    """A value for an error message: its repr, cut short (a YAML value can be a whole document)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _mapping(value: Any, where: str, known: tuple[str, ...] | None = None) -> dict[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"{where} must be a mapping, got {type(value).__name__} {_show(value)}")
    if known is not None:
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return value


def _int(value: Any, where: str, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{where} must be an integer, got {_show(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise UserError(f"{where} must be {bounds}, got {value}")
    return value


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"{where} must be a number, got {_show(value)}")
    return float(value)


def _positive(value: Any, where: str) -> float:
    number = _number(value, where)
    if number <= 0:
        raise UserError(f"{where} must be positive, got {_show(value)}")
    return number


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"{where} must be true or false, got {_show(value)}")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise UserError(f"{where} must be a non-empty string, got {_show(value)}")
    return value


def resolve_gate_path(spec: str | None) -> Path:
    spec = spec or DEFAULT_GATE
    p = Path(spec).expanduser()
    if p.exists():
        if not p.is_file():
            raise UserError(f"{spec}: not a gate file")
        return p
    builtin = GATES_DIR / f"{spec}.yaml"
    if builtin.exists():
        return builtin
    known = ", ".join(sorted(f.stem for f in GATES_DIR.glob("*.yaml")))
    raise UserError(f"{spec}: no such gate file (built-in gates: {known})")


MAX_GATE_BYTES = 1 << 20  # a gate file is a page of YAML


def load_gate(spec: str | None = None) -> GateSpec:
    """A gate YAML (or a recipe YAML whose `gate` section overrides the default gate), with every
    field and every tier checked before anything is evaluated."""
    path = resolve_gate_path(spec)
    if path.stat().st_size > MAX_GATE_BYTES:
        raise UserError(f"{path}: {path.stat().st_size} bytes is too large for a gate file")
    from lmfoundry.recipe import load_yaml

    raw_bytes = path.read_bytes()
    data = load_yaml(raw_bytes, path) or {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: a gate file is a mapping")
    if "gate" in data and "tiers" not in data:  # a recipe: its gate section overlays the default
        base = yaml.safe_load((GATES_DIR / f"{DEFAULT_GATE}.yaml").read_text())
        data = _overlay(base, _mapping(data["gate"], f"{path}: gate"))
    known = {"name", "description", "seed", "confidence", "resamples", "inconclusive_exit_code", "prompt",
             "defaults", "tiers"}
    unknown = set(data) - known
    if unknown:
        raise UserError(f"{path}: unknown gate key(s) {', '.join(sorted(map(str, unknown)))}; "
                        f"known: {', '.join(sorted(known))}")
    prompt = _mapping(data.get("prompt"), f"{path}: prompt", ("add_bos", "chat_template", "num_fewshot"))
    defaults = _mapping(data.get("defaults"), f"{path}: defaults", ("min_recovery", "max_ppl_ratio"))
    confidence = _number(data.get("confidence", 0.95), f"{path}: confidence")
    if not 0.5 <= confidence < 1:
        raise UserError(f"{path}: confidence must be in [0.5, 1)")
    code = _int(data.get("inconclusive_exit_code", 2), f"{path}: inconclusive_exit_code")
    if code not in (0, 1, 2):
        raise UserError(f"{path}: inconclusive_exit_code must be 0, 1 or 2")
    if not isinstance(data.get("tiers"), dict) or not data["tiers"]:
        raise UserError(f"{path}: a gate needs `tiers` (e.g. quick, full)")
    gate = GateSpec(
        name=str(data.get("name", path.stem)), source=str(path), sha256=hashlib.sha256(raw_bytes).hexdigest(),
        seed=_int(data.get("seed", 0), f"{path}: seed", 0, MAX_SEED), confidence=confidence,
        resamples=_int(data.get("resamples", 2000), f"{path}: resamples", *RESAMPLES_RANGE),
        inconclusive_exit_code=code, add_bos=parse_add_bos(prompt.get("add_bos", "tokenizer")),
        chat_template=_bool(prompt.get("chat_template", False), f"{path}: prompt.chat_template"),
        num_fewshot=_int(prompt.get("num_fewshot", 0), f"{path}: prompt.num_fewshot", 0),
        min_recovery=_positive(defaults.get("min_recovery", 0.95), f"{path}: defaults.min_recovery"),
        max_ppl_ratio=_positive(defaults.get("max_ppl_ratio", 1.05), f"{path}: defaults.max_ppl_ratio"),
        tiers=data["tiers"],
    )
    for tier in gate.tiers:  # a typo in a tier not run today is still an error today
        gate.tier(tier)
    return gate


def _overlay(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in top.items():
        out[k] = _overlay(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


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
                     "chat_template.jinja")
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
    `load_model` runs) is read from its weights/ folder."""
    from lmfoundry.models import resolve_model
    from lmfoundry.model.config import ModelConfig

    path = Path(spec).expanduser()
    bundle = allow_bundle and (path / "engine.json").is_file()
    folder = path / "weights" if bundle else resolve_model(spec)
    config = ModelConfig.from_file(folder)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... for a bad tokenizer
        first = (str(exc).strip().splitlines() or [""])[0]
        raise UserError(f"{spec}: cannot load its tokenizer ({type(exc).__name__}: {first})") from None
    return CheckedModel(spec, folder, config, tokenizer, bundle)


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
    from lmfoundry.manifest import sha256_file
    from lmfoundry.models import safetensors_files

    files = {p.relative_to(folder).as_posix(): sha256_file(p) for p in safetensors_files(folder)}
    for name in FINGERPRINT_FILES:
        if (folder / name).exists():
            files[name] = sha256_file(folder / name)
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return {"sha256": digest, "files": files}


def _versions() -> dict[str, str]:
    from lmfoundry.manifest import tool_versions

    return tool_versions()


def _cache_path(key: dict[str, Any]) -> Path:
    from lmfoundry.resources import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_dir() / "eval-gate" / f"{digest}.json"


def evaluate_model(spec: str, tasks: list[TaskSpec], ppl: PerplexitySpec | None, gate: GateSpec,
                   include_paths: list[Path], task_hashes: dict[str, str], use_cache: bool = True,
                   progress: bool = False, device: str = "cpu", dtype: str = "auto") -> dict[str, Any]:
    """Per-document results of one model on the tier (from the cache when the inputs match). An
    engine bundle runs its compiled kernels on `device` (what `serve` would run); a checkpoint runs
    in `dtype` (`auto`: what `serve` picks on this CPU)."""
    import torch

    from lmfoundry.models import resolve_model
    from lmfoundry.runtime.loader import is_engine_bundle, resolve_dtype

    bundle = is_engine_bundle(spec)
    run_dtype = resolve_dtype(dtype, spec, device)
    folder = Path(spec) if bundle else resolve_model(spec)
    fp = fingerprint(folder / "weights" if bundle else folder)
    key = {"schema": SCHEMA_VERSION, "model": fp["sha256"], "versions": _versions(),
           "tasks": [[t.name, t.limit, task_hashes.get(t.name)] for t in tasks],
           "ppl": None if ppl is None else [ppl.text, ppl.ctx, ppl.windows],
           "prompt": [gate.add_bos, gate.chat_template, gate.num_fewshot], "seed": gate.seed,
           "threads": torch.get_num_threads(), **({"device": device} if bundle else {}),
           **({"dtype": str(run_dtype)} if run_dtype is not None else {})}
    cache = _cache_path(key)
    if use_cache and cache.exists():
        try:
            data = json.loads(cache.read_text())
            # the cached numbers belong to these exact files, wherever they were found then
            data.update(spec=spec, path=str(folder), from_cache=str(cache))
            return data
        except json.JSONDecodeError:
            cache.unlink(missing_ok=True)

    from lmfoundry.calibration.data import eval_token_stream, token_hash
    from lmfoundry.evals.lm_adapter import RuntimeLM
    from lmfoundry.evals.perplexity import perplexity
    from lmfoundry.runtime.loader import load_model

    t0 = time.time()
    model, tokenizer = load_model(folder, dtype=run_dtype, device=device)
    lm = RuntimeLM(model, tokenizer, add_bos=gate.add_bos)
    data: dict[str, Any] = {"spec": spec, "path": str(folder), "fingerprint": fp, "dtype": str(model.dtype),
                            "prompt": {**lm.prompt_settings(), "chat_template": gate.chat_template,
                                       "num_fewshot": gate.num_fewshot},
                            "threads": torch.get_num_threads()}
    t1 = time.time()
    data["tasks"] = run_lm_eval(lm, tasks, gate, include_paths, progress=progress)
    t2 = time.time()
    if ppl is not None:
        stream, source, digest = eval_token_stream(ppl.text, tokenizer)
        res = perplexity(model, stream, ctx=ppl.ctx, max_windows=ppl.windows, progress=progress)
        used = stream[: res.windows * ppl.ctx]
        data["perplexity"] = {"source": source, "source_sha256": digest, "token_sha256": token_hash(used),
                              "ctx": ppl.ctx, "windows": res.windows, "ppl": res.ppl,
                              "window_nll": res.window_nll, "window_tokens": [ppl.ctx - 1] * res.windows}
    data["seconds"] = {"load": round(t1 - t0, 2), "tasks": round(t2 - t1, 2), "perplexity": round(time.time() - t2, 2)}
    del model, lm
    if use_cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(cache)
    data["from_cache"] = None
    return data


# ---- comparison -----------------------------------------------------------------------------
def compare(cand: dict[str, Any], base: dict[str, Any], tasks: list[TaskSpec], ppl: PerplexitySpec | None,
            gate: GateSpec) -> list[dict[str, Any]]:
    """One record per metric: gated metrics carry interval, threshold and verdict; the others
    carry both models' values for the report."""
    rows = []
    for i, t in enumerate(tasks):
        c, b = cand["tasks"][t.name], base["tasks"][t.name]
        if c["doc_ids"] != b["doc_ids"] or c["doc_hashes"] != b["doc_hashes"]:
            raise UserError(f"{t.name}: candidate and baseline were scored on different documents")
        unknown = set(t.gate) - set(c["metrics"])
        if unknown:
            raise UserError(f"{t.name}: gated metric(s) {', '.join(sorted(unknown))} not produced by the task "
                            f"(it reports {', '.join(sorted(c['metrics']))})")
        for m in sorted(c["metrics"]):
            cv, bv = c["metrics"][m], b["metrics"][m]
            name = f"{t.name}/{m}"
            seed = gate.seed + 1000 * (i + 1)
            is_ppl = m.split(",")[0] in PPL_METRICS
            if m not in t.gate:
                rows.append({"name": name, "gated": False, "n": len(cv), **_plain_values(m, cv, bv)})
                continue
            threshold = t.gate[m]
            if is_ppl:
                comp = stats.paired_perplexity([-x[0] for x in cv], [-x[0] for x in bv], [x[1] for x in cv],
                                               threshold or gate.max_ppl_ratio, gate.confidence, gate.resamples, seed)
            elif c["higher_is_better"].get(m.split(",")[0], True) and all(isinstance(x, float) for x in cv):
                comp = stats.paired_accuracy(cv, bv, threshold or gate.min_recovery, gate.confidence,
                                             gate.resamples, seed)
            else:
                raise UserError(f"{name}: only higher-is-better per-document scores and "
                                f"{'/'.join(PPL_METRICS)} can be gated")
            rows.append({"name": name, "gated": True, **comp.to_dict()})
    if ppl is not None:
        cp, bp = cand["perplexity"], base["perplexity"]
        if cp["token_sha256"] != bp["token_sha256"]:
            raise UserError("candidate and baseline tokenize the perplexity text differently; "
                            "perplexities are not comparable (different tokenizers?)")
        comp = stats.paired_perplexity(cp["window_nll"], bp["window_nll"], cp["window_tokens"], ppl.max_ratio,
                                       gate.confidence, gate.resamples, gate.seed)
        rows.append({"name": f"perplexity/{ppl.text or 'wiki-tail'}@{ppl.ctx}", "gated": True, **comp.to_dict()})
    return rows


def _plain_values(metric: str, cv: list[Any], bv: list[Any]) -> dict[str, float]:
    import math

    if metric.split(",")[0] in PPL_METRICS:
        val = lambda v: math.exp(-sum(x[0] for x in v) / sum(x[1] for x in v))  # noqa: E731
    elif all(isinstance(x, float) for x in cv + bv):
        val = lambda v: sum(v) / len(v)  # noqa: E731
    else:
        return {}
    return {"candidate": val(cv), "baseline": val(bv)}


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
             dtype: str = "auto") -> GateResult:
    """Evaluate, compare, write eval-gate.json + eval-gate.md + eval-gate.png, record the verdict."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lmfoundry.evals.report import write_markdown, write_plot

    gate = load_gate(gate_spec)
    tasks, ppl = gate.tier(tier)
    for name in extra_tasks:
        if name not in {t.name for t in tasks}:
            tasks.append(TaskSpec(name, None, {}))
    user_paths = [Path(p).expanduser().resolve() for p in include_paths]
    for p in user_paths:
        if not p.is_dir():
            raise UserError(f"--include-path {p}: not a folder")
    out = Path(output)
    _check_output_folder(out)
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
    del cand_model, base_model
    with tempfile.TemporaryDirectory(prefix="lmfoundry-gate-") as tmp:
        ours, task_hashes = materialize_tasks(Path(tmp))
        paths = [ours, *user_paths]
        base = evaluate_model(baseline, tasks, ppl, gate, paths, task_hashes, use_cache, progress, device, dtype)
        cand = evaluate_model(candidate, tasks, ppl, gate, paths, task_hashes, use_cache, progress, device, dtype)
    metrics = compare(cand, base, tasks, ppl, gate)
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
                 "defaults": {"min_recovery": gate.min_recovery, "max_ppl_ratio": gate.max_ppl_ratio}},
        "prompt": {"add_bos": gate.add_bos, "chat_template": gate.chat_template, "num_fewshot": gate.num_fewshot},
        "metrics": metrics,
        "candidate": _model_summary(cand),
        "baseline": _model_summary(base),
        "tasks": {t.name: {"limit": t.limit, "n_docs": cand["tasks"][t.name]["n_docs"],
                           "sha256": task_hashes.get(t.name, "user task")} for t in tasks},
        "perplexity_text": None if ppl is None else {k: cand["perplexity"][k] for k in
                                                     ("source", "source_sha256", "token_sha256", "ctx", "windows")},
        "versions": {**_versions(), "lm-eval": importlib.metadata.version("lm_eval")},
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


def _check_output_folder(out: Path) -> None:
    """Refuse an -o that cannot take the report before evaluating anything, without creating it
    yet (a refused or failed gate leaves no empty report folder behind)."""
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
            "files": ev["fingerprint"]["files"], "dtype": ev["dtype"], "prompt": ev["prompt"],
            "threads": ev["threads"], "seconds": ev["seconds"], "from_cache": ev.get("from_cache")}


def record_promotion(candidate: str, report: dict[str, Any], json_path: Path, md_path: Path) -> bool:
    """Write the verdict into the candidate's lmfoundry.json (`promotion`), if it has one."""
    from lmfoundry.manifest import MANIFEST, sha256_file, update_manifest

    folder = Path(report["candidate"]["path"])
    engine = folder / "engine.json"
    if not (folder / MANIFEST).exists() and not engine.is_file():
        return False
    record = {
        "verdict": report["verdict"],
        "exit_code": report["exit_code"],
        "gate": report["gate"]["name"], "gate_sha256": report["gate"]["sha256"], "tier": report["gate"]["tier"],
        "baseline": report["baseline"]["spec"], "baseline_sha256": report["baseline"]["sha256"],
        "candidate_sha256": report["candidate"]["sha256"],
        "failing": report["failing"],
        "report": str(json_path.resolve()), "report_sha256": sha256_file(json_path),
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
