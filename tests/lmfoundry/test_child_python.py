"""`lmfoundry.child_python`: the Python processes lmfoundry starts never import from the working
directory (a source checkout's root holds a bare `lmfoundry/` and a `kernels/` that shadows Hugging
Face's package)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import plant_checkout

from lmfoundry import child_python


@pytest.mark.parametrize("version", [(3, 10, 14), sys.version_info])
def test_python_command_ignores_the_working_directory(tmp_path, monkeypatch, version):
    """Both forms (-P, and Python 3.10's runpy trampoline) run the installed module from inside a
    checkout-like directory, with no PYTHONSAFEPATH to help, and pass the arguments through."""
    checkout = plant_checkout(tmp_path / "checkout")
    monkeypatch.setattr(sys, "version_info", version)
    cmd = child_python.python_command("lmfoundry.cli", "--version")
    monkeypatch.undo()
    env = {k: v for k, v in child_python.child_env().items() if k != "PYTHONSAFEPATH"}
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "checkout" not in proc.stderr and proc.stdout.strip()


def test_the_planted_checkout_would_shadow_a_plain_m(tmp_path):
    """The control: `python -m` in the same directory imports the planted folder."""
    checkout = plant_checkout(tmp_path / "checkout")
    env = {k: v for k, v in child_python.child_env().items() if k != "PYTHONSAFEPATH"}
    proc = subprocess.run([sys.executable, "-m", "lmfoundry.cli", "--version"], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "imported from the checkout" in proc.stderr


def test_importable_path_drops_checkout_roots_and_the_working_directory(tmp_path, monkeypatch):
    checkout = plant_checkout(tmp_path / "checkout")
    other = tmp_path / "scripts"
    other.mkdir()
    monkeypatch.chdir(checkout)
    assert child_python.importable_path(["", str(checkout), str(other), str(other)]) == [str(other)]
    monkeypatch.chdir(other)
    assert child_python.importable_path([""]) == [str(other)]  # a plain folder stays, made absolute
    assert child_python.child_env({"A": "1"}) == {"A": "1", "PYTHONSAFEPATH": "1"}
