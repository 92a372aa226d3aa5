"""Where a 4-bit linear's step is faster as dequantize-then-GEMM than as the 4-bit C product,
measured on the machine that serves.

The C product (`kernels/cpu/int4_gemm.c`) decodes the codes once per block of 8 rows and multiplies
with AVX-512 BF16 dot products; the CPU's own GEMM (oneDNN) multiplies a dense bf16 weight, with AMX
tiles where the CPU has them. Which one a step of M rows should take depends on the CPU: on AVX-512
BF16 alone the C product keeps up at every M; with AMX, a long prompt chunk computes several times
faster as one dequantization plus an AMX GEMM. So the crossover is timed here, once per weight
shape, thread count, CPU and torch version, and kept in the cache (`cpu-crossover/`): a server
pays the measurement (about a second per shape) on its first start only.

`LMFOUNDRY_INT4_DENSE_ROWS` overrides it: `never` (the C product for every step: every row then
computes alike whatever its batch, which deterministic serving needs) or a row count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger("lmfoundry.runtime")
ENV = "LMFOUNDRY_INT4_DENSE_ROWS"
CANDIDATE_ROWS = (64, 128, 256, 512, 1024)  # below 64 the product reads each weight too few times to lose
MARGIN = 0.9  # dense must be clearly faster (timing noise on a busy 2-core machine is ~5-10 %)
Shape = tuple[int, int, int, bool]  # (out_features, in_features, group, asymmetric)


def _best_of(fn: Callable[[], Any], reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(shape: Shape, gemm: Any, rows: tuple[int, ...] = CANDIDATE_ROWS) -> int | None:
    """The fewest rows from which dequantize-then-GEMM beats the C product by MARGIN at that row
    count and every larger one measured (None: never), on random codes of `shape`."""
    from lmfoundry.kernels.cpu.int4_gemm import pack

    n, k, group, asymmetric = shape
    gen = torch.Generator().manual_seed(0)
    w = pack(torch.randint(0, 16, (n, k), generator=gen), torch.rand(n, k // group, generator=gen) * 0.01,
             torch.rand(n, k // group, generator=gen) * 0.01 if asymmetric else None, group)
    scratch = torch.empty(n, k, dtype=torch.bfloat16)
    dense_wins = []
    for m in rows:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        c_product = _best_of(lambda x=x, out=out: gemm(x, w, None, out))
        dense = _best_of(lambda x=x: torch.matmul(x, gemm.dequantize(w, scratch).t()))
        dense_wins.append(dense < MARGIN * c_product)
    for i, m in enumerate(rows):
        if all(dense_wins[i:]):
            return m
    return None


def _cache_file(shapes: list[Shape], threads: int) -> Path:
    from lmfoundry.kernels.cpu.build import HERE, _cpu_flags
    from lmfoundry.resources import cache_dir

    source = (HERE / "int4_gemm.c").read_bytes()
    key = json.dumps([sorted(shapes), threads, torch.__version__, _cpu_flags(),
                      hashlib.sha256(source).hexdigest()], sort_keys=True)
    return cache_dir() / "cpu-crossover" / f"int4-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def int4_dense_rows(shapes: list[Shape], gemm: Any) -> dict[Shape, int | None]:
    """Per weight shape, the rows from which a step dequantizes and runs the CPU's GEMM (None:
    never): the override, else the cached measurement, else measured now and cached."""
    override = os.environ.get(ENV)
    if override is not None:
        if override.strip().lower() == "never":
            return {s: None for s in shapes}
        try:
            rows = int(override)
        except ValueError:
            raise ValueError(f"{ENV}={override!r}: expected `never` or a number of rows") from None
        return {s: max(1, rows) for s in shapes}
    shapes = sorted(set(shapes))
    threads = torch.get_num_threads()
    path = _cache_file(shapes, threads)
    try:
        found = json.loads(path.read_text())
        return {tuple(s): r for s, r in found["crossover"]}  # type: ignore[misc]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    t0 = time.perf_counter()
    result = {s: measure(s, gemm) for s in shapes}
    log.info("4-bit linears: dequantize-then-GEMM from %s rows (measured in %.1f s on %d threads)",
             {f"{n}x{k}": r for (n, k, _, _), r in result.items()}, time.perf_counter() - t0, threads)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"crossover": [[list(s), r] for s, r in result.items()]}))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache: measured again next start
        log.warning("cannot cache the 4-bit crossover in %s (%s)", path.parent, exc.strerror or exc)
    return result
