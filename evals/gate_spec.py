"""The gate file: what eval-gate measures and the bar each statistic must clear.

A gate is hand-written YAML (or a recipe's `gate` section laid over the default gate). Every
field is checked for type and range here, so that a string where a number belongs (or a list
where a mapping belongs) is one `error:` line naming the field instead of a traceback deep inside
lm-eval or numpy, and so that a value that would only fail later (a seed beyond 32 bits, a
million resamples) is refused before minutes of evaluation.
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lmfoundry.errors import UserError
from lmfoundry.evals.divergence import DEFAULT_TOP_K
from lmfoundry.evals.lm_adapter import parse_add_bos
from lmfoundry.resources import shipped

GATES_DIR = shipped("lmfoundry.recipes", "gates")
DEFAULT_GATE = "default"


# ---- gate spec ------------------------------------------------------------------------------
@dataclass
class TaskSpec:
    name: str
    limit: int | None
    gate: dict[str, float | None]  # metric -> threshold (None: the gate's default)


# The per-token statistics on the perplexity windows (evals/divergence.py): name -> (how the
# threshold reads, key in `defaults` and in a tier's `perplexity`). A None threshold reports the
# statistic with its interval without gating it.
DIVERGENCE_LIMITS = ("max_mean_kld", "max_p99_kld", "min_same_top", "max_rms_dp")
GENERATION_LIMITS = ("min_exact_match", "min_prefix_match", "min_valid_recovery")
# Thresholds that are shares of tokens, documents or answers: a value above 1 can never be met
# (a minimum) or never be missed (a maximum), so it is a typo, refused. Recoveries and ratios
# (candidate / baseline) may exceed 1.
RATES = ("max_flip_rate", "min_same_top", "max_rms_dp", "min_exact_match", "min_prefix_match")


@dataclass
class PerplexitySpec:
    text: str | None
    ctx: int
    windows: int
    max_ratio: float
    top_k: int  # the baseline reference's tokens per position (KL over these plus one rest bucket)
    limits: dict[str, float | None]  # DIVERGENCE_LIMITS -> threshold (None: reported only)


@dataclass
class GenerationSpec:
    prompts: str | None  # a prompt YAML (None: the shipped set)
    max_tokens: int
    limits: dict[str, float | None]  # GENERATION_LIMITS -> threshold (None: reported only)


@dataclass
class Tier:
    name: str
    tasks: list[TaskSpec]
    perplexity: PerplexitySpec | None
    generation: GenerationSpec | None


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
    max_flip_rate: float | None  # default of a task's `<metric>_flips` threshold
    limits: dict[str, float | None]  # defaults of DIVERGENCE_LIMITS and GENERATION_LIMITS
    tiers: dict[str, dict[str, Any]] = field(repr=False)

    def tier(self, name: str) -> Tier:
        """The tasks, perplexity and generation settings of tier `name` (every field type- and
        range-checked: a gate file is hand-written, and a wrong type must be one line naming the
        field)."""
        if name not in self.tiers:
            raise UserError(f"gate {self.name!r} has no tier {name!r}; tiers: {', '.join(map(str, self.tiers))}")
        where = f"{self.source}: tiers.{name}"
        raw = _mapping(self.tiers[name], where, ("description", "tasks", "perplexity", "generation"))
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
            thresholds = {_text(k, f"{tw}.gate"): None if v is None else _threshold(k, v, f"{tw}.gate.{k}")
                          for k, v in gate.items()}
            tasks.append(TaskSpec(task, limit, thresholds))
        pspec = self._perplexity(raw.get("perplexity"), f"{where}.perplexity")
        gspec = self._generation(raw.get("generation"), f"{where}.generation")
        if not tasks and pspec is None and gspec is None:
            raise UserError(f"{self.source}: tier {name!r} has no tasks, perplexity or generation")
        return Tier(name, tasks, pspec, gspec)

    def _limits(self, raw: dict[Any, Any], names: tuple[str, ...], where: str) -> dict[str, float | None]:
        """Thresholds of `names`: the tier's value where given (null: reported only), else the
        gate's default."""
        return {n: (None if raw[n] is None else _threshold(n, raw[n], f"{where}.{n}")) if n in raw else self.limits[n]
                for n in names}

    def _perplexity(self, raw: Any, where: str) -> PerplexitySpec | None:
        if not raw:
            return None
        ppl = _mapping(raw, where, ("text", "ctx", "windows", "max_ratio", "top_k", *DIVERGENCE_LIMITS))
        text = ppl.get("text")
        if text is not None:
            text = _text(text, f"{where}.text")
        max_ratio = ppl.get("max_ratio")
        return PerplexitySpec(text, _int(ppl.get("ctx", 512), f"{where}.ctx", 2),
                              _int(ppl.get("windows", 20), f"{where}.windows", 1),
                              self.max_ppl_ratio if max_ratio is None else _positive(max_ratio, f"{where}.max_ratio"),
                              _int(ppl.get("top_k", DEFAULT_TOP_K), f"{where}.top_k", 1, MAX_TOP_K),
                              self._limits(ppl, DIVERGENCE_LIMITS, where))

    def _generation(self, raw: Any, where: str) -> GenerationSpec | None:
        if not raw:
            return None
        gen = _mapping(raw, where, ("prompts", "max_tokens", *GENERATION_LIMITS))
        prompts = gen.get("prompts")
        if prompts is not None:
            prompts = _text(prompts, f"{where}.prompts")
        return GenerationSpec(prompts, _int(gen.get("max_tokens", 48), f"{where}.max_tokens", 1, 4096),
                              self._limits(gen, GENERATION_LIMITS, where))


# A gate file is hand-written YAML: every field is checked for type and range here, so that a
# string where a number belongs (or a list where a mapping belongs) is one `error:` line naming
# the field instead of a ValueError/AttributeError traceback, and so that a value that would only
# fail deep inside lm-eval or numpy (seed >= 2**32, a million resamples) is refused up front.
MAX_TOP_K = 4096  # the reference holds windows x positions x top_k entries
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


def _threshold(name: str, value: Any, where: str) -> float:
    """A gate threshold: positive, and at most 1 for a rate (RATES, a task's `<metric>_flips`)."""
    number = _positive(value, where)
    if (name in RATES or name.endswith("_flips")) and number > 1:
        raise UserError(f"{where} is a rate (a share between 0 and 1), got {_show(value)}")
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
    defaults = _mapping(data.get("defaults"), f"{path}: defaults",
                        ("min_recovery", "max_ppl_ratio", "max_flip_rate", *DIVERGENCE_LIMITS, *GENERATION_LIMITS))
    # a statistic without a default threshold is reported with its interval, not gated
    optional = {n: None if defaults.get(n) is None else _threshold(n, defaults[n], f"{path}: defaults.{n}")
                for n in ("max_flip_rate", *DIVERGENCE_LIMITS, *GENERATION_LIMITS)}
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
        max_flip_rate=optional.pop("max_flip_rate"), limits=optional, tiers=data["tiers"],
    )
    for tier in gate.tiers:  # a typo in a tier not run today is still an error today
        gate.tier(tier)
    return gate


def _overlay(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in top.items():
        out[k] = _overlay(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
