"""`--tune`: replace table configs by measurement on the local GPU, for its own arch only; and the
tile sweep a lent GPU runs for the tables themselves.

Only GEMM kernels are tuned (their best tile depends most on the shape); each covered shape is
timed at the upper row count of its bucket (capped at 4096) with `triton.testing.do_bench` over the
candidates below, on random inputs built by `lmfoundry.kernels.harness`.

The sweep (`benchmarks/tile_sweep.py`, run by `benchmarks/gpu_lease.sh tiles`) times the split-K
buckets of `w4a16_tiled` on the GPU benchmark's LLM layer shapes in two stages, both enumerated
here so that a CPU test sees what a lease will time: `tile_candidates` (every BLOCK_N x warps x
stages of SWEEP_TILES at the table's BLOCK_M, each at the split the model gives it) and then
`split_candidates` (the bucket's winner at splits around the model's). `best_tiles` and
`best_splits` read the winners off the timings and `tiles_patch` writes them into kernels/tiles.py's
MEASURED tables as a patch, applied through a reviewed commit.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from lmfoundry.errors import UserError
from lmfoundry.kernels.spec import TileConfig

if TYPE_CHECKING:  # imported where used: they pull in torch
    from lmfoundry.compile.kernel_selection import KernelBuild, Spec
    from lmfoundry.kernels.dispatch import ConfigPicker

CANDIDATES = {
    "BLOCK_M": (16, 32, 64, 128),
    "BLOCK_N": (64, 128, 256),
    "BLOCK_K": (32, 64, 128),
    "SPLIT_K": (1, 2, 4, 8),  # only taken at rows <= kernels.splitk.SPLIT_MAX_M (above, the kernels ignore it)
    "SWAP_AB": (0, 1),  # scaled_mm
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
}


def tune_build(build: KernelBuild, log: Callable[[str], None]) -> None:
    """Re-pick the configs of `build`'s GEMM specs for the local GPU's arch (in place)."""
    import torch

    if not torch.cuda.is_available():
        raise UserError("--tune needs a CUDA GPU on this machine; none found (the per-arch tables are used without it)")
    from lmfoundry.compile.kernel_selection import Spec
    from lmfoundry.kernels import harness, tiles
    from lmfoundry.kernels.dispatch import JitLauncher

    major, minor = torch.cuda.get_device_capability()
    cap = major * 10 + minor
    tuned: list[Spec] = []
    kept: list[Spec] = []
    for spec in build.specs:
        if spec.capability != cap or spec.kernel not in tiles.GEMM_TABLES:
            kept.append(spec)
            continue
        for cover in spec.covers:
            rows = min(cover["rows"][1], 4096)
            ex = harness.build(spec.kernel, spec.types, spec.semantics, {**cover["shape"], "M": rows}, "cuda")
            best, best_ms = spec.config, float("inf")
            for cfg in _candidates(spec.config, spec.kernel):
                try:
                    ms = harness.time_ms(ex, JitLauncher(pick_config=_always(cfg)))
                except Exception:  # out of resources / unsupported tile: not a candidate
                    continue
                if ms < best_ms:
                    best, best_ms = cfg, ms
            log(f"tune {spec.kernel} {cover['shape']} rows<={rows}: {dict(best.constexprs)} w{best.num_warps} "
                f"s{best.num_stages} {best_ms * 1e3:.1f} us")
            tuned.append(Spec(spec.capability, spec.kernel, spec.types, spec.semantics, best, [cover], spec.aligned))
    build.specs = kept + _merge(tuned)


def _always(cfg: TileConfig) -> ConfigPicker:
    """A config picker that answers `cfg` for every call."""
    return lambda call: cfg


def _candidates(base: TileConfig, kernel: str) -> Iterator[TileConfig]:
    from itertools import product

    names = [n for n, _ in base.constexprs]
    for values in product(*(CANDIDATES[n] for n in names), CANDIDATES["num_warps"], CANDIDATES["num_stages"]):
        d = dict(zip(names, values[: len(names)], strict=True))
        if kernel == "w4a16_gemm" and d.get("BLOCK_M", 64) < 16:
            continue
        if kernel == "w4a16_tiled" and d["BLOCK_N"] > 128:  # a tile must lie inside a 128-row panel
            continue
        yield TileConfig.make(num_warps=values[-2], num_stages=values[-1], **d)


def _merge(specs: list[Spec]) -> list[Spec]:
    merged: dict[tuple, Spec] = {}
    for s in specs:
        key = (s.capability, s.kernel, tuple(sorted(s.types.items())), tuple(sorted(s.semantics.items())), s.config)
        if key in merged:
            merged[key].covers.extend(s.covers)
            merged[key].aligned = [a for a in merged[key].aligned if a in s.aligned]
        else:
            merged[key] = s
    return list(merged.values())


# ---- the tile sweep of a lent GPU ----------------------------------------------------------------

SWEEP_KERNELS = ("w4a16_tiled",)
SWEEP_TILES: dict[str, tuple[int, ...]] = {"BLOCK_N": (64, 128), "num_warps": (4, 8), "num_stages": (3, 4, 5)}


@dataclass(frozen=True)
class Bucket:
    """One split-K row bucket of an arch's table: its rows, its config and the rows it is timed at."""

    lo: int
    hi: int
    config: TileConfig
    rows: tuple[int, ...]


