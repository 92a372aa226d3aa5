"""What `compile --tp N` costs and gives against `--tp 1`, built in the same run from the same
checkpoint: build time, kernel specializations (per rank and in all), and the weight bytes each
rank's bundle holds (what one GPU of the deployment must load) as a ratio of the single bundle.

    python benchmarks/compile_tp.py CHECKPOINT --arch hopper --tp 3 --out benchmarks/results/compile_tp_smollm2

The builds alternate (tp 1, tp N, tp 1, tp N for `--rounds 2`) so a drift of the machine's load
shows in the times; sizes and kernel counts do not vary between rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def weight_bytes(bundle: Path) -> int:
    from lmfoundry.engine_bundle.engine_manifest import own_weights

    return sum(p.stat().st_size for p in own_weights(bundle).iterdir() if p.is_file())


def build(checkpoint: str, arch: str, tp: int, out: Path) -> dict:
    from lmfoundry.compile.bundle import build_engine

    t0 = time.perf_counter()
    result = build_engine(checkpoint, [arch], out, progress=False, tp=tp)
    seconds = time.perf_counter() - t0
    ranks = [r.output for r in result.ranks] if result.ranks else [out]
    return {"tp": tp, "seconds": round(seconds, 1), "kernels": len(result.kernels),
            "kernels_per_rank": [len(r.kernels) for r in result.ranks] or [len(result.kernels)],
            "rank_weight_bytes": [weight_bytes(r) for r in ranks]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--arch", default="hopper")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="compile-tp-") as tmp:
        for r in range(args.rounds):
            for tp in (1, args.tp):
                runs.append(build(args.checkpoint, args.arch, tp, Path(tmp) / f"r{r}-tp{tp}"))
                print(json.dumps(runs[-1]), flush=True)
    base = next(x for x in runs if x["tp"] == 1)
    lines = [f"# `compile --tp` on {Path(args.checkpoint).name} ({args.arch})", "",
             f"Command: `python benchmarks/compile_tp.py {args.checkpoint} --arch {args.arch} --tp {args.tp} "
             f"--rounds {args.rounds}`; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end.", "",
             "| tp | build s (each round) | kernels (per rank) | weight MiB per rank | per rank / tp 1 |",
             "| ---: | --- | --- | --- | --- |"]
    for tp in (1, args.tp):
        mine = [x for x in runs if x["tp"] == tp]
        sizes = mine[0]["rank_weight_bytes"]
        single = base["rank_weight_bytes"][0]
        lines.append(f"| {tp} | {', '.join(str(x['seconds']) for x in mine)} | {mine[0]['kernels']} "
                     f"({', '.join(map(str, mine[0]['kernels_per_rank']))}) | "
                     f"{', '.join(f'{b / 2**20:.1f}' for b in sizes)} | "
                     f"{', '.join(f'{b / single:.3f}' for b in sizes)} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(runs, indent=1) + "\n")
        Path(args.out + ".md").write_text(table)


if __name__ == "__main__":
    main()
