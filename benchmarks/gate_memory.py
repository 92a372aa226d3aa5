"""Peak resident memory and wall time of `lmfoundry eval-gate --tier quick`, beside what
`eval-gate --dry-run` predicted and the issue's bound (the larger model's weights as run + 3 GiB).

For each model: a W4A16 RTN candidate is quantized from it (once, into --workdir), then
`eval-gate CANDIDATE --baseline MODEL --tier quick --no-cache --quiet` runs as a child process.
Its peak is taken two ways: `getrusage(RUSAGE_CHILDREN).ru_maxrss` (the kernel's high-water mark)
and the resident memory of the child's process tree sampled every 0.2 s. Where the memory goes is
read from the report: each model's resident memory at the phase boundaries (loaded, tasks,
perplexity, generation, freed) and the process's high-water mark at each, beside the dry-run's
terms (weights, KV cache, step activations, logits, reference). Anything the run writes to stdout
or stderr besides the verdict lines counts as noise.

    python benchmarks/gate_memory.py --workdir /big/disk --models smollm2-135m,qwen2.5-coder-0.5b
        [--model8b] [--units 1.0] [--out benchmarks/results/gate_memory.md]

`--model8b` adds a random Llama-3-8B-shaped checkpoint (bf16, 32 layers, written into --workdir
once by benchmarks/calibration_scale.py's writer, SmolLM2's tokenizer with the vocabulary padded to
128256). `--units F` scales the quick tier's units (task items, perplexity windows, generation
prompts and tokens) by F, at least one of each: at 8B on 2 cores the whole tier takes hours, and
the peak does not grow with the unit count when the gate streams (two --units values show it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibration_scale import make_model  # noqa: E402

from lmfoundry.child_python import python_command  # noqa: E402

GIB = 2**30
ROOT = Path(__file__).resolve().parent.parent
VERDICT_LINES = ("verdict:", "report:")


def scaled_gate(workdir: Path, units: float) -> tuple[Path, dict[str, int]]:
    """The default gate with its quick tier's units scaled by `units` (at least one of each)."""
    gate = yaml.safe_load((ROOT / "recipes/gates/default.yaml").read_text())
    quick = gate["tiers"]["quick"]
    count = {}
    for name, task in quick["tasks"].items():
        task["limit"] = max(1, math.ceil(task["limit"] * units))
        count[name] = task["limit"]
    quick["perplexity"]["windows"] = max(1, math.ceil(quick["perplexity"]["windows"] * units))
    count["windows"] = quick["perplexity"]["windows"]
    prompts = yaml.safe_load((ROOT / "evals/data/generation.yaml").read_text())
    kinds = {k: v for k, v in prompts.items() if isinstance(v, list)}
    kept = {k: v[: max(1, math.ceil(len(v) * units))] for k, v in kinds.items()}
    prompt_file = workdir / f"prompts-{units:g}.yaml"
    prompt_file.write_text(yaml.safe_dump({**prompts, **kept}, sort_keys=False))
    quick["generation"]["prompts"] = str(prompt_file)
    quick["generation"]["max_tokens"] = max(1, math.ceil(quick["generation"]["max_tokens"] * units))
    count["prompts"] = sum(len(v) for v in kept.values())
    count["max_tokens"] = quick["generation"]["max_tokens"]
    path = workdir / f"gate-{units:g}.yaml"
    path.write_text(yaml.safe_dump(gate, sort_keys=False))
    return path, count


def candidate(model: str, workdir: Path, name: str, group_size: int) -> Path:
    out = workdir / f"{name}-w4a16-rtn"
    if not (out / "lmfoundry.json").exists():
        cmd = python_command("lmfoundry.cli", "quantize", model, "-o", str(out), "--overwrite", "--quiet",
                             "--method", "rtn", "--scheme", "w4a16", "--group-size", str(group_size))
        subprocess.run(cmd, check=True, capture_output=True)
    return out


