"""Compile workers import the installed lmfoundry, whatever directory `compile` is started from.

The GPU lease's `serve` step died with `No module named 'lmfoundry.compile'`: its workers were
`python -m lmfoundry.compile.worker` started in the checkout root, so they imported the checkout's
bare `lmfoundry/` folder (which has no `compile/`) instead of the installed package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import plant_checkout

from lmfoundry.compile.aot import run_jobs

ROOT = Path(__file__).resolve().parents[2]


def _silu_job(out_dir: Path) -> dict:
    return {"id": 0, "key": "silu", "capability": 80, "sm": "sm_80", "kernel": "silu_mul", "types": {"act": "bf16"},
            "semantics": {}, "config": {"constexprs": {"BLOCK": 256}, "num_warps": 4, "num_stages": 1},
            "aligned": ["INTER"], "out_dir": str(out_dir)}


def test_workers_started_in_a_checkout_import_the_installed_package(tmp_path, monkeypatch):
    """From a directory whose `lmfoundry/` and `kernels/` fail on import, with no PYTHONSAFEPATH
    in the caller's environment (a user's shell), a worker still compiles its job."""
    monkeypatch.chdir(plant_checkout(tmp_path / "checkout"))
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    reply, = run_jobs([_silu_job(tmp_path / "out")], 1, tmp_path / "cache", tmp_path / "log")
    assert reply["ok"], (reply, (tmp_path / "log").read_text()[-2000:])
    assert (tmp_path / "out" / "silu.cubin").stat().st_size > 0


def test_lmfoundry_compile_from_the_checkout_root(make_checkpoint, tmp_path):
    """`lmfoundry compile` as a user types it, in the root of this checkout, on a small checkpoint."""
    ckpt = make_checkpoint(scheme="w8a8")
    out = tmp_path / "engine"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    proc = subprocess.run([str(Path(sys.executable).parent / "lmfoundry"), "compile", str(ckpt), "--arch", "hopper",
                           "-o", str(out), "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((out / "engine.json").read_text())
    assert {"w8a8_gemm", "rotary", "paged_prefill"} <= {k["kernel"] for k in manifest["kernels"]}
