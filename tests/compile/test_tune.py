"""The CPU side of the lease's tile sweep (compile/tune.py, benchmarks/tile_sweep.py): what it will
time, how it picks, the patch it writes, and the check every candidate passes before it is timed.

The timing itself needs a GPU (`benchmarks/gpu_lease.sh tiles`); these make sure that a lease is
not spent finding out that the candidates are wrong, the choice misreads the timings or the patch
does not apply. The timings fed to `best_tiles` / `best_splits` below are made up for the test
(their pattern is the point: one config fastest everywhere, one split fastest at one shape).
"""

from __future__ import annotations

import importlib.util
import subprocess

import pytest
import torch
from helpers import benchmark_script, gpu_kernels_benchmark

from lmfoundry.compile import tune
from lmfoundry.gpus import SM_COUNT
from lmfoundry.kernels import tiled_layout, tiles
from lmfoundry.kernels.spec import TileConfig

KERNEL = "w4a16_tiled"
LLM_SHAPES = gpu_kernels_benchmark().gpu_matmul_sections.W4A16_LLM_SHAPES


def shape_of(n: int, k: int) -> dict[str, int]:
    return {"N": n, "K": k, "bits": 4, "group": 128}


def test_sweep_buckets_are_the_split_k_buckets_decode_first():
    buckets = tune.sweep_buckets(90, KERNEL)
    assert [(b.lo, b.hi, b.rows) for b in buckets] == [(1, 16, (1, 16)), (33, 64, (64,)), (17, 32, (32,))]
    assert all(b.config == c for b in buckets for hi, c in tiles.GEMM_TABLES[KERNEL][90] if hi == b.hi)
    with pytest.raises(ValueError, match="covers w4a16_tiled"):
        tune.sweep_buckets(90, "fp8_gemm")


