"""Where a quantized linear's step is faster as dequantize-then-GEMM than as its packed product,
measured on the machine that serves: our C product, or PyTorch's int4pack / int8pack kernel where
there is none (no AVX-512 BF16, or a block the C product does not take).

The C products (`kernels/cpu/int4_gemm.c`, `int8_gemm.c`) widen the codes once per block of 8 rows
and multiply with AVX-512 BF16 dot products; the CPU's own GEMM (oneDNN) multiplies a dense bf16
weight, with AMX tiles where the CPU has them. Which one a step of M rows should take depends on
the CPU: on AVX-512 BF16 alone the C product keeps up at every M; with AMX, a long prompt chunk
computes several times faster as one dequantization plus an AMX GEMM. So the crossover is timed
here on each distinct linear of the model (its own weights, random rows), once per weight shape,
thread count, CPU, torch version and kernel source, and kept in the cache (`cpu-crossover/`): a
server pays the measurement (a few timed calls per shape and path) on its first start only.

`LMFOUNDRY_CPU_DENSE_ROWS` overrides it: `never` (the C product for every step: every row then
computes alike whatever its batch, which deterministic serving needs) or a row count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger("lmfoundry.runtime")
ENV = "LMFOUNDRY_CPU_DENSE_ROWS"
CANDIDATE_ROWS = (64, 128, 256, 512, 1024)  # below 64 the product reads each weight too few times to lose
MARGIN = 0.9  # dense must be clearly faster (timing noise on a busy 2-core machine is ~5-10 %)
Shape = tuple[str, int, int, int, bool]  # (kind, out_features, in_features, group, asymmetric)


def _best_of(fn: Callable[[], Any], reps: int = 5, budget: float = 0.25) -> float:
    """The fastest of up to `reps` timed calls after a warm-up, stopping once `budget` seconds are
    spent: PyTorch's per-row kernels at a thousand rows of a large layer take seconds a call, and
    the measurement runs at a server's first start."""
    fn()
    best, spent = float("inf"), 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        took = time.perf_counter() - t0
        best, spent = min(best, took), spent + took
        if spent >= budget:
            break
    return best


def measure(linear: Any, rows: tuple[int, ...] = CANDIDATE_ROWS) -> int | None:
    """The fewest rows from which `linear` (a `CProductLinear`, `Int4PackLinear` or
    `Int8PackLinear`: each switches at `dense_from` rows) computes faster dequantized than through
    its packed product, by MARGIN at that row count and every larger one measured (None: never)."""
    gen = torch.Generator().manual_seed(0)
    saved = linear.dense_from
    dense_wins = []
    try:
        for m in rows:
            x = torch.randn(m, linear.in_features, generator=gen).to(torch.bfloat16)
            linear.dense_from = None
            c_product = _best_of(partial(linear, x))
            linear.dense_from = 1
            dense = _best_of(partial(linear, x))
            dense_wins.append(dense < MARGIN * c_product)
    finally:
        linear.dense_from = saved
    for i, m in enumerate(rows):
        if all(dense_wins[i:]):
            return m
    return None


def _cache_file(shapes: list[Shape], threads: int) -> Path:
    from lmfoundry.kernels.cpu.build import HERE, _cpu_flags
    from lmfoundry.resources import cache_dir

    sources = [(HERE / name).read_bytes() for name in ("int4_gemm.c", "int8_gemm.c", "weight_only.h")]
    key = json.dumps([sorted(shapes), threads, torch.__version__, _cpu_flags(),
                      [hashlib.sha256(src).hexdigest() for src in sources]], sort_keys=True)
    return cache_dir() / "cpu-crossover" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def set_dense_rows(linears: list[Any]) -> dict[Shape, int | None]:
    """Give each quantized linear the rows from which its steps run dequantized (`dense_from`):
    the override, else the cached measurement of its shape, else measured now (on the first
    linear of each shape) and cached. Returns the table by shape."""
    shapes = sorted({lin.shape for lin in linears})
    table = _table(shapes, {lin.shape: lin for lin in linears})
    for lin in linears:
        lin.dense_from = table[lin.shape]
    return table


def _table(shapes: list[Shape], sample: dict[Shape, Any]) -> dict[Shape, int | None]:
    override = os.environ.get(ENV)
    if override is not None:
        if override.strip().lower() == "never":
            return {s: None for s in shapes}
        try:
            rows = int(override)
        except ValueError:
            raise ValueError(f"{ENV}={override!r}: expected `never` or a number of rows") from None
        return {s: max(1, rows) for s in shapes}
    threads = torch.get_num_threads()
    path = _cache_file(shapes, threads)
    try:
        found = json.loads(path.read_text())
        return {tuple(s): r for s, r in found["crossover"]}  # type: ignore[misc]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    t0 = time.perf_counter()
    result = {s: measure(sample[s]) for s in shapes}
    log.info("quantized linears: dequantize-then-GEMM from %s rows (measured in %.1f s on %d threads)",
             {f"{kind} {n}x{k}": r for (kind, n, k, _, _), r in result.items()}, time.perf_counter() - t0, threads)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"crossover": [[list(s), r] for s, r in result.items()]}))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache: measured again next start
        log.warning("cannot cache the crossover in %s (%s)", path.parent, exc.strerror or exc)
    return result
