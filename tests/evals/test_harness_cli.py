"""`lmfoundry eval harness`: lm-eval's own CLI with `--model lmfoundry` registered, on a shipped-
style offline task; lm-eval's `--device cuda:0` default falls back to the CPU on a machine without."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import QUESTIONS, tiny_model_folder, write_task


def test_stock_lm_eval_cli_runs_our_model(tmp_path: Path) -> None:
    model = tiny_model_folder(tmp_path / "tiny", "llama")
    task = write_task(tmp_path / "tasks")
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "lmfoundry.cli", "eval", "harness", "--model", "lmfoundry",
           "--model_args", f"pretrained={model},dtype=float32", "--tasks", task, "--include_path",
           str(tmp_path / "tasks"), "--device", "cuda:0", "--output_path", str(out), "--seed", "0"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    assert results, run.stdout[-2000:]
    acc = results[0]["results"][task]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert results[0]["n-samples"][task]["effective"] == len(QUESTIONS)