def tree_rss(pid: int) -> int:
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_gate(cand: Path, base: str, gate: Path, out: Path) -> dict:
    cmd = python_command("lmfoundry.cli", "eval-gate", str(cand), "--baseline", base, "--gate", str(gate),
                         "--tier", "quick", "--no-cache", "--quiet", "--no-promotion", "-o", str(out))
    dry = subprocess.run([*cmd, "--dry-run"], capture_output=True, text=True, check=True)
    plan_lines = dry.stdout.splitlines()
    predicted = float(plan_lines[-1].split("peak resident memory ")[1].split(" GiB")[0]) * GIB
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampled = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            sampled[0] = max(sampled[0], tree_rss(proc.pid))
            time.sleep(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    stdout, stderr = proc.communicate()
    done.set()
    thread.join()
    wall = time.time() - t0
    if proc.returncode not in (0, 1, 2):
        raise RuntimeError(f"{' '.join(cmd)}\n{stderr[-3000:]}")
    noise = [line for line in (stdout + stderr).splitlines()
             if line.strip() and not line.startswith(VERDICT_LINES) and not line.lstrip().startswith(
                 ("pass ", "fail ", "inconclusive "))]
    report = json.loads((out / "eval-gate.json").read_text())
    return {"predicted_bytes": int(predicted), "plan": plan_lines, "sampled_peak_bytes": sampled[0],
            "wall_s": round(wall, 1), "exit_code": proc.returncode, "verdict": report["verdict"], "noise": noise,
            "phases": {"baseline": report["baseline"]["memory"], "candidate": report["candidate"]["memory"]},
            "seconds": {"baseline": report["baseline"]["seconds"], "candidate": report["candidate"]["seconds"]}}


def served_bytes(plan: list[str]) -> dict[str, float]:
    """Each model's weights as run, from the dry-run's plan lines (GiB)."""
    out = {}
    for line in plan:
        if ": weights " in line:
            spec, rest = line.removeprefix("plan: ").split(": weights ", 1)
            out[spec] = float(rest.split(" ", 1)[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b",
                    help="built-in names or folders (comma-separated); 'none' for only --model8b")
    ap.add_argument("--model8b", action="store_true", help="add the random Llama-3-8B-shaped model")
    ap.add_argument("--units", default="1", help="scale(s) of the quick tier's units, comma-separated")
    ap.add_argument("--out", default=None, help="write the table here (.md, and .json beside it)")
    a = ap.parse_args()
    work = a.workdir
    work.mkdir(parents=True, exist_ok=True)
    models = [] if a.models == "none" else [(m, Path(m).name, 64 if "smollm2" in m else 128) for m in a.models.split(",")]
    if a.model8b:
        folder = work / "llama3-8b-shape-32L"
        from lmfoundry.checkpoint.sources import resolve_model

        make_model(folder, 32, tokenizer=resolve_model("smollm2-135m"))
        models.append((str(folder), "llama3-8b-shape (random)", 128))
    rows = []
    for units in (float(u) for u in a.units.split(",")):
        gate, count = scaled_gate(work, units)
        for spec, name, group in models:
            cand = candidate(spec, work, Path(spec).name, group)
            print(f"{name} at units {units:g} ...", file=sys.stderr)
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            r = run_gate(cand, spec, gate, work / f"report-{Path(spec).name}-{units:g}")
            after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
            # ru_maxrss of children is the largest of any waited-for child: only valid when it grew
            r["rusage_peak_bytes"] = after if after > before * 1024 else None
            weights = served_bytes(r["plan"])
            r.update(model=name, units=units, count=count, weights_gib=weights,
                     bound_bytes=int((max(weights.values()) + 3) * GIB))
            rows.append(r)
    lines = ["| model | units | items (arc/piqa/hs) | windows | prompts x tokens | weights as run (base / cand) "
             "| predicted peak | measured peak | sampled peak | bound (larger + 3 GiB) | measured / bound "
             "| measured / predicted | wall s | noise lines |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = r["rusage_peak_bytes"] or r["sampled_peak_bytes"]
        w = list(r["weights_gib"].values())
        c = r["count"]
        lines.append(f"| {r['model']} | {r['units']:g} | {c['lmf_arc_easy']}/{c['lmf_piqa']}/{c['lmf_hellaswag']} | "
                     f"{c['windows']} | {c['prompts']} x {c['max_tokens']} | {w[0]:.2f} / {w[1]:.2f} GiB | "
                     f"{r['predicted_bytes'] / GIB:.2f} GiB | {peak / GIB:.2f} GiB | "
                     f"{r['sampled_peak_bytes'] / GIB:.2f} GiB | {r['bound_bytes'] / GIB:.2f} GiB | "
                     f"{peak / r['bound_bytes']:.2f} | {peak / r['predicted_bytes']:.2f} | {r['wall_s']:.0f} | "
                     f"{len(r['noise'])} |")
    lines += ["", "Where the memory goes (resident GiB at each phase's end / the process's high-water mark so far):", "",
              "| model | units | model evaluated | loaded | tasks | perplexity | generation | freed | seconds (load/tasks/ppl/gen) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for who in ("baseline", "candidate"):
            ph = {p["phase"]: p for p in r["phases"][who]}
            cells = [f"{ph[k]['rss_bytes'] / GIB:.2f} / {ph[k]['peak_bytes'] / GIB:.2f}" if k in ph else "-"
                     for k in ("loaded", "tasks", "perplexity", "generation", "freed")]
            s = r["seconds"][who]
            lines.append(f"| {r['model']} | {r['units']:g} | {who} | {' | '.join(cells)} | "
                         f"{s['load']:.0f}/{s['tasks']:.0f}/{s['perplexity']:.0f}/{s['generation']:.0f} |")
    lines += ["", "Dry-run plans:", ""]
    for r in rows:
        lines += [f"- {r['model']} (units {r['units']:g}):", *[f"  - `{p}`" for p in r["plan"]]]
    from lmfoundry.resources import cache_dir

    local = (str(work) + "/", str(cache_dir() / "models") + "/")

    def scrub(text: str) -> str:  # no local paths in results: models by name
        for prefix in local:
            text = text.replace(prefix, "")
        return text

    table = scrub("\n".join(lines))
    print(table)
    if a.out:
        out = Path(a.out)
        out.write_text(f"# eval-gate memory (benchmarks/gate_memory.py)\n\nMachine: {os.cpu_count()} cores.\n\n{table}\n")
        for r in rows:
            r["plan"] = [scrub(p) for p in r["plan"]]
            r["model"] = scrub(r["model"])
            r["weights_gib"] = {scrub(k): v for k, v in r["weights_gib"].items()}
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
