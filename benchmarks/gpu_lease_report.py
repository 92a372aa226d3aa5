"""The GPU lease's record, written from what its steps left in $OUT (the last step of
`bash benchmarks/gpu_lease.sh run`):

    python benchmarks/gpu_lease_report.py OUT      # -> OUT/gpu_lease_<gpu>.md (h200 on an H200)

One table of the figures the lease is for: the engine bundle's Triton JIT calls on the GPU (must be
0), calibration seconds per layer on the GPU, and `lmfoundry bench` through HTTP at each
concurrency; then each step's exit status. A figure whose step did not leave it reads "not
measured" with the step's status: nothing here is filled in by hand. Copy the file to
benchmarks/results/ (and name the commit in its README) to record a lease.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

STEPS = ("kernels", "calibration", "serve", "http")


def load(out: Path, name: str) -> Any:
    path = out / name
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def step_status(log: str) -> dict[str, str]:
    """Each step's outcome as lease.log says it: "rc=0 after 123 s", "skipped: ...", or "not run"."""
    status = {s: "not run" for s in STEPS}
    for line in log.splitlines():
        if m := re.match(r"== (\w+) (rc=\d+ after \d+ s)", line):
            status[m.group(1)] = m.group(2)
        elif m := re.match(r"== (\w+) skipped: (.*)", line):
            status[m.group(1)] = f"skipped: {m.group(2)}"
    return status


def ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.1f} ms"


def report(out: Path) -> tuple[str, str]:
    """(markdown, file slug) for the lease outputs in `out`."""
    log = (out / "lease.log").read_text() if (out / "lease.log").is_file() else ""
    header = []  # the machine, the versions, the preparation: every line before the first step's
    for line in log.splitlines():
        if line.startswith(("==", "----")):
            break
        header.append(line)
    gpu = header[0].split(",")[0].strip() if header else "unknown"
    status = step_status(log)
    serve, calib, bench, kernels = (load(out, f) for f in ("serve.json", "calibration.json", "bench.json",
                                                          "kernels.json"))

    def missing(step: str) -> str:
        return f"not measured ({step}: {status[step]})"

    rows: list[tuple[str, str]] = []
    if serve and "check_kernel_calls" in serve:
        calls = serve["check_kernel_calls"]
        decode = serve.get("decode", [])
        total = sum(sum(r.get(k, {}).values()) for r in decode for k in ("graphs_kernel_calls", "eager_kernel_calls"))
        rows.append(("Triton JIT calls, W4A16 bundle on the GPU (must be 0)",
                     f"{serve['jit_calls']} of {sum(calls.values()) + total} kernel calls "
                     f"({len(decode)} decode batch sizes measured)"))
        rows.append(("greedy tokens, GPU vs the bundle's CPU references", "equal" if serve["tokens_equal"] else "DIFFER"))
    else:
        rows.append(("Triton JIT calls, W4A16 bundle on the GPU (must be 0)", missing("serve")))
    calib_rows = (calib or {}).get("rows", [])
    for r in calib_rows:
        rows.append((f"calibration {r['method'].upper()} on {r['device']}, s/layer median / max ({r['layers']} "
                     f"layers, {(calib or {}).get('preset', '?')} shape)",
                     f"{r['layer_s_median']:.2f} / {r['layer_s_max']:.2f}"))
    if not any(r.get("device") == "cuda" for r in calib_rows):
        rows.append(("calibration on the GPU, s/layer", missing("calibration")))
    for lv in (bench or {}).get("levels", []):
        rows.append((f"HTTP c={lv['concurrency']}: output tok/s, TTFT p50, ITL p50 ({lv['requests']} requests, "
                     f"{lv['errors']} errors)",
                     f"{lv['output_tokens_per_s']:.1f} tok/s, {ms(lv['ttft_s']['p50'])}, {ms(lv['itl_s']['p50'])}"))
    if not (bench or {}).get("levels"):
        rows.append(("HTTP bench", missing("http")))
    if kernels and "rows" in kernels:
        failed = [r for r in kernels["rows"] if str(r.get("check", "ok")).startswith("FAIL")]
        rows.append(("kernel checks against the references (gpu_kernels.py rows)",
                     f"{len(kernels['rows']) - len(failed)} ok, {len(failed)} failed"))
    else:
        rows.append(("kernel checks", missing("kernels")))

    lines = [f"# GPU lease: {gpu}", "",
             "`bash benchmarks/gpu_lease.sh run` (benchmarks/gpu_lease.sh says what each step runs); "
             "written by benchmarks/gpu_lease_report.py from the step outputs.", ""]
    lines += [f"- {h}" for h in header]
    lines += ["", "| figure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    lines += ["", "| step | status |", "|---|---|"] + [f"| {s} | {status[s]} |" for s in STEPS]
    if bench and bench.get("levels"):
        lines += ["", f"HTTP: `lmfoundry serve BUNDLE --device {bench.get('device')}` (started in "
                  f"{bench.get('serve_start_s', 0):.0f} s), `lmfoundry bench` with {bench.get('max_tokens')} output "
                  f"tokens a request and a {bench.get('prefix_words')}-word shared prefix.", "",
                  "| concurrency | output tok/s | TTFT p50 | TTFT p95 | ITL p50 | e2e p50 | requests | errors |",
                  "|---|---|---|---|---|---|---|---|"]
        for lv in bench["levels"]:
            lines.append(f"| {lv['concurrency']} | {lv['output_tokens_per_s']:.1f} | {ms(lv['ttft_s']['p50'])} | "
                         f"{ms(lv['ttft_s']['p95'])} | {ms(lv['itl_s']['p50'])} | {ms(lv['e2e_s']['p50'])} | "
                         f"{lv['requests']} | {lv['errors']} |")
    if serve and serve.get("decode"):
        lines += ["", "Decode tok/s (gpu_serve.py, prompt 128, 128 new tokens):", "",
                  "| batch | kernels + graphs | kernels eager | torch eager bf16 | torch.compile bf16 |", "|---|---|---|---|---|"]
        for r in serve["decode"]:
            te, tc = r.get("torch_eager_tok_s"), r.get("torch_compile_tok_s")
            lines.append(f"| {r['batch']} | {r['graphs_tok_s']:.0f} | {r['eager_tok_s']:.0f} | "
                         f"{'n/a' if te is None else f'{te:.0f}'} | {'n/a' if tc is None else f'{tc:.0f}'} |")
    slug = "h200" if "H200" in gpu else re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "gpu"
    return "\n".join(lines) + "\n", slug


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    text, slug = report(out)
    path = out / f"gpu_lease_{slug}.md"
    path.write_text(text)
    print(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