def sweep_buckets(capability: int, kernel: str) -> list[Bucket]:
    """The buckets of `kernel`'s table for this arch that split K (up to SPLIT_MAX_M rows), in the
    order a budget should take them: decode, the largest, the rest. A bucket is timed at its first
    and last row count when it starts at one row, else at its last."""
    from lmfoundry.kernels import tiles

    if kernel not in SWEEP_KERNELS:
        raise ValueError(f"the tile sweep covers {', '.join(SWEEP_KERNELS)}, not {kernel}")
    out, lo = [], 1
    for hi, config in tiles.GEMM_TABLES[kernel][tiles.table_arch(capability)]:
        if hi <= tiles.SPLIT_MAX_M:
            out.append(Bucket(lo, hi, config, (1, hi) if lo == 1 else (hi,)))
        lo = hi + 1
    return sorted(out, key=lambda b: (b.lo != 1, b.hi != tiles.SPLIT_MAX_M, b.hi))


def reconfigure(config: TileConfig, num_warps: int | None = None, num_stages: int | None = None, **constexprs: int
                ) -> TileConfig:
    """`config` with some of its launch options and constexprs replaced."""
    return TileConfig.make(num_warps=num_warps or config.num_warps, num_stages=num_stages or config.num_stages,
                           **{**dict(config.constexprs), **constexprs})


def tile_candidates(capability: int, kernel: str, shape: Mapping[str, int], bucket: Bucket) -> list[TileConfig]:
    """Stage 1 for one shape: the bucket's BLOCK_M with every BLOCK_N x warps x stages of
    SWEEP_TILES (a tile inside one 128-row panel), each at the split the model gives it."""
    from itertools import product

    from lmfoundry.kernels import tiles

    out = []
    for bn, warps, stages in product(SWEEP_TILES["BLOCK_N"], SWEEP_TILES["num_warps"], SWEEP_TILES["num_stages"]):
        config = reconfigure(bucket.config, warps, stages, BLOCK_N=bn, SPLIT_K=1)
        out.append(reconfigure(config, SPLIT_K=tiles.model_split(capability, kernel, config, shape, bucket.hi)))
    return out


