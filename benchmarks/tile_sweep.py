"""Time compile/tune.py's `w4a16_tiled` tile candidates on this GPU; write the winners as a patch.

The patch sets kernels/tiles.py's MEASURED tables and is applied through a reviewed commit.

    python benchmarks/tile_sweep.py --out tiles.patch --json tiles.json [--budget-s 480]

`benchmarks/gpu_lease.sh tiles` runs it on a lent GPU. The shapes are the GPU benchmark's LLM
layers (`gpu_matmul_sections.W4A16_LLM_SHAPES`: g128 symmetric, bf16), their weights in rotating
copies past the L2 as in its w4a16_llm section, each launch graph-timed (`gpu_timing.rotated_ms`).
For each split-K bucket of this arch's table (`tune.sweep_buckets`: decode first), stage 1 times
`tune.tile_candidates` at the bucket's rows on every shape and `tune.best_tiles` picks the bucket's
config; stage 2 times `tune.split_candidates` of that config and `tune.best_splits` picks each
shape's split. Before it is timed, every candidate's output is checked against the reference on
the first and last 512 rows (`error_bounds.exact_weight_bound`) and must be written everywhere; a
candidate that fails or does not compile is left out and reported. Once the budget is spent no
candidate is started: a bucket whose stage 1 did not cover every shape gets no entry. Nothing here
changes the tables; the patch is the change to review (`git apply tiles.patch`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, from any working directory
import gpu_timing  # noqa: E402  (maps the lmfoundry package folders on import)
import torch  # noqa: E402
from gpu_matmul_sections import HBM_PASS_BYTES, W4A16_LLM_SHAPES  # noqa: E402

from lmfoundry.compile import tune  # noqa: E402
from lmfoundry.kernels import error_bounds, tiled_layout, tiles, w4a16, w4a16_tiled  # noqa: E402
from lmfoundry.kernels.dispatch import JitLauncher  # noqa: E402
from lmfoundry.kernels.spec import TileConfig  # noqa: E402

KERNEL = "w4a16_tiled"
GROUP = 128
CHECK_ROWS = 512  # output rows checked at each end of the layer
REL_ERROR = 1e-2  # |out - ref| / |ref| over the checked rows: bf16 outputs land near 2^-9


class Layer:
    """One LLM layer shape on `device`: a random g128 symmetric weight, `copies` rotating copies of
    it, and per row count an input, the output buffer and the reference with its bound on the
    checked rows (computed once, shared by every candidate)."""

    def __init__(self, n: int, k: int, device: str, copies: int) -> None:
        gen = torch.Generator(device=device).manual_seed(n * 7 + k)
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32, device=device)
        scale = (torch.rand(n, k // GROUP, generator=gen, device=device) * 0.02 + 0.002).bfloat16()
        self.n, self.k, self.device, self.gen = n, k, device, gen
        self.weight = tiled_layout.repack_tiled(w4a16.PackedLinear(tiled_layout.pack_codes(codes, 4, 1), scale, 4,
                                                                   GROUP, k))
        self.copies = [self.weight] + [tiled_layout.TiledLinear(self.weight.qweight.clone(), self.weight.scale.clone(),
                                                                4, GROUP, k, n) for _ in range(copies - 1)]
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, list[tuple[slice, torch.Tensor, torch.Tensor]]]] = {}

    def rows_slices(self) -> list[slice]:
        """The first and last CHECK_ROWS output rows, whole 128-row panels."""
        panels = -(-self.n // tiled_layout.TILE_N)
        per = min(panels, CHECK_ROWS // tiled_layout.TILE_N)
        return [slice(0, per), slice(panels - per, panels)]

    def prepare(self, m: int) -> None:
        if m in self.inputs:
            return
        x = torch.randn(m, self.k, generator=self.gen, device=self.device).bfloat16()
        checks = []
        for panels in self.rows_slices():
            rows = slice(panels.start * tiled_layout.TILE_N, min(panels.stop * tiled_layout.TILE_N, self.n))
            part = tiled_layout.TiledLinear(self.weight.qweight[panels], self.weight.scale[:, rows], 4, GROUP, self.k,
                                            rows.stop - rows.start)
            exact, offset, weight_u = w4a16_tiled.tiled_error_terms(part, torch.bfloat16)
            ref = (x.float() @ part.dequantize().bfloat16().float().t()).bfloat16().cpu()
            bound = error_bounds.exact_weight_bound(ref, x.cpu(), exact, offset, torch.bfloat16, weight_u, 2.0**-22)
            checks.append((rows, ref, bound))
        self.inputs[m] = (x, torch.empty(m, self.n, dtype=torch.bfloat16, device=self.device), checks)

    def check(self, m: int, config: TileConfig) -> None:
        """Raise AssertionError unless `config` writes every output element and, on the checked rows,
        each element is within the bound and the whole within REL_ERROR of the reference in norm
        (the bound on one element allows for the cancelled offsets of the bf16 path; a tile that
        drops or repeats a part of K is off everywhere)."""
        self.prepare(m)
        x, _, checks = self.inputs[m]
        got = w4a16_tiled.w4a16_tiled_linear(x, self.weight, out=error_bounds.poisoned((m, self.n), torch.bfloat16,
                                                                                        self.device),
                                             launcher=JitLauncher(pick_config=lambda call: config))
        error_bounds.assert_written(got, KERNEL)
        for rows, ref, bound in checks:
            what = f"{KERNEL} {self.n}x{self.k} M={m} rows {rows.start}-{rows.stop}"
            part = got[:, rows].cpu()
            error_bounds.assert_within(part, ref, bound, what)
            rel = float((part.double() - ref.double()).norm() / ref.double().norm())
            assert rel <= REL_ERROR, f"{what}: relative error {rel:.2e} in norm"

    def time_ms(self, m: int, config: TileConfig) -> float:
        x, out, _ = self.inputs[m]
        jit = JitLauncher(pick_config=lambda call: config)
        return gpu_timing.rotated_ms([partial(w4a16_tiled.w4a16_tiled_linear, x, t, out=out, launcher=jit)
                                      for t in self.copies])


def measure(layer: Layer, bucket: tune.Bucket, stage: int, config: TileConfig, results: list[dict]) -> None:
    """Check and time `config` at each of the bucket's rows on `layer`; one result row per rows."""
    for m in bucket.rows:
        row = {"bucket": [bucket.lo, bucket.hi], "stage": stage, "shape": [layer.n, layer.k], "rows": m,
               "config": config.as_dict(), "ok": False, "ms": None}
        try:
            layer.check(m, config)
            row["ms"], row["ok"] = layer.time_ms(m, config), True
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile, fit or compute: left out, reported
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        results.append(row)
        c = config
        print(f"  [{'ok' if row['ok'] else 'FAIL'}] {layer.n}x{layer.k} M={m:<3} BLOCK_M {c['BLOCK_M']} BLOCK_N "
              f"{c['BLOCK_N']} SPLIT_K {c['SPLIT_K']:<2} w{c.num_warps} s{c.num_stages}: "
              + (f"{row['ms'] * 1e3:7.1f} us" if row["ok"] else row["error"]), flush=True)