@pytest.mark.parametrize("n,k", LLM_SHAPES)
def test_candidates_on_the_llm_shapes(n, k):
    """Stage 1: the bucket's BLOCK_M, every BLOCK_N x warps x stages of SWEEP_TILES once, tiles that
    lie inside a 128-row panel, each at the model's split (which gives the decode bucket its two
    programs per SM), the tables' own config among them. Stage 2: splits around the model's."""
    shape = shape_of(n, k)
    for bucket in tune.sweep_buckets(90, KERNEL):
        cands = tune.tile_candidates(90, KERNEL, shape, bucket)
        sizes = [len(v) for v in tune.SWEEP_TILES.values()]
        assert len(cands) == len(set(cands)) == sizes[0] * sizes[1] * sizes[2]
        today = next(c for lo, hi, c in tiles.buckets(90, KERNEL, shape) if hi == bucket.hi)
        assert today in cands
        for c in cands:
            assert c["BLOCK_M"] == bucket.config["BLOCK_M"] and tiled_layout.TILE_N % c["BLOCK_N"] == 0
            assert c["SPLIT_K"] == tiles.model_split(90, KERNEL, c, shape, bucket.hi)
            if bucket.lo == 1:
                assert -(-n // c["BLOCK_N"]) * c["SPLIT_K"] >= tiles.MIN_WAVES * SM_COUNT[90], c
        splits = [c["SPLIT_K"] for c in tune.split_candidates(90, KERNEL, shape, bucket, today)]
        most = min(tiles.MAX_SPLIT_K, tiles.k_iterations(KERNEL, today, shape))
        assert splits == sorted(set(splits)) and today["SPLIT_K"] in splits and 1 in splits
        assert all(1 <= s <= most for s in splits) and len(splits) >= 4


def result(shape, rows, config: TileConfig, ms: float, ok: bool = True) -> dict:
    return {"shape": list(shape), "rows": rows, "config": config.as_dict(), "ms": ms, "ok": ok}


def cfg(bn: int, warps: int, stages: int, split: int, bm: int = 16) -> TileConfig:
    return TileConfig.make(num_warps=warps, num_stages=stages, BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split)


def test_best_tiles_and_splits_read_the_timings():
    """The winner is the config fastest relative to the best at each (shape, rows), over configs
    timed and checked at all of them; splits are picked per shape among that config's."""
    a, b = (4096, 14336), (14336, 4096)
    results = [
        result(a, 1, cfg(64, 4, 4, 6), 10.0), result(a, 16, cfg(64, 4, 4, 6), 11.0),
        result(b, 1, cfg(64, 4, 4, 2), 10.0), result(b, 16, cfg(64, 4, 4, 2), 11.0),
        result(a, 1, cfg(128, 8, 4, 9), 8.0), result(a, 16, cfg(128, 8, 4, 9), 9.0),
        result(b, 1, cfg(128, 8, 4, 3), 9.0), result(b, 16, cfg(128, 8, 4, 3), 10.0),
        # fastest where it ran, but never checked on b at 16 rows: not a candidate
        result(a, 1, cfg(64, 8, 3, 6), 5.0), result(a, 16, cfg(64, 8, 3, 6), 5.0), result(b, 1, cfg(64, 8, 3, 2), 5.0),
        result(b, 16, cfg(64, 8, 3, 2), 5.0, ok=False),
    ]
    best = tune.best_tiles(results)
    assert best == tune.reconfigure(cfg(128, 8, 4, 1), SPLIT_K=1)
    stage2 = [result(a, 1, cfg(128, 8, 4, 8), 7.0), result(a, 16, cfg(128, 8, 4, 8), 9.5),
              result(b, 1, cfg(128, 8, 4, 4), 9.5), result(b, 16, cfg(128, 8, 4, 4), 10.5),
              result(b, 1, cfg(128, 8, 4, 6), 1.0)]  # only one of b's rows: not taken
    assert tune.best_splits(results + stage2, best) == {a: 8, b: 3}
    assert tune.best_tiles([results[-1]]) is None


def apply_patch(patch: str, root) -> None:
    (root / "tiles.patch").write_text(patch)
    subprocess.run(["git", "apply", "--check", "tiles.patch"], cwd=root, check=True, capture_output=True)
    subprocess.run(["git", "apply", "tiles.patch"], cwd=root, check=True, capture_output=True)


def load_tiles(path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_patch_applies_and_the_tables_take_it(tmp_path):
    """The patch of kernels/tiles.py applies with `git apply` and the patched tables give the
    measured bucket config (with the measured split on a measured shape, the model's on others)
    while leaving every other bucket as it was; a second patch for another arch keeps the first."""
    source_path = tmp_path / "kernels" / "tiles.py"
    source_path.parent.mkdir()
    source_path.write_text(open(tiles.__file__).read())
    measured = cfg(128, 8, 5, 1)
    key = tiles.shape_key(KERNEL, shape_of(4096, 14336), 16)
    apply_patch(tune.tiles_patch(source_path.read_text(), KERNEL, 90, {16: measured}, {key: 11}, "H200 test note"),
                tmp_path)
    patched = load_tiles(source_path, "tiles_patched_once")
    assert patched.MEASURED_BUCKETS == {KERNEL: {90: {16: measured}}} and patched.MEASURED_SPLITS == {KERNEL: {90: {key: 11}}}
    assert "# measured w4a16_tiled sm_90: H200 test note" in source_path.read_text()
    b = patched.buckets(90, KERNEL, shape_of(4096, 14336))
    assert b[0][2] == tune.reconfigure(measured, SPLIT_K=11)
    assert b[1:] == tiles.buckets(90, KERNEL, shape_of(4096, 14336))[1:]
    other = patched.buckets(90, KERNEL, shape_of(14336, 4096))[0][2]
    assert other == tune.reconfigure(measured, SPLIT_K=tiles.model_split(90, KERNEL, measured, shape_of(14336, 4096), 16))
    assert patched.buckets(80, KERNEL, shape_of(4096, 14336)) == tiles.buckets(80, KERNEL, shape_of(4096, 14336))
    # a second sweep on another arch: the first entries and their note stay
    apply_patch(tune.tiles_patch(source_path.read_text(), KERNEL, 80, {16: cfg(64, 4, 3, 1)}, {}, "A100 note"), tmp_path)
    twice = load_tiles(source_path, "tiles_patched_twice")
    assert twice.MEASURED_BUCKETS == {KERNEL: {80: {16: cfg(64, 4, 3, 1)}, 90: {16: measured}}}
    assert twice.MEASURED_SPLITS == {KERNEL: {80: {}, 90: {key: 11}}}
    assert "H200 test note" in source_path.read_text() and "A100 note" in source_path.read_text()
    text = source_path.read_text()
    region = text[text.index("# BEGIN MEASURED"):text.index("# END MEASURED")]
    assert max(len(line) for line in region.splitlines()) <= 120  # the project's line length


def test_the_sweep_checks_every_candidate(monkeypatch):
    """benchmarks/tile_sweep.py's per-candidate check, on a small layer through the interpreter: a
    candidate config passes; an op off by 3 on one element fails the element bound, one 3 % off
    everywhere (each element still inside its bound, which allows for the bf16 path's cancelled
    offsets) fails the norm check, and one that leaves an element unwritten fails too."""
    sweep = benchmark_script("tile_sweep")
    layer = sweep.Layer(256, 1024, "cuda" if torch.cuda.is_available() else "cpu", copies=1)
    assert [(s.start, s.stop) for s in layer.rows_slices()] == [(0, 2), (0, 2)]
    good = cfg(64, 4, 4, 3)
    layer.check(1, good)
    real = sweep.w4a16_tiled.w4a16_tiled_linear

    def wrong(change):
        def op(x, w, out=None, launcher=None):
            return change(real(x, w, out=out, launcher=launcher))
        return op

    def one_off(got):
        got[0, 200] += 3.0
        return got

    def unwritten(got):
        got[0, 7] = float("nan")
        return got

    for change, match in ((one_off, "outside the bound"), (lambda got: got.mul_(1.03), "relative error"),
                          (unwritten, "w4a16_tiled")):
        monkeypatch.setattr(sweep.w4a16_tiled, "w4a16_tiled_linear", wrong(change))
        with pytest.raises(AssertionError, match=match):
            layer.check(1, good)
