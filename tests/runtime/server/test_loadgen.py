"""The load generator behind `lmfoundry bench`: percentiles and prompts."""

from __future__ import annotations

import pytest

from lmfoundry.runtime.server.loadgen import make_prompts, percentiles


def test_percentiles_interpolate() -> None:
    p = percentiles([4.0, 1.0, 3.0, 2.0])
    assert p["p50"] == pytest.approx(2.5) and p["p95"] == pytest.approx(3.85) and p["mean"] == 2.5
    assert percentiles([])["p50"] is None


def test_prompts_share_a_prefix_and_differ() -> None:
    ps = make_prompts(5, 50)
    assert len(set(ps)) == 5
    common = min(len(p) for p in ps)
    while len({p[:common] for p in ps}) > 1:
        common -= 1
    assert common > 200
