"""Building the CPU kernels: cached per machine, and a clear None (with the reason) where they
cannot be built, leaving no half-written object behind."""

from __future__ import annotations

import pytest

from lmfoundry.kernels.cpu import build


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty build cache and no library loaded yet in this process."""
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_LOADED", {})
    monkeypatch.setattr(build, "_BOUND", {})
    return tmp_path / "cache" / "native"


@pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
def test_built_once_then_reused(fresh, monkeypatch) -> None:
    assert build.load("store_kv") is not None
    objects = list(fresh.glob("store_kv-*.so"))
    assert len(objects) == 1 and not list(fresh.glob("*.so.tmp*"))
    monkeypatch.setattr(build, "_LOADED", {})
    real_run = build.subprocess.run

    def version_only(cmd, **kwargs):
        assert "--version" in cmd, f"compiled again: {cmd}"
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(build.subprocess, "run", version_only)
    assert build.load("store_kv") is not None  # same source, compiler and CPU: the cached object


def test_no_compiler(fresh, monkeypatch) -> None:
    monkeypatch.setattr(build, "compiler", lambda: None)
    assert build.load("paged_decode") is None
    assert "no C compiler" in (build.unavailable_reason("paged_decode") or "")


def test_a_failed_build_leaves_nothing(fresh, monkeypatch, tmp_path) -> None:
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc 0.0'\n[ \"$1\" = --version ] && exit 0\necho 'no such flag' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    assert build.load("paged_decode") is None
    reason = build.unavailable_reason("paged_decode") or ""
    assert "could not build paged_decode.c" in reason and "no such flag" in reason
    assert not fresh.exists() or not any(fresh.iterdir())
