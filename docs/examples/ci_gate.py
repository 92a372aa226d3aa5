"""A CI step in Python: quantize two recipes, gate both against the float baseline, compile the
smallest one that passes, and generate with it. Exits 0 when a candidate passed, 1 when none did,
2 on an input error (the `LmfoundryError` line, as the CLI prints it).

    python docs/examples/ci_gate.py --model smollm2-135m --work ci-out --arch ampere

docs/python.md walks through it; tests/lmfoundry/test_api.py runs it on a tiny model (slow tier).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lmfoundry

# smallest first: the first that passes the gate is the one to ship
RECIPES = ["smollm2-w4a16-rtn", "smollm2-w8a16-rtn"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="The float baseline (folder, .gguf or built-in name).")
    ap.add_argument("--work", type=Path, default=Path("ci-out"), help="Folder for checkpoints, reports and the bundle.")
    ap.add_argument("--gate", default=None, help="Gate YAML (default: the shipped gate).")
    ap.add_argument("--tier", default="quick")
    ap.add_argument("--arch", default="ampere", help="Compile target: ampere, ada, hopper, or cpu.")
    ap.add_argument("--calib", default=None, help="Calibration text (default: the recipe's).")
    ap.add_argument("--num-samples", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        return run(args)
    except lmfoundry.LmfoundryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


def run(args: argparse.Namespace) -> int:
    verdicts = {}
    for recipe in RECIPES:
        checkpoint = lmfoundry.quantize(args.model, recipe=recipe, output=args.work / recipe, overwrite=True,
                                        calib=args.calib, num_samples=args.num_samples, seq_len=args.seq_len,
                                        quiet=True)
        result = lmfoundry.eval_gate(checkpoint, baseline=args.model, gate=args.gate, tier=args.tier,
                                     output=args.work / f"{recipe}-gate", quiet=True)
        for m in result.report["metrics"]:
            if m["gated"]:
                print(f"{recipe}: {m['name']} {m['statistic']} {m['point']:.4f} [{m['low']:.4f}, {m['high']:.4f}] "
                      f"vs {m['threshold']:g}: {m['verdict']}")
        print(f"{recipe}: {result.verdict} ({result.markdown_path})")
        verdicts[recipe] = (checkpoint, result.verdict)
    passing = [(recipe, ckpt) for recipe, (ckpt, verdict) in verdicts.items() if verdict == "pass"]
    if not passing:
        print("no candidate passed the gate")
        return 1
    recipe, checkpoint = passing[0]
    bundle = lmfoundry.compile(checkpoint, arch=args.arch, output=args.work / f"{recipe}-engine", quiet=True)
    print(f"shipping {recipe}: {bundle.path} ({bundle.scheme['target']}, {len(bundle.kernels)} kernels)")
    greedy = lmfoundry.SamplingParams(max_tokens=16, temperature=0)
    with lmfoundry.LLM(bundle) as llm:
        for out in llm.generate(["The capital of France is", "def fibonacci(n):"], greedy):
            print(f"{out.outputs[0].finish_reason}: {out.outputs[0].text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
