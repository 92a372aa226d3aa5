"""The ranks' all-reduce and gather: every rank gets the same bits, the shared-memory sum is the
rank-order sum exactly (gloo's within its reduction order), tensors larger than a slot go through
in pieces, and a lost rank is an error on the others, not a hang."""

from __future__ import annotations

import multiprocessing
import tempfile
import time
from pathlib import Path

import pytest
from helpers import collectives_rank

from lmfoundry.runtime.engine.collectives import SLOT_BYTES, ShmCollectives

# 1 element, a decode step's hidden row, one that is not a multiple of anything, and more than a
# slot (3 pieces of float32)
SIZES = [1, 576, 12345, SLOT_BYTES // 4 * 2 + 77]


def _run(backend: str, world: int, sizes: list[int], early: int | None = None) -> dict[int, list]:
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        if backend == "shm":
            ShmCollectives(Path(folder) / "collectives", 0, world, create=True).close()
        queue = ctx.Queue()
        procs = [ctx.Process(target=collectives_rank,
                             args=(backend, folder, r, world, sizes, queue, r == early, 60.0 if early is None else 3.0))
                 for r in range(world)]
        for p in procs:
            p.start()
        want = world - (early is not None)
        results = dict(queue.get(timeout=300) for _ in range(want))
        for p in procs:
            p.join(timeout=60)
        return results


@pytest.mark.parametrize("backend,world", [("shm", 3), ("gloo", 2)])
def test_all_reduce_and_gather(backend: str, world: int) -> None:
    sizes = SIZES if backend == "shm" else SIZES[:3]
    results = _run(backend, world, sizes)
    assert sorted(results) == list(range(world))
    per_rank = [results[r] for r in range(world)]
    for entries in zip(*per_rank, strict=True):
        kind = entries[0][0]
        if kind == "gather":
            assert all(e[3] for e in entries), entries
            continue
        _, n, dtype, _, _ = entries[0]
        errors = [e[3] for e in entries]
        # shm sums in rank order, as the expectation does; gloo in its own order: at most one
        # rounding of the dtype per addition (inputs are positive, so no cancellation)
        bound = 0.0 if backend == "shm" else (world - 1) * (2**-8 if "bfloat16" in dtype else 2**-23)
        assert max(errors) <= bound, (backend, n, dtype, errors)
        assert len({e[4] for e in entries}) == 1, f"ranks disagree on the bits of a {n}-element {dtype} sum"


@pytest.mark.gpu
def test_nccl_all_reduce_and_gather_between_two_gpus() -> None:
    """torch.distributed's NCCL backend through the same interface (the GPU ranks' collectives)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    results = _run("nccl", 2, SIZES[:3])
    for entries in zip(results[0], results[1], strict=True):
        if entries[0][0] == "gather":
            assert all(e[3] for e in entries), entries
        else:  # NCCL's ring order: at most one rounding per addition; every rank the same bits
            bound = 2**-8 if "bfloat16" in entries[0][2] else 2**-23
            assert max(e[3] for e in entries) <= bound and len({e[4] for e in entries}) == 1, entries


def test_a_lost_rank_is_an_error_not_a_hang() -> None:
    t0 = time.monotonic()
    results = _run("shm", 3, [8], early=2)
    assert time.monotonic() - t0 < 60
    for rank in (0, 1):
        assert results[rank][-1][0] == "lost", results[rank]
