"""`--tune`: replace table configs by measurement on the local GPU, for its own arch only.

Only GEMM kernels are tuned (their best tile depends most on the shape); each covered shape is
timed at the upper row count of its bucket (capped at 4096) with `triton.testing.do_bench` over the
candidates below, on random inputs built by `lmfoundry.kernels.harness`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

from lmfoundry.errors import UserError

if TYPE_CHECKING:  # imported where used: they pull in torch
    from lmfoundry.compile.kernel_plan import Plan, Spec
    from lmfoundry.kernels.dispatch import ConfigPicker
    from lmfoundry.kernels.spec import TileConfig

CANDIDATES = {
    "BLOCK_M": (16, 32, 64, 128),
    "BLOCK_N": (64, 128, 256),
    "BLOCK_K": (32, 64, 128),
    "SPLIT_K": (1, 2, 4, 8),  # only taken at rows <= kernels.splitk.SPLIT_MAX_M (above, the kernels ignore it)
    "SWAP_AB": (0, 1),  # scaled_mm
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
}


def tune_plan(plan: Plan, log: Callable[[str], None]) -> None:
    """Re-pick the configs of `plan`'s GEMM specs for the local GPU's arch (in place)."""
    import torch

    if not torch.cuda.is_available():
        raise UserError("--tune needs a CUDA GPU on this machine; none found (the per-arch tables are used without it)")
    from lmfoundry.compile.kernel_plan import Spec
    from lmfoundry.kernels import harness, tiles
    from lmfoundry.kernels.dispatch import JitExecutor

    major, minor = torch.cuda.get_device_capability()
    cap = major * 10 + minor
    tuned: list[Spec] = []
    kept: list[Spec] = []
    for spec in plan.specs:
        if spec.capability != cap or spec.kernel not in tiles.GEMM_TABLES:
            kept.append(spec)
            continue
        for cover in spec.covers:
            rows = min(cover["rows"][1], 4096)
            ex = harness.build(spec.kernel, spec.types, spec.semantics, {**cover["shape"], "M": rows}, "cuda")
            best, best_ms = spec.config, float("inf")
            for cfg in _candidates(spec.config, spec.kernel):
                try:
                    ms = harness.time_ms(ex, JitExecutor(pick_config=_always(cfg)))
                except Exception:  # out of resources / unsupported tile: not a candidate
                    continue
                if ms < best_ms:
                    best, best_ms = cfg, ms
            log(f"tune {spec.kernel} {cover['shape']} rows<={rows}: {dict(best.constexprs)} w{best.num_warps} "
                f"s{best.num_stages} {best_ms * 1e3:.1f} us")
            tuned.append(Spec(spec.capability, spec.kernel, spec.types, spec.semantics, best, [cover], spec.aligned))
    plan.specs = kept + _merge(tuned)


def _always(cfg: TileConfig) -> ConfigPicker:
    """A config picker that answers `cfg` for every call."""
    return lambda call: cfg


def _candidates(base: TileConfig, kernel: str) -> Iterator[TileConfig]:
    from itertools import product

    from lmfoundry.kernels.spec import TileConfig

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