def provenance() -> str:
    """The GPU, versions, commit and date the measured entries come from."""
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=gpu_timing.REPO, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown commit"
    return (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {commit}, "
            f"{datetime.date.today().isoformat()}: benchmarks/tile_sweep.py")


def sweep(cap: int, budget_s: float) -> tuple[list[dict], dict[int, TileConfig], dict[tuple[int, ...], int]]:
    """Stage 1 and 2 of every bucket while the budget lasts: (result rows, bucket winners, splits)."""
    t0 = time.perf_counter()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    need = max(HBM_PASS_BYTES, 4 * l2)
    layers = []
    for n, k in W4A16_LLM_SHAPES:
        nbytes = n * k // 2 + n * (k // GROUP) * 2
        layers.append(Layer(n, k, "cuda", max(2, -(-need // nbytes))))
    results: list[dict] = []
    winners: dict[int, TileConfig] = {}
    splits: dict[tuple[int, ...], int] = {}
    left = lambda: budget_s - (time.perf_counter() - t0)  # noqa: E731
    for bucket in tune.sweep_buckets(cap, KERNEL):
        print(f"bucket {bucket.lo}-{bucket.hi} rows (table: {dict(bucket.config.constexprs)} w{bucket.config.num_warps} "
              f"s{bucket.config.num_stages}), timed at M = {', '.join(map(str, bucket.rows))}", flush=True)
        stage1: list[dict] = []
        for layer in layers:
            shape = {"N": layer.n, "K": layer.k, "bits": 4, "group": GROUP}
            for config in tune.tile_candidates(cap, KERNEL, shape, bucket):
                if left() <= 0:
                    break
                measure(layer, bucket, 1, config, stage1)
        results += stage1
        best = tune.best_tiles(stage1)
        covered = {tuple(r["shape"]) for r in stage1 if r["ok"]} == {(layer.n, layer.k) for layer in layers}
        if best is None or not covered:
            print(f"bucket {bucket.lo}-{bucket.hi}: stage 1 did not cover every shape ({left():.0f} s of the budget "
                  "left): no entry", flush=True)
            continue
        winners[bucket.hi] = best
        stage2: list[dict] = []
        for layer in layers:
            shape = {"N": layer.n, "K": layer.k, "bits": 4, "group": GROUP}
            for config in tune.split_candidates(cap, KERNEL, shape, bucket, best):
                if left() <= 0:
                    break
                if any(r["config"] == config.as_dict() and r["shape"] == [layer.n, layer.k] for r in stage1):
                    continue  # timed in stage 1
                measure(layer, bucket, 2, config, stage2)
        results += stage2
        for (n, k), s in tune.best_splits(stage1 + stage2, best).items():
            splits[tiles.shape_key(KERNEL, {"N": n, "K": k, "bits": 4, "group": GROUP}, bucket.hi)] = s
    return results, winners, splits


def summary(results: list[dict], winners: dict[int, TileConfig], splits: dict[tuple[int, ...], int], cap: int) -> None:
    """Per bucket, shape and rows: the config the tables give today against the measured one."""
    def ms(shape: list[int], m: int, config: TileConfig) -> float | None:
        return next((r["ms"] for r in results if r["ok"] and r["shape"] == shape and r["rows"] == m
                     and r["config"] == config.as_dict()), None)

    print("\nbucket shape        M    tables today                   us     measured                       us     x")
    for bucket in tune.sweep_buckets(cap, KERNEL):
        if bucket.hi not in winners:
            continue
        for n, k in W4A16_LLM_SHAPES:
            shape = {"N": n, "K": k, "bits": 4, "group": GROUP}
            today = next(c for lo, hi, c in tiles.buckets(cap, KERNEL, shape) if hi == bucket.hi)
            split = splits.get(tiles.shape_key(KERNEL, shape, bucket.hi), winners[bucket.hi]["SPLIT_K"])
            chosen = tune.reconfigure(winners[bucket.hi], SPLIT_K=split)
            for m in bucket.rows:
                a, b = ms([n, k], m, today), ms([n, k], m, chosen)
                if a is not None and b is not None:
                    print(f"{bucket.hi:<6} {n}x{k:<6} {m:<4} {describe(today):<30} {a * 1e3:6.1f} "
                          f"{describe(chosen):<30} {b * 1e3:6.1f} {a / b:5.2f}")


def describe(c: TileConfig) -> str:
    return f"{c['BLOCK_M']}x{c['BLOCK_N']} split {c['SPLIT_K']} w{c.num_warps} s{c.num_stages}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the patch of kernels/tiles.py to write")
    parser.add_argument("--json", help="every timed candidate, the winners and the run's settings")
    parser.add_argument("--budget-s", type=float, default=480.0, help="start no candidate after this many seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU: the sweep times kernels (tests/compile/test_tune.py covers its CPU side)")
    major, minor = torch.cuda.get_device_capability()
    cap = major * 10 + minor
    note = provenance()
    print(note, flush=True)
    results, winners, splits = sweep(cap, args.budget_s)
    if args.json:
        Path(args.json).write_text(json.dumps({"note": note, "capability": cap, "results": results,
                                               "buckets": {hi: c.as_dict() for hi, c in winners.items()},
                                               "splits": [[list(k), v] for k, v in splits.items()]}, indent=1))
    summary(results, winners, splits, cap)
    if not winners:
        sys.exit("no bucket was measured on every shape: no patch written")
    source = (gpu_timing.REPO / "kernels" / "tiles.py").read_text()
    Path(args.out).write_text(tune.tiles_patch(source, KERNEL, cap, winners, splits, note))
    print(f"wrote {args.out}: apply with `git apply {args.out}`, review, commit")


if __name__ == "__main__":
    main()
