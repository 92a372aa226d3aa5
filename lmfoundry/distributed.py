"""Data-parallel calibration: the ranks of a `torchrun` job and the reductions statistics need.

`torchrun --nproc-per-node N --no-python lmfoundry quantize ...` starts N copies of the command.
Each rank calibrates on its own share of the calibration batches (`Ranks.shard`), and every
statistic a quantizer reads — GPTQ/AWQ input second moments, activation absmax, KV absmax, the
SmoothQuant row sample — is reduced across ranks at the moment it is first read, so every rank
quantizes from the statistics of *all* samples and computes the same codes; rank 0 alone writes
the checkpoint. Because every rank runs the same layers and groups in the same order, the
collectives match without any coordination beyond the reads themselves.

A single process is a world of one: every reduction is the identity, nothing is imported from
`torch.distributed`, and the output is byte-identical to the code before data parallelism.
Backends: gloo for `--device cpu`, NCCL for `--device cuda`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

import torch

T = TypeVar("T")


@dataclass
class Ranks:
    """This process's place in the job (rank 0 of 1 outside torchrun)."""

    rank: int = 0
    world_size: int = 1
    backend: str | None = None

    @property
    def writer(self) -> bool:
        """Whether this rank writes files (rank 0)."""
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce `t` in place by summation (identity for one process)."""
        if self.parallel:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce `t` in place by elementwise maximum."""
        if self.parallel:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def sum_number(self, x: float) -> float:
        """A Python number summed over ranks (token counts, error sums)."""
        if not self.parallel:
            return x
        t = torch.tensor([float(x)], dtype=torch.float64, device=self._collective_device())
        return float(self.sum_(t).item())

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """The rows of `t` [N, C] of every rank, concatenated in rank order (N may differ)."""
        if not self.parallel:
            return t
        parts = self.all_objects(t.cpu())
        return torch.cat([p.to(t.device) for p in parts])

    def all_objects(self, obj: T) -> list[T]:
        """One picklable object from every rank, in rank order."""
        if not self.parallel:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's value of a picklable object, on every rank."""
        if not self.parallel:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.parallel:
            import torch.distributed as dist

            dist.barrier()

    def shard(self, batches: Sequence[T]) -> list[T]:
        """This rank's contiguous share of `batches` (sizes differ by at most one), so that with
        N batches divisible by the world size the batches are the single-process run's."""
        n, w = len(batches), self.world_size
        lo, hi = self.rank * n // w, (self.rank + 1) * n // w
        return list(batches[lo:hi])

    def _collective_device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


_current = Ranks()


def ranks() -> Ranks:
    """The ranks of the running job (a world of one unless `init_from_environment` joined one)."""
    return _current


def launched_world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 when not launched by torchrun)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def init_from_environment(device: torch.device) -> Ranks:
    """Join the process group torchrun describes in the environment (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT): gloo on CPU, NCCL on CUDA, where each rank takes the GPU of its
    LOCAL_RANK. A process not started by torchrun stays a world of one."""
    global _current
    if launched_world_size() == 1 or _current.parallel:
        return _current
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    _current = Ranks(dist.get_rank(), dist.get_world_size(), backend)
    return _current


def shutdown() -> None:
    """Leave the process group (after the last collective), back to a world of one."""
    global _current
    if _current.parallel:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _current = Ranks()
