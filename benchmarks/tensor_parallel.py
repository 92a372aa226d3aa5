"""What one collective of a tensor-parallel step costs on this machine: gloo (torch.distributed over
TCP) against the shared-memory all-reduce `serve --tp` uses by default.

    python benchmarks/tensor_parallel.py --out benchmarks/results/tensor_parallel_collectives

Each backend runs `--ranks` processes of one thread each, which all-reduce a bfloat16 tensor of
the shape a decode step sums (batch rows x hidden) `--iters` times after a warm-up, and gather the
vocabulary-parallel logits (rows x vocab / ranks, float32). Backends alternate (A B A B) for
`--rounds` rounds so a drift of the machine's load shows; the table gives the median round and
each round's value, and the cost of the collectives of one decode step of a `--layers`-layer model
(2 all-reduces per layer, one for the embedding, one gather) beside it. The serving comparison (TP N x
1 thread against TP 1 x N threads under the same load) is serve_peers' job:

    python benchmarks/serve_peers.py --peers ours,ours-tp3 --out benchmarks/results/serve_tp.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _rank(backend: str, folder: str, rank: int, world: int, shapes: list[tuple[int, int]], vocab: int, iters: int,
          queue: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from lmfoundry.runtime.engine.collectives import open_collectives

    comm = open_collectives(backend, Path(folder), rank, world, timeout=120.0)
    out: dict[str, float] = {}
    for rows, hidden in shapes:
        x = torch.randn(rows, hidden).to(torch.bfloat16)
        logits = torch.randn(rows, vocab // world)
        for name, op, t in ((f"all_reduce {rows}x{hidden} bf16", comm.all_reduce, x),
                            (f"gather {rows}x{vocab // world} fp32", comm.gather, logits)):
            for _ in range(max(10, iters // 10)):
                op(t.clone())
            t0 = time.perf_counter()
            for _ in range(iters):
                op(t)
            out[name] = (time.perf_counter() - t0) / iters * 1e6
    queue.put((rank, out))
    comm.close()


def run_backend(backend: str, world: int, shapes: list[tuple[int, int]], vocab: int, iters: int) -> dict[str, float]:
    """Microseconds per collective (rank 0's clock) for one backend."""
    from lmfoundry.runtime.engine.collectives import ShmCollectives

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as folder:
        if backend == "shm":
            ShmCollectives(Path(folder) / "collectives", 0, world, create=True).close()
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(backend, folder, r, world, shapes, vocab, iters, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=600) for _ in range(world))
        for p in procs:
            p.join(timeout=60)
    return results[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=576, help="hidden size (SmolLM2: 576)")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary (SmolLM2: 49152)")
    p.add_argument("--layers", type=int, default=30, help="decoder layers, for the per-step cost (SmolLM2: 30)")
    p.add_argument("--rows", default="1,32", help="batch rows of the summed tensors")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = p.parse_args()
    shapes = [(int(r), args.hidden) for r in args.rows.split(",")]
    backends = ("gloo", "shm")
    rounds: dict[str, list[dict[str, float]]] = {b: [] for b in backends}
    for rnd in range(args.rounds):
        for b in backends:  # A B A B
            rounds[b].append(run_backend(b, args.ranks, shapes, args.vocab, args.iters))
            print(f"round {rnd + 1} {b}: " + ", ".join(f"{k} {v:.1f} us" for k, v in rounds[b][-1].items()), flush=True)
    names = list(rounds["shm"][0])
    med = {b: {n: statistics.median(r[n] for r in rounds[b]) for n in names} for b in backends}
    lines = [f"# Collectives of a tensor-parallel step: gloo vs shared memory ({args.ranks} ranks x 1 thread)", "",
             f"{args.iters} iterations a round, {args.rounds} rounds (gloo, shm alternating); median round, "
             "then every round's value, in microseconds per collective on rank 0.", "",
             "| collective | gloo | shm | gloo / shm | gloo rounds | shm rounds |", "|---|---|---|---|---|---|"]
    for n in names:
        lines.append(f"| {n} | {med['gloo'][n]:.1f} | {med['shm'][n]:.1f} | {med['gloo'][n] / med['shm'][n]:.1f}x | "
                     f"{', '.join(f'{r[n]:.0f}' for r in rounds['gloo'])} | "
                     f"{', '.join(f'{r[n]:.0f}' for r in rounds['shm'])} |")
    lines += ["", f"Per decode step of a {args.layers}-layer model ({2 * args.layers + 1} all-reduces and one gather), "
              "collectives alone:", "", "| batch rows | gloo ms | shm ms |", "|---|---|---|"]
    step: dict[str, dict[int, float]] = {b: {} for b in backends}
    for rows, hidden in shapes:
        for b in backends:
            step[b][rows] = ((2 * args.layers + 1) * med[b][f"all_reduce {rows}x{hidden} bf16"]
                             + med[b][f"gather {rows}x{args.vocab // args.ranks} fp32"]) / 1000
        lines.append(f"| {rows} | {step['gloo'][rows]:.2f} | {step['shm'][rows]:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "rounds": rounds, "median": med, "step_ms": step},
                                                            indent=2))


if __name__ == "__main__":
    main()
