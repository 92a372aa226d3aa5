"""`LMFOUNDRY_CPU_ISA` (`lmfoundry.runtime.cpu.isa`): a path the CPU has is forced on every library
that picks one (checked in a fresh process, as the switch applies at a process's start), a path it
lacks or an unknown one is refused with one line, and a switch that comes after torch started is
refused rather than half-applied."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import assert_one_error

from lmfoundry.errors import UserError
from lmfoundry.runtime.cpu import isa

AVX2_ONLY = {"avx2": True, "fma3": True, "avx512_f": False, "avx512_bw": False, "avx512_vl": False}
SPR = {"avx2": True, "avx512_f": True, "avx512_bw": True, "avx512_vl": True, "avx512_bf16": True,
       "amx_tile": True, "amx_bf16": True, "amx_int8": True}


def run_python(code: str, path: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (isa.ENV, *isa.LIBRARY_VARS)}
    if path is not None:
        env[isa.ENV] = path
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_an_unknown_path_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(isa.ENV, "sse9")
    with pytest.raises(UserError, match="LMFOUNDRY_CPU_ISA='sse9': expected one of amx, avx512, avx2"):
        isa.forced()


def test_a_path_the_cpu_lacks_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(isa, "detected_features", lambda: AVX2_ONLY)
    assert isa.supported() == ("avx2",)
    monkeypatch.setenv(isa.ENV, "avx512")
    with pytest.raises(UserError, match=r"no avx512 path \(it runs avx2\)"):
        isa.isa()


def test_a_forced_path_hides_the_extensions_above_it(monkeypatch) -> None:
    monkeypatch.setattr(isa, "detected_features", lambda: SPR)
    monkeypatch.delenv(isa.ENV, raising=False)
    assert isa.supported() == ("amx", "avx512", "avx2") and isa.isa() == "amx"
    monkeypatch.setenv(isa.ENV, "avx512")
    assert isa.isa() == "avx512" and isa.features()["avx512_bf16"] and not isa.features()["amx_tile"]
    monkeypatch.setenv(isa.ENV, " AVX2 ")
    assert isa.isa() == "avx2" and not any(isa.features()[k] for k in SPR if k != "avx2")


def test_the_cli_refuses_a_path_the_cpu_lacks() -> None:
    missing = [p for p in isa.FORCEABLE if p not in isa.supported()]
    for path, needle in [("avx1024", "expected one of amx, avx512, avx2"),
                         *[(p, f"this CPU has no {p} path") for p in missing[:1]]]:
        proc = run_python("from lmfoundry.cli import main; main(['plan', '--help'])", path)
        assert proc.returncode == 2
        assert_one_error(proc.returncode, proc.stderr, "LMFOUNDRY_CPU_ISA", needle)


PROBE = """
import json
from lmfoundry.runtime.cpu.isa import apply
path = apply()
import torch
from lmfoundry.runtime.cpu import features as cpu_isa
print(json.dumps({"path": path, "isa": cpu_isa.isa(), "aten": torch.backends.cpu.get_cpu_capability(),
                  "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                  "native_bf16": cpu_isa.native_bf16(), "describe": cpu_isa.describe()}))
"""


@pytest.mark.parametrize("path", isa.FORCEABLE)
def test_forcing_reaches_every_library(path: str) -> None:
    if path not in isa.supported():
        pytest.skip(f"this CPU has no {path} path")
    proc = run_python(PROBE, path)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["path"] == got["isa"] == path
    assert got["aten"] == ("AVX2" if path == "avx2" else "AVX512")
    assert got["describe"].startswith(f"cpu: {path}, forced by LMFOUNDRY_CPU_ISA")
    if path == "avx2":  # what an AVX2 CPU has: no bf16 kernels in oneDNN, no bf16 arithmetic
        assert not got["onednn_bf16"] and not got["native_bf16"]


def test_a_switch_after_torch_started_is_refused() -> None:
    here = isa.supported()
    if len(here) < 2:
        pytest.skip("this CPU has one path only: nothing to switch to")
    code = (f"import os, torch\ntorch.ones(4).exp()\nos.environ[{isa.ENV!r}] = {here[-1]!r}\n"
            "from lmfoundry.runtime.cpu.isa import apply\napply()")
    proc = run_python(code, None)
    assert proc.returncode != 0 and "came too late" in proc.stderr, proc.stderr
