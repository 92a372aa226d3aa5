"""A tensor-parallel engine: rank 0 in the engine process, ranks 1..N-1 in worker processes.

Rank 0 (the process that schedules) starts the workers, loads its own share of the model and
waits until every worker has loaded its share (`lmfoundry.model.tensor_parallel` says which
slice of each weight a rank holds). From then on every call that runs the model is mirrored:
rank 0 sends the call (the step's flat inputs, the hidden rows to project, a batch of windows)
to every worker over its pipe, then makes it itself; the ranks meet in the model's collectives
(an all-reduce per attention and MLP block, the vocabulary gather) and each keeps its own paged
KV cache for its KV heads. The scheduler, sampler and everything else run once, on rank 0.

Failure: a worker that raises exits (its peers' next collective sees it gone); rank 0 checks its
workers while it waits in a collective and before each call, and raises `RankLost`, which the
engine process treats as fatal (the API process then answers 503 and exits). A worker whose rank
0 is gone finds its pipe closed and exits.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmfoundry.errors import UserError
from lmfoundry.model.tensor_parallel import RankShard, resident_bytes
from lmfoundry.runtime.engine.collectives import BACKENDS, RankLost, ShmCollectives, open_collectives

log = logging.getLogger("lmfoundry.engine")
START_TIMEOUT = 1800.0  # seconds a worker may take to load its share


@dataclass(frozen=True)
class ShardSpec:
    """What every rank needs to load its share: the model, its execution dtype, the degree, the
    intra-op threads of each rank, the collectives backend and the device type (on "cuda", rank
    r runs on GPU r and the ranks meet through NCCL)."""

    model: str
    dtype: torch.dtype | None
    tp: int
    threads: int | None = None
    backend: str = "shm"
    timeout: float = 600.0
    device: str = "cpu"

    @classmethod
    def on(cls, model: str, dtype: torch.dtype | None, tp: int, threads: int | None, device: str | torch.device,
           backend: str = "shm") -> "ShardSpec":
        """The spec for ranks on `device`'s type: CPU processes joined by `backend`, or one GPU a
        rank joined by NCCL."""
        gpu = torch.device(device).type == "cuda"
        return cls(model, dtype, tp, threads, "nccl" if gpu else backend, device="cuda" if gpu else "cpu")

    def rank_device(self, rank: int) -> str:
        return "cpu" if self.device == "cpu" else f"cuda:{rank}"


def _shm_folder() -> str:
    """/dev/shm where it exists (the segment then never touches a disk), else the temp folder."""
    return tempfile.mkdtemp(prefix="lmfoundry-tp-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def _load_share(spec: ShardSpec, rank: int, folder: Path, alive: Any) -> tuple[Any, Any, Any]:
    from lmfoundry.runtime.loader import load_model, whole_model_config

    if spec.threads:
        torch.set_num_threads(spec.threads)
    config = whole_model_config(spec.model)
    shard = RankShard(config, rank, spec.tp)
    comm = open_collectives(spec.backend, folder, rank, spec.tp, spec.timeout, alive)
    model, tokenizer = load_model(spec.model, dtype=spec.dtype, shard=shard, comm=comm, device=spec.rank_device(rank))
    return model, tokenizer, comm


def rank_executor(model: Any, config: Any) -> Any:
    """A rank's executor over its share: the bundle's kernels for a `KernelModel` (without CUDA
    graphs: a captured step would replay without its collectives), else the reference path."""
    from lmfoundry.runtime.engine.executor import local_executor

    return local_executor(model, dataclasses.replace(config, cuda_graphs=False))


def worker_main(spec: ShardSpec, rank: int, folder: str, conn: Any, parent_pid: int) -> None:
    """A worker rank: load its share, say so, then make every call rank 0 sends until "stop" or
    until its pipe closes (rank 0 gone). Any failure ends the process with status 1."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    # SIGTERM to every process of the service at once: rank 0 may get no chance to clean up
    signal.signal(signal.SIGTERM, lambda signum, _frame: _leave(folder, 128 + signum))

    def parent_alive() -> str | None:
        return None if os.getppid() == parent_pid else "rank 0 is gone"

    try:
        model, _tokenizer, comm = _load_share(spec, rank, Path(folder), parent_alive)
    except UserError as exc:
        conn.send(("failed", str(exc)))
        os._exit(1)
    except BaseException as exc:  # noqa: BLE001 - a bug: traceback to stderr, one line to rank 0
        traceback.print_exc()
        conn.send(("failed", f"rank {rank} could not load its share: {type(exc).__name__}: {exc}"))
        os._exit(1)
    conn.send(("ready", resident_bytes(model)))
    targets: dict[str, Any] = {"model": model}
    try:
        with torch.inference_mode():
            while True:
                try:
                    op = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    break
                if op[0] == "stop":
                    break
                if op[0] == "executor":
                    targets["executor"] = rank_executor(model, op[1])
                    continue
                _, target, method, args = op
                getattr(targets[target], method)(*args)
    except RankLost as exc:
        log.warning("tensor-parallel rank %d stops: %s", rank, exc)
        _leave(folder, 1)
    except BaseException:  # noqa: BLE001 - the peers see this rank gone and fail the step
        traceback.print_exc()
        if hasattr(comm, "abort"):
            comm.abort()
        _leave(folder, 1)
    _leave(folder, 0)