def split_candidates(capability: int, kernel: str, shape: Mapping[str, int], bucket: Bucket, config: TileConfig
                     ) -> list[TileConfig]:
    """Stage 2 for one shape: `config` (a stage-1 winner) at 1, half, one less, one more and twice
    the model's split, and the model's own, within 1..min(MAX_SPLIT_K, K iterations)."""
    from lmfoundry.kernels import tiles

    s = tiles.model_split(capability, kernel, config, shape, bucket.hi)
    most = min(tiles.MAX_SPLIT_K, tiles.k_iterations(kernel, config, shape))
    return [reconfigure(config, SPLIT_K=v) for v in sorted({1, max(1, s // 2), s - 1, s, s + 1, 2 * s}) if 1 <= v <= most]


def _tiles_key(config: TileConfig) -> TileConfig:
    return reconfigure(config, SPLIT_K=1)


def best_tiles(results: list[dict[str, Any]]) -> TileConfig | None:
    """The config (SPLIT_K aside) with the least mean time relative to the fastest at each (shape,
    rows), among those checked and timed at every (shape, rows) of `results` (rows of {"shape":
    [N, K], "rows", "config": TileConfig.as_dict(), "ms", "ok"}). None when no config has them all."""
    ok = [r for r in results if r["ok"]]
    points = {(tuple(r["shape"]), r["rows"]) for r in ok}
    fastest = {p: min(r["ms"] for r in ok if (tuple(r["shape"]), r["rows"]) == p) for p in points}
    times: dict[TileConfig, dict[tuple, float]] = {}
    for r in ok:
        seen = times.setdefault(_tiles_key(TileConfig.from_dict(r["config"])), {})
        p = (tuple(r["shape"]), r["rows"])
        seen[p] = min(seen.get(p, float("inf")), r["ms"])
    full = {c: sum(t[p] / fastest[p] for p in points) for c, t in times.items() if set(t) == points}
    return min(full, key=lambda c: (full[c], repr(c))) if full else None


def best_splits(results: list[dict[str, Any]], config: TileConfig) -> dict[tuple[int, int], int]:
    """Per shape (N, K): the SPLIT_K of `config` with the least summed time relative to the fastest
    at each of the shape's rows, among splits checked and timed at all of them."""
    ok = [r for r in results if r["ok"] and _tiles_key(TileConfig.from_dict(r["config"])) == _tiles_key(config)]
    out = {}
    for shape in {tuple(r["shape"]) for r in ok}:
        mine = [r for r in ok if tuple(r["shape"]) == shape]
        rows = {r["rows"] for r in mine}
        fastest = {m: min(r["ms"] for r in mine if r["rows"] == m) for m in rows}
        per: dict[int, dict[int, float]] = {}
        for r in mine:
            per.setdefault(r["config"]["constexprs"]["SPLIT_K"], {})[r["rows"]] = r["ms"]
        full = {s: sum(t[m] / fastest[m] for m in rows) for s, t in per.items() if set(t) == rows}
        if full:
            out[(int(shape[0]), int(shape[1]))] = min(full, key=lambda s: (full[s], s))
    return out


def _render_config(c: TileConfig) -> str:
    args = ", ".join(f"{k}={v}" for k, v in c.constexprs)
    return f"TileConfig.make(num_warps={c.num_warps}, num_stages={c.num_stages}, {args})"


def _render_table(head: str, table: Mapping[str, Mapping[int, Mapping[Any, Any]]], value: Callable[[Any], str]
                  ) -> list[str]:
    """`head` = {kernel: {arch: {key: value}}} as Python source, one entry a line."""
    lines = [head + " = {"]
    for kernel in sorted(table):
        lines.append(f'    "{kernel}": {{')
        for arch in sorted(table[kernel]):
            lines.append(f"        {arch}: {{")
            lines += [f"            {key}: {value(v)}," for key, v in sorted(table[kernel][arch].items())]
            lines.append("        },")
        lines.append("    },")
    return [*lines, "}"]


def _render_region(begin: str, notes: list[str], buckets: Mapping[str, Mapping[int, Mapping[int, TileConfig]]],
                   splits: Mapping[str, Mapping[int, Mapping[tuple[int, ...], int]]], end: str) -> list[str]:
    return [begin, "# kernel -> arch -> {bucket's max_rows: config}, and kernel -> arch -> {shape_key: SPLIT_K}", *notes,
            *_render_table("MEASURED_BUCKETS: dict[str, dict[int, dict[int, TileConfig]]]", buckets, _render_config),
            *_render_table("MEASURED_SPLITS: dict[str, dict[int, dict[tuple[int, ...], int]]]", splits, str), end]


def tiles_patch(source: str, kernel: str, capability: int, buckets: Mapping[int, TileConfig],
                splits: Mapping[tuple[int, ...], int], note: str, path: str = "kernels/tiles.py") -> str:
    """A unified diff (for `git apply`) of kernels/tiles.py whose MEASURED region (between its
    BEGIN/END MEASURED lines) holds `kernel`'s measured buckets and splits on this arch, replacing
    what it held for them, and keeping everything it holds for other kernels and archs; `note` (the
    GPU, versions, commit) becomes that entry's comment. `source` is the file's current text, whose
    region is read back by running it (plain literals of TileConfig)."""
    from lmfoundry.kernels import tiles

    lines = source.splitlines()
    begin = next(i for i, line in enumerate(lines) if line.startswith("# BEGIN MEASURED"))
    end = next(i for i, line in enumerate(lines) if line.startswith("# END MEASURED"))
    held: dict[str, Any] = {"TileConfig": TileConfig}
    exec("\n".join(lines[begin + 1:end]), held)  # noqa: S102 - the repository's own table literals
    arch = tiles.table_arch(capability)
    tag = f"# measured {kernel} sm_{arch}:"
    notes = [line for line in lines[begin + 1:end] if line.startswith("# measured ") and not line.startswith(tag)]
    notes.append(f"{tag} {note}")
    new_buckets = {k: {a: dict(v) for a, v in per.items()} for k, per in held["MEASURED_BUCKETS"].items()}
    new_splits = {k: {a: dict(v) for a, v in per.items()} for k, per in held["MEASURED_SPLITS"].items()}
    new_buckets.setdefault(kernel, {})[arch] = dict(buckets)
    new_splits.setdefault(kernel, {})[arch] = dict(splits)
    region = _render_region(lines[begin], notes, new_buckets, new_splits, lines[end])
    new = lines[:begin] + region + lines[end + 1:]
    return "".join(difflib.unified_diff([x + "\n" for x in lines], [x + "\n" for x in new], f"a/{path}", f"b/{path}"))
