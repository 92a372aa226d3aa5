"""eval-gate's comparison: the candidate's results against the baseline's, one record per statistic.

Every record pairs the two models on the same units (documents, perplexity windows, prompts), so
the bootstrap resamples units, not models. Gated records carry an interval, a threshold and a
verdict; reported ones carry the values (and, where one exists, the interval) for the reader.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from lmfoundry.errors import UserError
from lmfoundry.evals import generation, stats
from lmfoundry.evals.divergence import TokenStatistics
from lmfoundry.evals.gate_spec import GateSpec, PerplexitySpec, TaskSpec, Tier

PPL_METRICS = ("word_perplexity", "byte_perplexity")
FLIPS = "_flips"  # `acc_flips` in a task's gate: the share of documents whose `acc` changed

# The per-token statistics: name, the values they reduce, the reduction, the threshold's key (or
# None: reported only), higher is better, the value a copy of the baseline scores.
DIVERGENCE_ROWS: tuple[tuple[str, str, Callable[[np.ndarray], np.ndarray], str | None, bool, float], ...] = (
    ("mean_kld", "kld", stats.mean_of, "max_mean_kld", False, 0.0),
    ("median_kld", "kld", stats.quantile_of(0.5), None, False, 0.0),
    ("p99_kld", "kld", stats.quantile_of(0.99), "max_p99_kld", False, 0.0),
    ("max_kld", "kld", stats.max_of, None, False, 0.0),
    ("same_top", "same_top", stats.mean_of, "min_same_top", True, 1.0),
    ("rms_dp", "delta_p", stats.rms_of, "max_rms_dp", False, 0.0),
)


def _record(name: str, comp: stats.Comparison) -> dict[str, Any]:
    return {"name": name, "gated": comp.threshold is not None, **comp.to_dict()}


def compare(cand: dict[str, Any], base: dict[str, Any], tier: Tier, gate: GateSpec,
            prompts: list[generation.Prompt]) -> list[dict[str, Any]]:
    """One record per statistic of the tier, in the order: tasks, perplexity, divergence, generation
    (`prompts`: the tier's generation prompts, read once by the caller)."""
    rows: list[dict[str, Any]] = []
    for i, t in enumerate(tier.tasks):
        rows += _task_rows(cand["tasks"][t.name], base["tasks"][t.name], t, gate, gate.seed + 1000 * (i + 1))
    ppl = tier.perplexity
    if ppl is not None:
        rows += _perplexity_rows(cand, base, ppl, gate)
    if tier.generation is not None:
        comps = generation.compare(cand["generation"], base["generation"], prompts,
                                   generation.GenerationThresholds(**tier.generation.limits),
                                   gate.confidence, gate.resamples, gate.seed + 7)
        rows += [_record(f"generation/{c.statistic}", c) for c in comps]
    return rows


def _task_rows(c: dict[str, Any], b: dict[str, Any], t: TaskSpec, gate: GateSpec, seed: int) -> list[dict[str, Any]]:
    if c["doc_ids"] != b["doc_ids"] or c["doc_hashes"] != b["doc_hashes"]:
        raise UserError(f"{t.name}: candidate and baseline were scored on different documents")
    flips = {m[: -len(FLIPS)]: thr for m, thr in t.gate.items() if m.endswith(FLIPS)}
    unknown = (set(t.gate) - set(m + FLIPS for m in flips) | set(flips)) - set(c["metrics"])
    if unknown:
        raise UserError(f"{t.name}: gated metric(s) {', '.join(sorted(unknown))} not produced by the task "
                        f"(it reports {', '.join(sorted(c['metrics']))})")
    rows = []
    for m in sorted(c["metrics"]):
        cv, bv = c["metrics"][m], b["metrics"][m]
        name = f"{t.name}/{m}"
        is_ppl = m.split(",")[0] in PPL_METRICS
        binary = all(isinstance(x, float) and x in (0.0, 1.0) for x in cv + bv)
        if m not in t.gate:
            rows.append({"name": name, "gated": False, "n": len(cv), **_plain_values(m, cv, bv)})
        else:
            threshold = t.gate[m]
            if is_ppl:
                comp = stats.paired_perplexity([-x[0] for x in cv], [-x[0] for x in bv], [x[1] for x in cv],
                                               threshold or gate.max_ppl_ratio, gate.confidence, gate.resamples,
                                               seed)
            elif c["higher_is_better"].get(m.split(",")[0], True) and all(isinstance(x, float) for x in cv):
                comp = stats.paired_accuracy(cv, bv, threshold or gate.min_recovery, gate.confidence,
                                             gate.resamples, seed)
            else:
                raise UserError(f"{name}: only higher-is-better per-document scores and "
                                f"{'/'.join(PPL_METRICS)} can be gated")
            rows.append(_record(name, comp))
        if m in flips and not binary:
            raise UserError(f"{t.name}: {m}{FLIPS}: {m} is not a right/wrong score per document")
        if binary:  # right->wrong and wrong->right beside every 0/1 score, gated where asked
            limit = None
            if m in flips:
                limit = gate.max_flip_rate if flips[m] is None else flips[m]
            if m in flips and limit is None:
                raise UserError(f"{t.name}: {m}{FLIPS} needs a threshold (in the task's gate or defaults.max_flip_rate)")
            rows.append(_record(name + FLIPS, stats.flip_rate(cv, bv, limit, gate.confidence, gate.resamples,
                                                              seed + 1)))
    return rows


def _perplexity_rows(cand: dict[str, Any], base: dict[str, Any], ppl: PerplexitySpec,
                     gate: GateSpec) -> list[dict[str, Any]]:
    cp, bp = cand["perplexity"], base["perplexity"]
    if cp["token_sha256"] != bp["token_sha256"]:
        raise UserError("candidate and baseline tokenize the perplexity text differently; "
                        "perplexities are not comparable (different tokenizers?)")
    comp = stats.paired_perplexity(cp["window_nll"], bp["window_nll"], cp["window_tokens"], ppl.max_ratio,
                                   gate.confidence, gate.resamples, gate.seed)
    text = f"{ppl.text or 'wiki-tail'}@{ppl.ctx}"
    rows = [_record(f"perplexity/{text}", comp)]
    tokens = TokenStatistics.from_lists(cand["divergence"])
    for i, (name, field, reduce, key, higher, ideal) in enumerate(DIVERGENCE_ROWS):
        comp = stats.window_statistic(name, getattr(tokens, field).astype(np.float64), reduce,
                                      None if key is None else ppl.limits[key], higher, ideal, gate.confidence,
                                      gate.resamples, gate.seed + 100 + i)
        if name == "mean_kld":  # how much of the vocabulary the KL was coarsened over
            comp.extra.update(top_k=ppl.top_k, mean_rest_mass=float(tokens.rest_mass.mean()))
        rows.append(_record(f"divergence/{name}", comp))
    return rows


def _plain_values(metric: str, cv: list[Any], bv: list[Any]) -> dict[str, float]:
    if metric.split(",")[0] in PPL_METRICS:
        val = lambda v: math.exp(-sum(x[0] for x in v) / sum(x[1] for x in v))  # noqa: E731
    elif all(isinstance(x, float) for x in cv + bv):
        val = lambda v: sum(v) / len(v)  # noqa: E731
    else:
        return {}
    return {"candidate": val(cv), "baseline": val(bv)}
