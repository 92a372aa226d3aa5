"""Calibration at scale: quantize a random Llama-3-8B-shaped checkpoint (bf16, one shard per layer,
~15 GiB) on this machine and set what it cost beside what `lmfoundry doctor` predicted.

For each method: the doctor's estimate of the pipeline's peak memory (`calibration/memory.py`),
then `lmfoundry quantize` in a fresh process; from its manifest, the peak RSS above the process's
own baseline (RSS after start-up imports, measured in the same run) and the wall time of every
decoder layer. The ratio measured / predicted is the doctor's error. With a GPU, the same runs on
`--device cuda` give GPU per-layer times beside the CPU ones.

    python benchmarks/calibration_scale.py --workdir /big/disk [--methods rtn,gptq] [--layers 32]
        [--devices cpu[,cuda]] [--out benchmarks/results/calibration_scale_8b.md]

`--tokenizer DIR` copies DIR's tokenizer files into the source (default: the default model's,
fetched once); `--preset tiny` runs the same path on a small Llama (what the GPU lease's offline
test runs on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layerwise_memory import write_random_llama  # noqa: E402

from lmfoundry.child_python import python_command  # noqa: E402

LLAMA3_8B = dict(hidden=4096, intermediate=14336, vocab=128256, kv_heads=8, rope_theta=500000.0)
PRESETS = {"llama3-8b": LLAMA3_8B, "tiny": dict(hidden=256, intermediate=512, vocab=49152, kv_heads=1, rope_theta=1e4)}


def make_model(folder: Path, layers: int, shape: dict = LLAMA3_8B, tokenizer: Path | None = None) -> float:
    """Write the checkpoint unless a complete one is there; returns its size in GiB."""
    if not (folder / "config.json").is_file():
        write_random_llama(folder, layers, shape["hidden"], shape["intermediate"], shape["vocab"],
                           kv_heads=shape["kv_heads"], dtype=torch.bfloat16, rope_theta=shape["rope_theta"],
                           tokenizer=tokenizer)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**30


def predicted_bytes(model: Path, method: str, num_samples: int, seq_len: int) -> int:
    """The doctor's estimate of the pipeline's peak (what it adds to the process baseline)."""
    from lmfoundry.preflight import diagnose
    from lmfoundry.recipe import Recipe

    rec = Recipe().with_overrides(method=method, scheme="w4a16", group_size=128)
    rec = rec.with_overrides(num_samples=num_samples, seq_len=seq_len)
    return int(diagnose(str(model), rec).estimates["calibration"]["total"])


def quantize(model: Path, out: Path, method: str, num_samples: int, seq_len: int, device: str) -> dict:
    cmd = python_command("lmfoundry.cli", "quantize", str(model), "-o", str(out), "--overwrite", "--quiet",
                         "--method", method, "--scheme", "w4a16", "--group-size", "128", "--num-samples",
                         str(num_samples), "--seq-len", str(seq_len), "--device", device)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)))
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    load = os.getloadavg()[1]  # 5-minute load average at the end: other work sharing the cores
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{proc.stderr[-3000:]}")
    m = json.loads((out / "lmfoundry-run.json").read_text())  # the run record: times and RSS
    seconds = list(m["layer_seconds"].values())
    return {"method": method, "device": device, "baseline_rss_bytes": m["baseline_rss_bytes"],
            "peak_rss_bytes": m["peak_rss_bytes"], "wall_s": round(time.time() - t0, 1),
            "layer_s_median": statistics.median(seconds), "layer_s_max": max(seconds),
            "layer_s_first": seconds[0], "layers": len(seconds), "load_avg_5min": round(load, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="folder for the ~15 GiB source and the outputs")
    ap.add_argument("--methods", default="rtn,gptq")
    ap.add_argument("--devices", default="cpu", help="cpu, cuda or cpu,cuda")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (32 = Llama-3-8B)")
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the table (and a .json beside it) here")
    ap.add_argument("--preset", choices=list(PRESETS), default="llama3-8b")
    ap.add_argument("--tokenizer", type=Path, default=None, help="folder with tokenizer.json + tokenizer_config.json")
    a = ap.parse_args()
    work = Path(a.workdir)
    model = work / f"{a.preset}-shape-{a.layers}L"
    t0 = time.time()
    shape = PRESETS[a.preset]
    size = make_model(model, a.layers, shape, a.tokenizer)
    print(f"source: {model} ({size:.2f} GiB bf16, written or found in {time.time() - t0:.0f} s)", file=sys.stderr)
    rows = []
    for method in a.methods.split(","):
        predicted = predicted_bytes(model, method, a.num_samples, a.seq_len)
        for device in a.devices.split(","):
            print(f"quantize {method} on {device} ...", file=sys.stderr)
            row = quantize(model, work / f"out-{method}-{device}", method, a.num_samples, a.seq_len, device)
            row["predicted_bytes"] = predicted
            row["above_baseline_bytes"] = row["peak_rss_bytes"] - row["baseline_rss_bytes"]
            row["measured_over_predicted"] = round(row["above_baseline_bytes"] / predicted, 3)
            rows.append(row)
    gib = 2**30
    lines = [
        f"Source: random {a.preset} shape ({a.layers} layers, hidden {shape['hidden']}, intermediate "
        f"{shape['intermediate']}, {shape['hidden'] // 128}/{shape['kv_heads']} heads, vocab {shape['vocab']}), bf16, "
        f"{size:.2f} GiB in one shard per layer. W4A16 g128, calibration "
        f"{a.num_samples} x {a.seq_len} tokens. Baseline = the quantize process's RSS after start-up imports; "
        "peak = its VmHWM (host memory, also on --device cuda). Predicted = `lmfoundry doctor`'s estimate of "
        f"what the pipeline adds to the baseline. Machine: {os.cpu_count()} cores; the load average says how "
        "much other work shared them (per-layer times scale with it).",
        "",
        "| method | device | baseline RSS | peak RSS | peak - baseline | doctor predicted | measured / predicted "
        "| s/layer (median) | s/layer (max) | wall s | load avg (5 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['method']} | {r['device']} | {r['baseline_rss_bytes'] / gib:.2f} GiB | "
                     f"{r['peak_rss_bytes'] / gib:.2f} GiB | {r['above_baseline_bytes'] / gib:.2f} GiB | "
                     f"{r['predicted_bytes'] / gib:.2f} GiB | {r['measured_over_predicted']:.2f} | "
                     f"{r['layer_s_median']:.1f} | {r['layer_s_max']:.1f} | {r['wall_s']:.0f} | {r['load_avg_5min']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        out = Path(a.out)
        out.write_text(f"# Calibration at scale (benchmarks/calibration_scale.py)\n\n{table}\n")
        out.with_suffix(".json").write_text(json.dumps({"rows": rows, "source_gib": size, "preset": a.preset,
                                                        "layers": a.layers, "shape": shape}, indent=1))


if __name__ == "__main__":
    main()
