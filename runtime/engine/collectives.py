"""The collectives of a tensor-parallel engine on CPU: all-reduce and gather between the ranks.

Two implementations of one interface (`lmfoundry.model.tensor_parallel.Collectives`):
- `DistributedCollectives`: torch.distributed, gloo (TCP between CPU ranks) or NCCL (GPUs).
- `ShmCollectives` (the default on CPU): every rank writes its tensor into its slot of a shared
  memory segment, bumps its sequence counter, waits until every counter has reached the same
  sequence, and sums the slots in rank order, so every rank computes the same bits. Two slot
  sets alternate by sequence parity: a rank can write the next collective's slot while a slower
  one still reads the last, never the one after (that would need the slower rank's counter).
  A rank waits by spinning, then yielding the CPU (at once when there are more ranks than
  cores); it checks its peers (a dead process, an
  abort flag, a timeout) while it waits, so a lost rank is an error, not a hang.

Why not gloo alone: a decode step of a 30-layer model makes 61 collectives of a few KB, and on
this project's CPU machines gloo's round trip costs far more than the step's arithmetic
(`benchmarks/tensor_parallel.py` measures both). vLLM's CPU backend made the same choice.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable

import torch

from lmfoundry.runtime.engine.client import EngineDead

SLOT_BYTES = 8 << 20  # per rank and parity; a larger tensor goes through in pieces
SPINS_BEFORE_YIELD = 2000
CHECK_EVERY = 256  # yields between liveness checks


class RankLost(EngineDead):
    """A peer rank died, timed out or aborted: the tensor-parallel group cannot go on, so the
    engine stops (the API process answers 503 and exits)."""


class ShmCollectives:
    """All-reduce and gather over a shared-memory file of `world_size` slots (see the module doc).

    `alive()` is called while waiting: it returns None, or why the group is broken."""

    def __init__(self, path: str | Path, rank: int, world_size: int, create: bool = False,
                 timeout: float = 600.0, alive: Callable[[], str | None] | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        # more ranks than cores: a spinning rank holds the core a computing one needs, so yield at once
        self.spins = SPINS_BEFORE_YIELD if world_size <= len(os.sched_getaffinity(0)) else 0
        self.path = Path(path)
        self.timeout = timeout
        self.alive = alive or (lambda: None)
        header = 64 + world_size  # counters [world] + abort flag, int64
        size = header * 8 + 2 * world_size * SLOT_BYTES
        if create:
            with open(self.path, "wb") as f:
                f.truncate(size)
        raw = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.uint8)
        self._raw = raw
        words = raw[: header * 8].view(torch.int64)
        self.counters = words[:world_size]
        self.flag = words[world_size : world_size + 1]
        # numpy views of the same memory: a wait polls them far more cheaply than torch ops can
        self._counters_np = self.counters.numpy()
        self._flag_np = self.flag.numpy()
        self.slots = raw[header * 8 :]
        self.seq = int(self.counters[rank])

    def abort(self) -> None:
        """Make every rank's wait fail (a rank that gives up tells the others)."""
        self.flag[0] = 1

    def _slot(self, parity: int, rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        at = (parity * self.world_size + rank) * SLOT_BYTES
        return self.slots[at : at + n * torch.empty((), dtype=dtype).element_size()].view(dtype)

    def _wait(self) -> None:
        deadline = time.monotonic() + self.timeout
        spins = 0
        counters, flag, seq = self._counters_np, self._flag_np, self.seq
        while counters.min() < seq:
            if flag[0]:
                raise RankLost("another rank aborted the tensor-parallel group")
            spins += 1
            if spins < self.spins:
                continue
            os.sched_yield()
            if spins % CHECK_EVERY == 0:
                why = self.alive()
                if why is not None:
                    self.abort()
                    raise RankLost(why)
                if time.monotonic() > deadline:
                    self.abort()
                    raise RankLost(f"no answer from a peer rank in {self.timeout:.0f} s")

    def _exchange(self, x: torch.Tensor, combine: Callable[[list[torch.Tensor], slice], None]) -> None:
        flat = x.view(-1)
        per = SLOT_BYTES // x.element_size()
        for lo in range(0, max(flat.numel(), 1), per):
            piece = slice(lo, min(lo + per, flat.numel()))
            n = piece.stop - piece.start
            self.seq += 1
            parity = self.seq % 2
            self._slot(parity, self.rank, x.dtype, n).copy_(flat[piece])
            self.counters[self.rank] = self.seq  # after the copy: x86 keeps stores in order
            self._wait()
            combine([self._slot(parity, r, x.dtype, n) for r in range(self.world_size)], piece)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        assert x.is_contiguous()
        flat = x.view(-1)

        def total(parts: list[torch.Tensor], piece: slice) -> None:
            out = flat[piece]
            out.copy_(parts[0])
            for p in parts[1:]:
                out.add_(p)

        self._exchange(x, total)
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """On rank 0: the ranks' tensors as views of the shared slots when x fits one slot (no
        copy; valid until this rank's next collective, which is all a caller that concatenates
        them needs: no rank can overwrite a slot before rank 0 has entered the collective after
        next), else copies."""
        if self.world_size == 1:
            return [x]
        assert x.is_contiguous()
        if x.numel() * x.element_size() <= SLOT_BYTES:
            views: list[torch.Tensor] = []

            def keep(parts: list[torch.Tensor], piece: slice) -> None:
                views.extend(p.view(x.shape) for p in parts)

            self._exchange(x, keep)
            return views if self.rank == 0 else None
        outs = [torch.empty_like(x).view(-1) for _ in range(self.world_size)] if self.rank == 0 else []

        def collect(parts: list[torch.Tensor], piece: slice) -> None:
            for out, p in zip(outs, parts, strict=False):  # ranks other than 0 keep nothing (outs empty)
                out[piece].copy_(p)

        self._exchange(x, collect)
        return [o.view(x.shape) for o in outs] if self.rank == 0 else None

    def close(self) -> None:
        del self._raw, self.counters, self.flag, self.slots, self._counters_np, self._flag_np


class DistributedCollectives:
    """torch.distributed's collectives: gloo between CPU ranks, NCCL between GPUs (one per rank,
    `cuda:RANK`). The process group is created here and destroyed by close."""

    def __init__(self, init_method: str, rank: int, world_size: int, timeout: float = 600.0,
                 backend: str = "gloo") -> None:
        import datetime

        import torch.distributed as dist

        if dist.is_initialized():
            raise RankLost("this process already belongs to a torch.distributed group")
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=math.ceil(timeout)))
        self.rank, self.world_size, self.backend = rank, world_size, backend

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        try:
            dist.all_reduce(x)
        except RuntimeError as exc:  # a peer's closed connection or a timeout
            raise RankLost(f"{self.backend} all-reduce failed: {exc}") from exc
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        import torch.distributed as dist

        outs = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        try:
            dist.gather(x, outs, dst=0)
        except RuntimeError as exc:
            raise RankLost(f"{self.backend} gather failed: {exc}") from exc
        return outs

    def abort(self) -> None:
        pass  # a peer sees the connection close when this process exits

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


BACKENDS = ("shm", "gloo")  # of CPU ranks; "nccl" joins GPUs (collectives only: the engine's ranks are CPU ones)


def open_collectives(backend: str, folder: Path, rank: int, world_size: int, timeout: float,
                     alive: Callable[[], str | None] | None = None) -> ShmCollectives | DistributedCollectives:
    """Rank `rank`'s collectives in a group whose rank 0 made `folder` (shm: the segment; gloo: the
    rendezvous file)."""
    if backend == "shm":
        return ShmCollectives(folder / "collectives", rank, world_size, create=False, timeout=timeout, alive=alive)
    if backend in ("gloo", "nccl"):
        return DistributedCollectives(f"file://{folder}/rendezvous", rank, world_size, timeout, backend)
    raise ValueError(f"unknown tensor-parallel backend {backend!r} (known: {', '.join(BACKENDS)})")
