"""Where one decode step's time goes, at batch 1 and 32: scheduling, input preparation, the
forward pass (and how much of it is inside PyTorch ops vs Python around them), the LM head,
sampling with the token bookkeeping, and the rest of `LLMEngine.step`.

    python benchmarks/step_profile.py --model smollm2-135m --threads 2 --out benchmarks/results/step_profile

Each target (a checkpoint folder, model name or `--arch cpu` bundle) is loaded as `serve` loads
it (bf16 by default), `batch` sequences are prefilled and brought into steady decode, then
`--steps` decode steps are timed phase by phase (wrappers around the engine's own methods), and
the same number again under torch.profiler, whose per-op self times say how much of the forward
is spent inside ops. The linears run as the engine serves them ("fused": oneDNN-prepacked, with
q/k/v and gate/up one product each); `--baseline` also runs each target with plain bf16 linears
(`F.linear`, no prepacking) and with every linear prepacked on its own ("prepacked", no fusion),
interleaved, for the ratios in the same run. `--context N` gives every sequence an N-token prompt
(default: a short sentence), so decode attention reads a serving-sized context; `--attention both`
runs each case with the CPU runtime's C kernels ("native": decode and prefill attention read in
place, the KV write, few-row GEMVs, one-pass RMSNorm, SiLU-mul and rotary; `runtime/cpu/native/`) and without them
("gathered": `LMFOUNDRY_NATIVE_KERNELS=0`, decodes gathered for SDPA, every linear on oneDNN, the
elementwise ops in PyTorch), interleaved. The profiler adds a
few microseconds per op, so the step wall time comes from the unprofiled pass and only the op
share from the profiled one.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

PHASES = ("schedule", "inputs", "forward", "lm_head", "sample", "other")
LINEARS = ("plain", "prepacked", "fused")  # how the executor's module swap leaves the bf16 linears


def _timed(phases: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += time.perf_counter() - t0
    return wrapper


def profile_target(target: str, dtype: str, batch: int, steps: int, linears: str = "fused", context: int = 0,
                   attention: str = "native") -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
    from lmfoundry.runtime.engine import executor as executor_module
    from lmfoundry.runtime.engine import llm_engine as llm_module
    from lmfoundry.runtime.loader import resolve_dtype

    run_dtype = resolve_dtype(dtype, target, "cpu")
    can_prepack, prepack = executor_module.can_prepack, executor_module.prepack_dense_linears
    if linears == "plain":  # the baseline: plain F.linear on the bf16 weights
        executor_module.can_prepack = lambda dtype: False  # type: ignore[assignment]
    elif linears == "prepacked":  # each linear prepacked on its own, q/k/v and gate/up not fused
        executor_module.prepack_dense_linears = lambda model, fuse=False: prepack(model)  # type: ignore[assignment]
    os.environ["LMFOUNDRY_NATIVE_KERNELS"] = "1" if attention == "native" else "0"
    try:
        engine = LLMEngine.from_pretrained(target, run_dtype, EngineConfig(kv_cache_memory_gb=1.0,
                                                                           max_num_batched_tokens=2048))
    finally:
        executor_module.can_prepack, executor_module.prepack_dense_linears = can_prepack, prepack
    if attention == "native" and engine.runner.executor.decode_kernel is None:
        raise SystemExit("--attention native: the C decode kernel is not built here "
                         "(lmfoundry.runtime.cpu.native.build.unavailable_reason('paged_decode'))")
    params = SamplingParams(max_tokens=4 * steps + 64, temperature=0, ignore_eos=True)
    for i in range(batch):
        if context:  # distinct ids per sequence: no prefix-cache sharing
            engine.add_request(None, [100 + (7 * i + 13 * j) % 30000 for j in range(context)], params)
        else:
            engine.add_request(None, f"Request {i}: the history of the city, told by its oldest inhabitants,", params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()  # prefill
    for _ in range(3):
        engine.step()  # warm decode

    phases: dict[str, float] = defaultdict(float)
    runner, executor = engine.runner, engine.runner.executor
    originals = {"schedule": engine.scheduler.schedule, "inputs": runner.inputs, "forward": executor.forward,
                 "lm_head": executor.logits, "sample": llm_module.verify}
    engine.scheduler.schedule = _timed(phases, "schedule", originals["schedule"])  # type: ignore[method-assign]
    runner.inputs = _timed(phases, "inputs", originals["inputs"])  # type: ignore[method-assign]
    executor.forward = _timed(phases, "forward", originals["forward"])
    executor.logits = _timed(phases, "lm_head", originals["lm_head"])
    llm_module.verify = _timed(phases, "sample", originals["sample"])  # type: ignore[assignment]
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
        unprofiled = dict(phases)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.step()
        profiled_forward = phases["forward"] - unprofiled["forward"]
    finally:
        llm_module.verify = originals["sample"]  # type: ignore[assignment]
    per_step = {k: unprofiled.get(k, 0.0) / steps for k in PHASES if k != "other"}
    per_step["other"] = max(0.0, wall / steps - sum(per_step.values()))
    events = [e for e in prof.key_averages() if e.key.split("::")[0] in ("aten", "mkldnn", "lmfoundry")]
    op_self = sum(e.self_cpu_time_total for e in events) / 1e6  # over the profiled steps
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return {
        "target": target, "dtype": str(run_dtype).replace("torch.", ""), "batch": batch, "steps": steps,
        "linears": linears, "context": context, "attention": attention,
        "threads": torch.get_num_threads(),
        "step_ms": 1000 * wall / steps,
        "tok_s": batch * steps / wall,
        "phase_ms": {k: 1000 * v for k, v in per_step.items()},
        "ops_share_of_forward": op_self / profiled_forward if profiled_forward else None,
        "top_ops": [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1000 / steps, "calls_per_step":
                     e.count / steps} for e in top],
    }


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# One decode step, phase by phase ({meta['threads']} threads)", "",
             f"Command: `{meta['command']}`", "",
             f"Machine: {meta['cpus']} CPUs, load average {meta['loadavg_before']} before, "
             f"{meta['loadavg_after']} after.", "",
             "| target | dtype | linears | attention | context | batch | step ms (median round) | every round | tok/s | "
             + " | ".join(f"{p} ms" for p in PHASES) + " | forward inside ops |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | --- | ---: | " + " | ".join("---:" for _ in PHASES)
             + " | ---: |"]
    for r in results:
        share = r["ops_share_of_forward"]
        rounds = ", ".join(f"{x:.1f}" for x in r.get("step_ms_rounds", [r["step_ms"]]))
        lines.append(f"| {Path(r['target']).name} | {r['dtype']} | {r['linears']} | {r.get('attention', '-')} | "
                     f"{r.get('context') or 'short'} | {r['batch']} | {r['step_ms']:.1f} | "
                     f"{rounds} | {r['tok_s']:.1f} | " + " | ".join(f"{r['phase_ms'][p]:.2f}" for p in PHASES)
                     + f" | {'-' if share is None else f'{100 * share:.0f} %'} |")
    lines += ["", "Heaviest ops (self time per step):", ""]
    for r in results:
        ops = ", ".join(f"{o['op']} {o['self_ms_per_step']:.2f} ms ({o['calls_per_step']:.0f} calls)"
                        for o in r["top_ops"][:5])
        lines.append(f"- {Path(r['target']).name}, {r['linears']}, {r.get('attention', '-')} attention, "
                     f"batch {r['batch']}: {ops}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", default=None,
                   help="checkpoint folder, model name or --arch cpu bundle (repeatable; default smollm2-135m)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", default="1,32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--baseline", action="store_true",
                   help="also run each target with plain (not prepacked) bf16 linears and with prepacked, "
                        "unfused ones, interleaved")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every measurement, alternating the order of the linears (A B, B A); the table "
                        "shows each one's median round")
    p.add_argument("--context", type=int, default=0, help="prompt tokens per sequence (default: a short sentence)")
    p.add_argument("--attention", choices=("native", "gathered", "both"), default="native",
                   help="native: the C kernels of runtime/cpu/native (attention in place, KV write, few-row GEMVs); "
                        "gathered: without them (PyTorch paths); both: interleaved")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/step_profile"))
    args = p.parse_args()
    import sys

    import torch

    torch.set_num_threads(args.threads)
    meta = {"threads": args.threads, "cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in os.getloadavg()],
            "command": "python " + " ".join(sys.argv)}
    runs: dict[tuple[str, int, str, str], list[dict[str, Any]]] = {}
    attentions = ("native", "gathered") if args.attention == "both" else (args.attention,)
    for rnd in range(args.rounds):
        for target in args.model or ["smollm2-135m"]:
            for batch in (int(b) for b in args.batch.split(",")):
                order = [(lin, att) for lin in (LINEARS if args.baseline else ("fused",)) for att in attentions]
                for linears, attention in (order if rnd % 2 == 0 else list(reversed(order))):  # A B, then B A
                    r = profile_target(target, args.dtype, batch, args.steps, linears, args.context, attention)
                    print(f"round {rnd + 1} {Path(target).name:<20} {r['linears']:<9} {attention:<8} batch {batch:>3}: "
                          f"{r['step_ms']:7.1f} ms/step {r['tok_s']:7.1f} tok/s  "
                          + "  ".join(f"{k} {v:.1f}" for k, v in r["phase_ms"].items())
                          + f"  ops {100 * (r['ops_share_of_forward'] or 0):.0f} % of forward", flush=True)
                    runs.setdefault((target, batch, linears, attention), []).append(r)
    results = []
    for _key, done in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1], LINEARS.index(kv[0][2]), kv[0][3])):
        median = sorted(done, key=lambda r: r["step_ms"])[len(done) // 2]  # the round with the median step
        results.append({**median, "step_ms_rounds": [round(r["step_ms"], 2) for r in done]})
    meta["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    args.out.with_suffix(".md").write_text(markdown(results, meta))


if __name__ == "__main__":
    main()
