"""Where a quantized linear's step is faster as dequantize-then-GEMM than as its packed product,
measured on the machine that serves: our C product, or PyTorch's int4pack / int8pack kernel where
there is none (no AVX-512 BF16, or a block the C product does not take).

The C products (`runtime/cpu/native/int4_gemm.c`, `int8_gemm.c`) widen the codes once per block of 8 rows
and multiply with AVX-512 BF16 dot products; the CPU's own GEMM (oneDNN) multiplies a dense bf16
weight, with AMX tiles where the CPU has them. Which one a step of M rows should take depends on
the CPU: on AVX-512 BF16 alone the C product keeps up at every M; with AMX, a long prompt chunk
computes several times faster as one dequantization plus an AMX GEMM. So the crossover is timed
here on each distinct linear of the model (its own weights, random rows), once per weight shape,
thread count, CPU, torch version and kernel source, and kept in the cache (`cpu-crossover/`): a
server pays the measurement (a few timed calls per shape and path) on its first start only.

The same goes for the one-pass SiLU(gate) * up (`runtime/cpu/native/norm_act.c`): from how many elements
it beats PyTorch's two ops depends on the CPU's per-call costs, so it is timed and cached per MLP
width too (`set_silu_mul_from`).

`LMFOUNDRY_CPU_SILU_FROM` (`never` or a number of elements) overrides the SiLU pass's;
`LMFOUNDRY_CPU_DENSE_ROWS` overrides the linears' crossover: `never` (the C product for every step: every row then
computes alike whatever its batch, which deterministic serving needs) or a row count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

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
    return _wins_from(rows, dense_wins)


def _wins_from(rows: tuple[int, ...], wins: list[bool]) -> int | None:
    """The fewest of `rows` from which the timed path won at that count and every larger one."""
    for i, m in enumerate(rows):
        if all(wins[i:]):
            return m
    return None


def _override(env: str, unit: str, least: int) -> tuple[int | None] | None:
    """(value,) that `env` sets instead of a measurement (None inside: `never`); None where it
    is unset."""
    value = os.environ.get(env)
    if value is None:
        return None
    if value.strip().lower() == "never":
        return (None,)
    try:
        return (max(least, int(value)),)
    except ValueError:
        raise ValueError(f"{env}={value!r}: expected `never` or a number of {unit}") from None


def _cached(name: str, key: list[Any], compute: Callable[[], Any]) -> Any:
    """`compute()`'s JSON-able answer for `key`, kept in the cache (`cpu-crossover/`) together
    with this CPU's flags and torch's version, so a server measures on its first start only; a
    read-only cache means measuring again next start. The file records the whole key and is used
    only for it: its name holds a prefix of the key's digest, and a file swapped or copied in
    from another machine's cache would otherwise hand this one another CPU's crossover."""
    from lmfoundry.resources import cache_dir
    from lmfoundry.runtime.cpu.native.build import _cpu_flags
    from lmfoundry.staging import stage_path, sweep_dead_stages

    text = json.dumps([name, key, torch.__version__, _cpu_flags()], sort_keys=True)
    path = cache_dir() / "cpu-crossover" / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"
    try:
        data = json.loads(path.read_text())
        if data["key"] == text:
            return data["answer"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    answer = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep_dead_stages(path.parent)
        tmp = stage_path(path)
        tmp.write_text(json.dumps({"key": text, "answer": answer}))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot cache the crossover in %s (%s)", path.parent, exc.strerror or exc)
    return answer


def _sources(*names: str) -> list[str]:
    """sha256 of the C sources a measurement depends on: an edited kernel is measured again."""
    from lmfoundry.runtime.cpu.native.build import HERE

    return [hashlib.sha256((HERE / name).read_bytes()).hexdigest() for name in names]


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
    override = _override(ENV, "rows", 1)
    if override is not None:
        return {s: override[0] for s in shapes}
    threads = torch.get_num_threads()

    def compute() -> list[list[Any]]:
        t0 = time.perf_counter()
        result = {s: measure(sample[s]) for s in shapes}
        log.info("quantized linears: dequantize-then-GEMM from %s rows (measured in %.1f s on %d threads)",
                 {f"{kind} {n}x{k}": r for (kind, n, k, _, _), r in result.items()}, time.perf_counter() - t0,
                 threads)
        return [[list(s), r] for s, r in result.items()]

    key = [sorted(shapes), threads, _sources("int4_gemm.c", "int8_gemm.c", "weight_only.h")]
    return {tuple(s): r for s, r in _cached("linears", key, compute)}  # type: ignore[misc]


SILU_ENV = "LMFOUNDRY_CPU_SILU_FROM"  # `never` or a number of elements: instead of the measurement
SILU_ROWS = (1, 2, 4, 8, 16, 32, 64)  # decode-sized steps: above them the one pass always wins


def measure_silu_mul(kernel: Any, width: int, rows: tuple[int, ...] = SILU_ROWS) -> int | None:
    """The fewest elements of SiLU(gate) * up (gate and up [rows, width], views of one fused
    product as the MLP gets them) from which the one-pass C kernel beats PyTorch's two ops by
    MARGIN, at that row count and every larger one measured (None: never). Below it a ctypes
    call costs more than the two ops it replaces, by how much depending on the CPU."""
    from lmfoundry.runtime.cpu.native.norm_act import silu_mul_reference

    gen = torch.Generator().manual_seed(0)
    wins = []
    for m in rows:
        gate, up = torch.randn(m, 2 * width, generator=gen).to(torch.bfloat16).split(width, dim=-1)
        one_pass = _best_of(partial(kernel.silu_mul, gate, up), reps=50, budget=0.05)
        two_ops = _best_of(partial(silu_mul_reference, gate, up), reps=50, budget=0.05)
        wins.append(one_pass < MARGIN * two_ops)
    found = _wins_from(rows, wins)
    return None if found is None else found * width


def set_silu_mul_from(model: nn.Module) -> dict[int, int | None]:
    """Give each MLP's one-pass SiLU(gate) * up (`NativeSiluMul`) the size from which it runs,
    measured on this machine per MLP width (cached); returns the table by width. Below it the
    MLP's own PyTorch ops run."""
    from lmfoundry.model.reference import MLP
    from lmfoundry.runtime.cpu.elementwise import NativeSiluMul

    acts = [(m.act_mul, int(m.down_proj.in_features)) for m in model.modules()
            if isinstance(m, MLP) and isinstance(m.act_mul, NativeSiluMul)]
    threads = torch.get_num_threads()
    table: dict[int, int | None] = {}
    override = _override(SILU_ENV, "elements", 0)
    for act, width in acts:
        if override is not None:
            table[width] = override[0]
        elif width not in table:
            def compute(act: Any = act, width: int = width) -> int | None:
                found = measure_silu_mul(act.kernel, width)
                log.info("SiLU(gate) * up of width %d: one C pass from %s elements", width, found)
                return found

            table[width] = _cached("silu-mul", [width, threads, _sources("norm_act.c")], compute)
        found = table[width]
        act.min_elements = sys.maxsize if found is None else found
    return table