def _leave(folder: str, code: int) -> None:
    """End a worker, removing the group's shared-memory folder: when rank 0 was killed nobody
    else would, and it would stay in /dev/shm until reboot. (Whether rank 0 is gone cannot be
    read from getppid here: its pipe closes before the kernel re-parents its children.) Ranks
    still running keep their mappings of the removed files; rank 0's own removal ignores it."""
    shutil.rmtree(folder, ignore_errors=True)
    os._exit(code)


class TensorParallelGroup:
    """Rank 0's side of the group: the workers, their pipes and rank 0's collectives."""

    def __init__(self, spec: ShardSpec) -> None:
        if spec.backend not in BACKENDS:
            raise UserError(f"--tp-backend {spec.backend!r}: use one of {', '.join(BACKENDS)}")
        from lmfoundry.checkpoint.sources import resolve_model
        from lmfoundry.runtime.loader import is_engine_bundle, whole_model_config

        if not is_engine_bundle(spec.model):  # once, before the ranks read it
            spec = dataclasses.replace(spec, model=str(resolve_model(spec.model)))
        self.config = whole_model_config(spec.model)  # the whole model's (a rank's own may be its share's)
        RankShard(self.config, 0, spec.tp).heads  # noqa: B018 - refuse a bad --tp first
        self.spec = spec
        self.folder = Path(_shm_folder())
        self._closed = False
        ctx = multiprocessing.get_context("spawn")  # never fork a process holding OpenMP pools
        self.workers: list[Any] = []
        self.pipes: list[Any] = []
        if spec.backend == "shm":  # created before any worker opens it
            ShmCollectives(self.folder / "collectives", 0, spec.tp, create=True).close()
        self._finalizer = weakref.finalize(self, _cleanup, self.workers, self.pipes, str(self.folder))
        for rank in range(1, spec.tp):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, rank, str(self.folder), theirs, os.getpid()),
                               name=f"lmfoundry-tp-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            self.workers.append(proc)
            self.pipes.append(mine)
        try:
            self.model, self.tokenizer, self.comm = _load_share(spec, 0, self.folder, self.lost)
            self.resident = [resident_bytes(self.model)] + self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> list[int]:
        sizes = []
        for rank, (proc, pipe) in enumerate(zip(self.workers, self.pipes, strict=True), start=1):
            if not pipe.poll(START_TIMEOUT):
                raise UserError(f"tensor-parallel rank {rank} did not load its share in {START_TIMEOUT:.0f} s")
            try:
                status, value = pipe.recv()
            except EOFError:
                raise UserError(f"tensor-parallel rank {rank} died while loading (exit code {proc.exitcode})") from None
            if status != "ready":
                raise UserError(value)
            sizes.append(int(value))
        return sizes

    def lost(self) -> str | None:
        """Why the group is broken (a worker ended), or None."""
        for rank, proc in enumerate(self.workers, start=1):
            if proc.exitcode is not None:
                return f"tensor-parallel rank {rank} ended (exit code {proc.exitcode})"
        return None

    def send(self, *op: Any) -> None:
        """Send one call to every worker (before rank 0 makes it)."""
        why = self.lost()
        if why is not None:
            raise RankLost(why)
        data = pickle.dumps(op, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for pipe in self.pipes:
                pipe.send_bytes(data)
        except OSError as exc:
            raise RankLost(f"a tensor-parallel rank is gone ({exc})") from exc

    def abandon(self) -> None:
        """The group is broken (a rank was lost) and this process is about to exit: kill what is
        left of it and remove the shared memory now, without waiting for anyone."""
        self._closed = True
        for proc in self.workers:
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pipe in self.pipes:
            try:
                pipe.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass
        comm = getattr(self, "comm", None)
        if comm is not None:
            comm.close()
        self._finalizer()


def _cleanup(workers: list[Any], pipes: list[Any], folder: str) -> None:
    for proc in workers:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    for pipe in pipes:
        pipe.close()
    shutil.rmtree(folder, ignore_errors=True)


class ShardedModel:
    """Rank 0's handle on a tensor-parallel model: calling it (whole sequences, as perplexity
    does) runs the forward on every rank; rank 0 gets the full logits. `local` is rank 0's
    share, `group` the processes."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.local = group.model
        self.config = group.config

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def tp(self) -> int:
        return self.group.spec.tp

    def run(self, target: Any, name: str, method: str, *args: Any) -> Any:
        # tensors travel through host memory (each rank moves them to its own device)
        self.group.send("call", name, method, tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
        return getattr(target, method)(*args)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.run(self.local, "model", "forward", input_ids, positions)

    def close(self) -> None:
        self.group.close()

    def abandon(self) -> None:
        self.group.abandon()


def load_sharded(spec: ShardSpec) -> tuple[ShardedModel, Any]:
    """(rank 0's handle, tokenizer) of a model split over `spec.tp` ranks."""
    group = TensorParallelGroup(spec)
    return ShardedModel(group), group.tokenizer


class TensorParallelExecutor:
    """The engine's executor over a `ShardedModel`: rank 0's `ReferenceModelExecutor` on its
    share, each call mirrored on the workers' own executors (each with its own KV cache)."""

    name = "tensor-parallel"

    def __init__(self, model: ShardedModel, config: Any) -> None:
        if getattr(model.local, "compiled_step", None) is not None:
            raise UserError("a compiled CPU step runs on one rank; drop --compile-step or --tp")
        if config.deterministic:
            raise UserError("--deterministic runs one process; drop --tp (the ranks' partial sums are not "
                            "batch-invariant yet)")
        self.sharded = model
        model.group.send("executor", config)
        self.local = rank_executor(model.local, config)
        self.model = model.local
        self.config = self.local.config
        self.dtype = self.local.dtype
        self.context_limit = self.local.context_limit

    @property
    def cache(self) -> Any:
        return self.local.cache

    def kv_bytes_per_token(self) -> int:
        return self.local.kv_bytes_per_token()

    def allocate(self, num_blocks: int) -> None:
        self.sharded.run(self.local, "executor", "allocate", num_blocks)

    def forward(self, step: Any) -> torch.Tensor:
        return self.sharded.run(self.local, "executor", "forward", step)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.sharded.run(self.local, "executor", "logits", hidden.contiguous())
