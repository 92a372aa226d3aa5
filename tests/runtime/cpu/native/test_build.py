"""Building the CPU kernels: cached per machine, and a clear None (with the reason) where they
cannot be built, leaving no half-written object behind; a path forced with `LMFOUNDRY_CPU_ISA`
reaches every kernel's code, checked in what each object was compiled for."""

from __future__ import annotations

import pytest

from lmfoundry.runtime.cpu import isa
from lmfoundry.runtime.cpu.native import build

KERNELS = sorted(p.stem for p in build.HERE.glob("*.c"))


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


@pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("path", isa.FORCEABLE)
def test_a_forced_path_is_what_every_kernel_runs(path, monkeypatch) -> None:
    """Each object reports the vector path its `#if`s compiled (`compiled_isa.h`): forced below the
    CPU's own, the path asked for, built as an object of its own beside the native one; forced to
    the CPU's own, the native object."""
    if path not in isa.supported():
        pytest.skip(f"this CPU has no {path} path")
    monkeypatch.setattr(build, "_LOADED", {})
    monkeypatch.setattr(build, "_BOUND", {})
    monkeypatch.delenv(isa.ENV, raising=False)
    cc = build.compiler()
    assert cc is not None
    native = {name: build._build(name, cc) for name in KERNELS}
    monkeypatch.setenv(isa.ENV, path)
    below = path != isa.supported()[0]
    for name in KERNELS:
        lib = build.load(name)
        assert lib is not None, build.unavailable_reason(name)
        assert (build._build(name, cc) == native[name]) != below, name
        if below:
            assert build.compiled_path(lib) == path, name


def test_an_object_that_missed_the_forced_path_is_refused(fresh, monkeypatch) -> None:
    here = isa.supported()
    if build.compiler() is None or len(here) < 2:
        pytest.skip("needs a C compiler and a CPU with more than one path")
    monkeypatch.setenv(isa.ENV, here[-1])
    monkeypatch.setattr(build, "forced_flags", lambda cc: ())  # as if the flags never reached the compiler
    assert build.load("rope") is None
    assert f"compiled for {here[0]}, but LMFOUNDRY_CPU_ISA={here[-1]}" in (build.unavailable_reason("rope") or "")


# The kernel tests skip where a product is not built (no AVX-512 BF16, say); a source that stops
# compiling would skip them everywhere. So: on a CPU path that has what a kernel needs, it must build.
NEEDS_BF16_DOT = ("bf16_gemv", "int4_gemm", "int8_gemm")


@pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("name", NEEDS_BF16_DOT)
def test_every_product_builds_where_the_cpu_path_has_bf16_dot_products(name) -> None:
    from lmfoundry.runtime.cpu import isa

    if not isa.features().get("avx512_bf16"):
        pytest.skip(f"the {isa.isa()} path has no AVX-512 BF16")
    assert build.unavailable_reason(name) is None
    assert getattr(build.load(name), f"lmf_{name}_supported")() == 1


@pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
def test_swapped_or_damaged_objects_are_built_again_not_loaded(fresh, monkeypatch) -> None:
    """Two cached objects swapped with each other used to be loaded as they were (the engine then
    failed to start on an undefined symbol); the record beside each (its key and sha256) makes
    any object that is not the one built for its key, and one without a record, be built again."""
    cc = build.compiler()
    assert cc is not None
    rope, store = build._build("rope", cc), build._build("store_kv", cc)
    rope_bytes, store_bytes = rope.read_bytes(), store.read_bytes()
    rope.write_bytes(store_bytes)
    store.write_bytes(rope_bytes)
    compiled = []
    real_run = build.subprocess.run

    def counting(cmd, **kwargs):
        compiled.extend(c for c in cmd if c.endswith(".c"))
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(build.subprocess, "run", counting)
    lib = build.load("rope")  # first opened in this process after the swap: what it loads is the file now
    assert lib is not None and hasattr(lib, "lmf_rope_qk_bf16")
    assert build._build("store_kv", cc) == store and store.read_bytes() != rope_bytes
    assert compiled == [str(build.HERE / "rope.c"), str(build.HERE / "store_kv.c")]
    for damage in (lambda: store.write_bytes(b"\x7fELF garbage"), lambda: build._record(store).unlink()):
        damage()
        compiled.clear()
        assert build._build("store_kv", cc) == store and compiled == [str(build.HERE / "store_kv.c")]
    assert build._build("store_kv", cc) == store and len(compiled) == 1  # intact now: reused
    assert sorted(p.name for p in fresh.iterdir()) == sorted([rope.name, build._record(rope).name, store.name,
                                                              build._record(store).name])


@pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
def test_a_killed_builds_staged_object_is_swept(fresh) -> None:
    dead_pid = int(open("/proc/sys/kernel/pid_max").read()) + 1
    fresh.mkdir(parents=True)
    dead = fresh / f".rope-0123456789abcdef.so.partial-{dead_pid}-0a1b2c"
    dead.write_bytes(b"half an object")
    assert build.load("rope") is not None
    assert not dead.exists() and not [p for p in fresh.iterdir() if ".partial-" in p.name]
