"""Paired statistics for candidate-vs-baseline decisions.

Both models are scored on the same documents, so each document contributes a *pair*; resampling
documents (not the two models independently) keeps the large document-to-document variance out of
the comparison, which is why a few hundred questions can certify a small accuracy drop.

- Accuracy: recovery = acc(candidate) / acc(baseline), paired bootstrap percentile interval.
  The discordant counts (McNemar's b and c) are reported alongside.
- Perplexity: ratio = exp((NLL_c - NLL_b) / tokens), token-weighted, bootstrap over documents
  (windows).

Decision for a threshold T on a statistic where higher is better (recovery >= T):
fail when the whole interval is below T, pass when the whole interval is at or above T,
inconclusive otherwise, with an estimate of how many documents would make the interval exclude T
(the half-width scales as 1/sqrt(n)). Everything is a deterministic function of the inputs and the
seed (numpy's PCG64).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


@dataclass
class Comparison:
    """One gated statistic: point estimate, interval, threshold and verdict."""

    statistic: str  # "recovery" or "ppl_ratio"
    n: int
    candidate: float  # candidate's metric value (accuracy or perplexity)
    baseline: float
    point: float  # the statistic (recovery or ratio)
    low: float
    high: float
    threshold: float | None  # None: reported with its interval, not gated
    higher_is_better: bool
    verdict: str
    samples_needed: int | None  # for inconclusive: documents that would decide it (None: cannot)
    confidence: float
    resamples: int
    extra: dict

    def to_dict(self) -> dict:
        return asdict(self)


def _rng(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


def bootstrap_indices(n: int, resamples: int, seed: int) -> np.ndarray:
    """[resamples, n] document indices drawn with replacement."""
    return _rng(seed).integers(0, n, size=(resamples, n))


def percentile_interval(values: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(values, [alpha, 1.0 - alpha], method="linear")
    return float(lo), float(hi)


def decide(point: float, low: float, high: float, threshold: float, higher_is_better: bool,
           n: int) -> tuple[str, int | None]:
    """Verdict from an interval, and (if inconclusive) the documents needed to decide.

    The needed size assumes the interval keeps its centre and shrinks as 1/sqrt(n): the side
    facing the threshold must shrink to the distance between point and threshold."""
    if higher_is_better:
        if high < threshold:
            return FAIL, None
        if low >= threshold:
            return PASS, None
        half = (point - low) if point >= threshold else (high - point)
    else:
        if low > threshold:
            return FAIL, None
        if high <= threshold:
            return PASS, None
        half = (high - point) if point <= threshold else (point - low)
    gap = abs(point - threshold)
    if gap <= 1e-12 or half <= 0:
        return INCONCLUSIVE, None
    return INCONCLUSIVE, int(math.ceil(n * (half / gap) ** 2))


def paired_accuracy(candidate: Sequence[float], baseline: Sequence[float], min_recovery: float,
                    confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> Comparison:
    """Recovery of a per-document 0/1 (or [0, 1]) score, with a paired bootstrap interval."""
    c = np.asarray(candidate, dtype=np.float64)
    b = np.asarray(baseline, dtype=np.float64)
    if c.shape != b.shape or c.ndim != 1 or c.size == 0:
        raise ValueError("paired accuracy needs two equal-length, non-empty per-document lists")
    n = c.size
    idx = bootstrap_indices(n, resamples, seed)
    cs, bs = c[idx].sum(1), b[idx].sum(1)
    # a resample where the baseline scored nothing: recovery is 1 if the candidate also scored
    # nothing, else unbounded; both are handled without division warnings
    rec = np.where(bs > 0, cs / np.where(bs > 0, bs, 1.0), np.where(cs > 0, np.inf, 1.0))
    diffs = (cs - bs) / n
    point = float(c.sum() / b.sum()) if b.sum() > 0 else (1.0 if c.sum() == 0 else math.inf)
    low, high = percentile_interval(rec, confidence)
    dlow, dhigh = percentile_interval(diffs, confidence)
    verdict, needed = decide(point, low, high, min_recovery, True, n)
    both = (c > 0.5) & (b > 0.5)
    extra = {
        "difference": float(c.mean() - b.mean()), "difference_low": dlow, "difference_high": dhigh,
        "candidate_only_correct": int(((c > 0.5) & ~(b > 0.5)).sum()),
        "baseline_only_correct": int((~(c > 0.5) & (b > 0.5)).sum()),
        "both_correct": int(both.sum()),
        "mcnemar_p": mcnemar_exact_p(int(((c > 0.5) & ~(b > 0.5)).sum()), int((~(c > 0.5) & (b > 0.5)).sum())),
    }
    return Comparison("recovery", n, float(c.mean()), float(b.mean()), point, low, high, min_recovery,
                      True, verdict, needed, confidence, resamples, extra)


def paired_perplexity(candidate_nll: Sequence[float], baseline_nll: Sequence[float], tokens: Sequence[float],
                      max_ratio: float, confidence: float = 0.95, resamples: int = 2000,
                      seed: int = 0) -> Comparison:
    """Perplexity ratio candidate/baseline from per-document summed NLLs (nats) and token counts,
    token-weighted, with a bootstrap interval over documents."""
    c = np.asarray(candidate_nll, dtype=np.float64)
    b = np.asarray(baseline_nll, dtype=np.float64)
    t = np.asarray(tokens, dtype=np.float64)
    if not (c.shape == b.shape == t.shape) or c.ndim != 1 or c.size == 0 or (t <= 0).any():
        raise ValueError("paired perplexity needs equal-length per-document NLLs and positive token counts")
    n = c.size
    idx = bootstrap_indices(n, resamples, seed)
    ratios = np.exp((c[idx].sum(1) - b[idx].sum(1)) / t[idx].sum(1))
    point = float(math.exp((c.sum() - b.sum()) / t.sum()))
    low, high = percentile_interval(ratios, confidence)
    verdict, needed = decide(point, low, high, max_ratio, False, n)
    extra = {"tokens": int(t.sum()),
             "documents_worse": int((c > b).sum()), "documents_better": int((c < b).sum())}
    return Comparison("ppl_ratio", n, float(math.exp(c.sum() / t.sum())), float(math.exp(b.sum() / t.sum())),
                      point, low, high, max_ratio, False, verdict, needed, confidence, resamples, extra)


REPORTED = "reported"


def window_statistic(statistic: str, values: np.ndarray, reduce: Callable[[np.ndarray], np.ndarray],
                     threshold: float | None, higher_is_better: bool, reference: float,
                     confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> Comparison:
    """A statistic of per-token values [windows, positions] (mean KLD, its p99, the same-top
    rate, ...), with a bootstrap interval that resamples whole windows: tokens of one window are
    correlated, windows are not. `reduce` maps [resamples, tokens] to [resamples]; `reference`
    is the statistic's value for a candidate identical to its baseline (0 for KLD, 1 for the
    same-top rate). A None threshold reports the statistic without gating it."""
    if values.ndim != 2 or values.size == 0:
        raise ValueError("a window statistic needs a non-empty [windows, positions] array")
    n = values.shape[0]
    point = float(reduce(values.reshape(1, -1))[0])
    idx = bootstrap_indices(n, resamples, seed)
    boot = np.concatenate([reduce(values[chunk].reshape(len(chunk), -1))
                           for chunk in np.array_split(idx, max(1, resamples // 200))])
    low, high = percentile_interval(boot, confidence)
    verdict, needed = (REPORTED, None) if threshold is None else decide(point, low, high, threshold,
                                                                          higher_is_better, n)
    return Comparison(statistic, n, point, reference, point, low, high, threshold, higher_is_better, verdict,
                      needed, confidence, resamples, {"tokens": int(values.size)})


def mean_of(values: np.ndarray) -> np.ndarray:
    return values.mean(axis=1)


def quantile_of(q: float) -> Callable[[np.ndarray], np.ndarray]:
    return lambda values: np.quantile(values, q, axis=1)


def max_of(values: np.ndarray) -> np.ndarray:
    return values.max(axis=1)


def rms_of(values: np.ndarray) -> np.ndarray:
    return np.sqrt((values ** 2).mean(axis=1))


def flip_rate(candidate: Sequence[float], baseline: Sequence[float], max_rate: float | None,
              confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> Comparison:
    """The share of documents whose 0/1 score differs between the two models. Accuracy hides
    flips when right->wrong and wrong->right cancel; the flip rate does not."""
    c = np.asarray(candidate, dtype=np.float64) > 0.5
    b = np.asarray(baseline, dtype=np.float64) > 0.5
    if c.shape != b.shape or c.ndim != 1 or c.size == 0:
        raise ValueError("a flip rate needs two equal-length, non-empty per-document lists")
    comp = window_statistic("flip_rate", (c != b).astype(np.float64)[:, None], mean_of, max_rate, False, 0.0,
                            confidence, resamples, seed)
    comp.extra = {"right_to_wrong": int((b & ~c).sum()), "wrong_to_right": int((c & ~b).sum())}
    return comp


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: binomial test of b successes in b + c trials at 1/2."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return float(min(1.0, 2.0 * tail))


def combine(verdicts: Sequence[str]) -> str:
    """Overall verdict: any fail fails; else any inconclusive is inconclusive; else pass."""
    if FAIL in verdicts:
        return FAIL
    if INCONCLUSIVE in verdicts:
        return INCONCLUSIVE
    return PASS
