"""Paired statistics: intervals against analytic approximations, decisions, determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lmfoundry.evals.stats import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    REPORTED,
    combine,
    decide,
    flip_rate,
    max_of,
    mcnemar_exact_p,
    mean_of,
    paired_accuracy,
    paired_perplexity,
    quantile_of,
    rms_of,
    window_statistic,
)


def _pair(n: int, acc_b: float, flips_down: int, flips_up: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    b = (rng.random(n) < acc_b).astype(float)
    c = b.copy()
    right, wrong = np.flatnonzero(b == 1), np.flatnonzero(b == 0)
    c[right[:flips_down]] = 0
    c[wrong[:flips_up]] = 1
    return c, b


def test_identical_models_pass_with_a_point_interval():
    c, b = _pair(200, 0.5, 0, 0)
    r = paired_accuracy(c, b, 0.95)
    assert (r.point, r.low, r.high, r.verdict) == (1.0, 1.0, 1.0, PASS)
    assert r.extra["mcnemar_p"] == 1.0
    p = paired_perplexity([10.0, 12.0], [10.0, 12.0], [5, 6], 1.05)
    assert (p.point, p.low, p.high, p.verdict) == (1.0, 1.0, 1.0, PASS)


def test_difference_interval_matches_the_normal_approximation():
    """For large n the paired bootstrap interval of the mean difference approaches
    d +- z * sd(d_i) / sqrt(n)."""
    c, b = _pair(4000, 0.5, 300, 200)
    r = paired_accuracy(c, b, 0.95, resamples=4000, seed=1)
    d = c - b
    se = d.std(ddof=1) / math.sqrt(d.size)
    assert r.extra["difference"] == pytest.approx(d.mean())
    # Monte-Carlo error of a 2.5% quantile from 4000 resamples is about 4% of the half-width
    assert r.extra["difference_low"] == pytest.approx(d.mean() - 1.96 * se, abs=0.12 * 1.96 * se)
    assert r.extra["difference_high"] == pytest.approx(d.mean() + 1.96 * se, abs=0.12 * 1.96 * se)
    # recovery point estimate is the ratio of accuracies
    assert r.point == pytest.approx(c.sum() / b.sum())
    assert r.extra["baseline_only_correct"] == 300 and r.extra["candidate_only_correct"] == 200


def test_clear_regression_fails_and_small_one_is_inconclusive_with_a_useful_size():
    c, b = _pair(300, 0.6, 90, 0)  # candidate loses half of the right answers: recovery 0.5
    assert paired_accuracy(c, b, 0.95).verdict == FAIL
    c, b = _pair(60, 0.6, 5, 2)  # recovery ~0.92 on 60 documents: too few to tell
    r = paired_accuracy(c, b, 0.95, seed=3)
    assert r.verdict == INCONCLUSIVE and r.samples_needed is not None and r.samples_needed > 60
    # with that many documents of the same kind (the data repeated), the verdict is decided
    k = math.ceil(r.samples_needed * 1.3 / 60)
    big = paired_accuracy(np.tile(c, k), np.tile(b, k), 0.95, seed=3)
    assert big.verdict in (PASS, FAIL)


def test_decide_rules_on_both_directions():
    assert decide(0.99, 0.97, 1.01, 0.95, True, 100) == (PASS, None)
    assert decide(0.90, 0.85, 0.94, 0.95, True, 100) == (FAIL, None)
    verdict, need = decide(0.97, 0.93, 1.01, 0.95, True, 100)  # lower side 0.04 wide, gap 0.02
    assert verdict == INCONCLUSIVE and need == 400
    assert decide(1.02, 1.01, 1.04, 1.05, False, 20) == (PASS, None)
    assert decide(1.20, 1.10, 1.30, 1.05, False, 20) == (FAIL, None)
    verdict, need = decide(1.04, 1.02, 1.06, 1.05, False, 20)  # upper side 0.02, gap 0.01
    assert verdict == INCONCLUSIVE and need == 80
    assert decide(1.05, 1.0, 1.1, 1.05, False, 20) == (INCONCLUSIVE, None)


def test_perplexity_ratio_point_and_interval():
    rng = np.random.default_rng(0)
    tokens = np.full(40, 511.0)
    base = rng.normal(3.0, 0.3, 40) * tokens
    cand = base + 0.1 * tokens + rng.normal(0, 2.0, 40)  # +0.1 nats/token: ratio ~ e^0.1
    r = paired_perplexity(cand, base, tokens, 1.05)
    assert r.point == pytest.approx(math.exp((cand.sum() - base.sum()) / tokens.sum()))
    assert r.low < r.point < r.high
    assert r.low > 1.05 and r.verdict == FAIL
    assert r.candidate == pytest.approx(math.exp(cand.sum() / tokens.sum()))
    ok = paired_perplexity(base + 0.001 * tokens, base, tokens, 1.05)
    assert ok.verdict == PASS and ok.high < 1.01


def test_deterministic_given_seed():
    c, b = _pair(150, 0.5, 10, 6)
    one, two = paired_accuracy(c, b, 0.95, seed=7), paired_accuracy(c, b, 0.95, seed=7)
    assert one.to_dict() == two.to_dict()
    assert paired_accuracy(c, b, 0.95, seed=8).low != one.low


def test_mcnemar_exact_values():
    assert mcnemar_exact_p(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_exact_p(3, 3) == 1.0
    # b=1, c=9: 2 * P(X <= 1), X ~ Bin(10, 1/2) = 2 * 11 / 1024
    assert mcnemar_exact_p(1, 9) == pytest.approx(22 / 1024)


def test_combine_and_input_validation():
    assert combine([PASS, PASS]) == PASS
    assert combine([PASS, INCONCLUSIVE]) == INCONCLUSIVE
    assert combine([INCONCLUSIVE, FAIL]) == FAIL
    with pytest.raises(ValueError):
        paired_accuracy([1, 0], [1], 0.95)
    with pytest.raises(ValueError):
        paired_perplexity([1.0], [1.0], [0], 1.05)


def test_window_statistic_mean_interval_matches_the_window_standard_error():
    """Resampling whole windows: for many windows the interval of the mean approaches
    mean +- z * sd(window means) / sqrt(windows), whatever the correlation inside a window."""
    rng = np.random.default_rng(1)
    windows = rng.gamma(2.0, 0.01, size=(400, 1)) + rng.gamma(2.0, 0.002, size=(400, 50))  # correlated rows
    r = window_statistic("mean_kld", windows, mean_of, 0.05, False, 0.0, resamples=4000, seed=3)
    se = windows.mean(1).std(ddof=1) / math.sqrt(400)
    assert r.point == pytest.approx(windows.mean())
    assert (r.high - r.low) == pytest.approx(2 * 1.96 * se, rel=0.1)
    assert r.verdict == PASS and r.n == 400 and r.extra["tokens"] == 400 * 50
    # the same data against a bar inside its interval is inconclusive, with a size that would decide it
    mid = window_statistic("mean_kld", windows, mean_of, r.point + 0.3 * (r.high - r.point), False, 0.0, seed=3)
    assert mid.verdict == INCONCLUSIVE and mid.samples_needed > 400


def test_window_statistic_reductions_and_reported_rows():
    values = np.arange(1.0, 101.0).reshape(4, 25)
    assert window_statistic("m", values, max_of, None, False, 0.0).point == 100.0
    assert window_statistic("q", values, quantile_of(0.5), None, False, 0.0).point == pytest.approx(50.5)
    assert window_statistic("r", values, rms_of, None, False, 0.0).point == pytest.approx(
        math.sqrt((values ** 2).mean()))
    r = window_statistic("same_top", np.ones((5, 7)), mean_of, None, True, 1.0)
    assert (r.verdict, r.threshold, r.samples_needed) == (REPORTED, None, None)
    assert window_statistic("same_top", np.full((5, 7), 0.5), mean_of, 0.9, True, 1.0).verdict == FAIL
    with pytest.raises(ValueError):
        window_statistic("x", np.ones(5), mean_of, None, False, 0.0)


def test_flip_rate_counts_both_directions_where_accuracy_cancels():
    c, b = _pair(300, 0.5, 30, 30)  # same accuracy, 60 answers changed
    acc = paired_accuracy(c, b, 0.95)
    assert acc.point == 1.0
    flips = flip_rate(c, b, 0.1)
    assert flips.point == pytest.approx(0.2) and flips.extra == {"right_to_wrong": 30, "wrong_to_right": 30}
    assert flips.verdict == FAIL and flips.low > 0.1
    assert flip_rate(b, b, 0.1).verdict == PASS and flip_rate(c, b, None).verdict == REPORTED
