"""The cache of compiled CPU steps (`serve --compile-step`, `runtime.cpu.step_cache.cached_cpu_engine`):
keyed by the checkpoint's content, never by its files' names, sizes or modification times; a
cached folder is used only when its engine.json says it was built from this content (a swapped one
is built again); the stages of builds that were killed are swept, those of live builds kept.

The fast tests replace the minutes-long build by `recording_build`, which writes what a build
records (engine.json with the sha256 of every file copied); the slow one compiles real steps.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_up_to_bf16_ties, copy_with_one_weight_changed, tiny_model_folder

from lmfoundry.compile.cpu_step import STEP_FILE
from lmfoundry.engine_bundle.engine_manifest import CPU_EMBEDDED_FORMAT
from lmfoundry.errors import UserError
from lmfoundry.manifest import MANIFEST, hash_folder, sha256_file
from lmfoundry.runtime.cpu import features as cpu_isa
from lmfoundry.runtime.cpu import step_cache

# a process id above the kernel's maximum: no process has it (a recently exited pid could be reused)
DEAD_PID = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def stats(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("step-cache")
    first = tiny_model_folder(root / "first", "llama")
    return first, copy_with_one_weight_changed(first, root / "second")


def test_the_key_is_the_content_not_names_sizes_or_mtimes(checkpoints, tmp_path) -> None:
    first, second = checkpoints
    assert stats(first) == stats(second)  # what the old key read: equal
    a = step_cache.step_cache_key(first, block_size=16, max_tokens=64)
    b = step_cache.step_cache_key(second, block_size=16, max_tokens=64)
    assert a["files"]["model.safetensors"] == sha256_file(first / "model.safetensors")
    assert [n for n in a["files"] if a["files"][n] != b["files"][n]] == ["model.safetensors"]
    # the same bytes elsewhere are the same key (content, not path); the build's settings are in it
    moved = shutil.copytree(first, tmp_path / "moved")
    assert step_cache.step_cache_key(moved, block_size=16, max_tokens=64) == a
    assert a != step_cache.step_cache_key(first, block_size=32, max_tokens=64)
    assert {"isa", "torch", "compiler", "format"} <= a.keys() and a["format"] == CPU_EMBEDDED_FORMAT


def test_a_verified_manifest_spares_hashing_the_weights_again(checkpoints, tmp_path, monkeypatch) -> None:
    artifact = shutil.copytree(checkpoints[0], tmp_path / "artifact")
    (artifact / MANIFEST).write_text(json.dumps({"files": hash_folder(artifact)}))
    hashed = step_cache.checkpoint_content(artifact)
    read = []
    real = step_cache.sha256_file
    monkeypatch.setattr(step_cache, "sha256_file", lambda p: read.append(Path(p).name) or real(p))
    assert step_cache.checkpoint_content(artifact, verified=True) == hashed
    assert read == [MANIFEST]  # only the manifest itself, which lists the others
    read.clear()
    step_cache.checkpoint_content(artifact)  # not verified (serve --skip-verify): every file is read
    assert sorted(read) == sorted(p.name for p in artifact.iterdir())


def recording_build(calls: list[Path], source_of: dict[Path, Path] | None = None):
    """A stand-in for `build_in_child`: the bundle a build writes (the checkpoint's files copied,
    their sha256 in engine.json), without the step compiled. `source_of` builds from another
    folder than asked (a checkpoint changed while it was built)."""

    def build(folder: Path, engine: Path, block_size: int, max_tokens: int) -> None:
        calls.append(folder)
        folder = (source_of or {}).get(folder, folder)
        (engine / "weights").mkdir(parents=True)
        files = {}
        for p in sorted(folder.iterdir()):
            if p.is_file():
                shutil.copy2(p, engine / "weights" / p.name)
                files[p.name] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        step = Path("cpu") / cpu_isa.isa() / STEP_FILE
        (engine / step).parent.mkdir(parents=True)
        (engine / step).write_bytes(b"step")
        manifest = {
            "format": CPU_EMBEDDED_FORMAT, "target": "cpu",
            "model": {"model_type": "llama", "dtype": "bfloat16"},
            "kv_cache": {"dtype": "auto", "block_size": block_size}, "archs": {},
            "cpu": {"isa": cpu_isa.isa(), "features": [], "max_tokens": max_tokens, "torch": torch.__version__,
                    "step": {"path": step.as_posix(), "sha256": sha256_file(engine / step), "inputs": "embeddings"}},
            "toolchain": {"torch": torch.__version__, "compiler": step_cache.compiler_version()},
            "fusions": [], "weights": {"mode": "copy", "files": files}, "kernels": [],
        }
        (engine / "engine.json").write_text(json.dumps(manifest))

    return build


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "cpu-steps"


def test_a_changed_copy_gets_its_own_step_and_a_swapped_folder_is_built_again(checkpoints, cache,
                                                                               monkeypatch) -> None:
    first, second = checkpoints
    calls: list[Path] = []
    monkeypatch.setattr(step_cache, "build_in_child", recording_build(calls))
    lines: list[str] = []
    a, built = step_cache.cached_cpu_engine(first, max_tokens=64, log_line=lines.append)
    assert built and a.parent == cache
    assert step_cache.cached_cpu_engine(first, max_tokens=64) == (a, False)  # reused
    b, built = step_cache.cached_cpu_engine(second, max_tokens=64)
    assert built and b != a and calls == [first, second]
    assert (b / "weights" / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()

    # the two cache folders swapped with each other: neither is served for the other's checkpoint
    os.replace(a, cache / "aside")
    os.replace(b, a)
    os.replace(cache / "aside", b)
    lines.clear()
    assert step_cache.cached_cpu_engine(first, max_tokens=64, log_line=lines.append) == (a, True)
    assert "not the compiled step of" in lines[0] and "files differ" in lines[0]
    assert (a / "weights" / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    assert calls == [first, second, first] and sorted(p.name for p in cache.iterdir()) == sorted([a.name, b.name])

    # a folder that is no --arch cpu bundle of anything (a broken engine.json) is built again too
    (b / "engine.json").write_text("{")
    assert step_cache.cached_cpu_engine(second, max_tokens=64) == (b, True)
    assert step_cache.cache_mismatch(b, step_cache.step_cache_key(second, block_size=16, max_tokens=64)) is None


def test_a_checkpoint_changed_during_its_build_is_one_line(checkpoints, cache, monkeypatch) -> None:
    first, second = checkpoints
    monkeypatch.setattr(step_cache, "build_in_child", recording_build([], source_of={first: second}))
    with pytest.raises(UserError, match="was the checkpoint changed meanwhile") as err:
        step_cache.cached_cpu_engine(first, max_tokens=64)
    assert "\n" not in str(err.value) and "its files differ" in str(err.value)


def test_stages_of_dead_builds_are_swept_and_live_ones_kept(checkpoints, cache, monkeypatch) -> None:
    monkeypatch.setattr(step_cache, "build_in_child", recording_build([]))
    cache.mkdir(parents=True)
    dead = cache / f".0123abcd.partial-{DEAD_PID}-9f8e7d6c"
    (dead / "cpu").mkdir(parents=True)
    (dead / "cpu" / "step.pt2").write_bytes(b"half a package")
    live = cache / f".4567cdef.partial-{os.getppid()}-0a1b2c3d"  # a running process: our parent
    live.mkdir()
    other = cache / ".notes"
    other.mkdir()
    engine, _ = step_cache.cached_cpu_engine(checkpoints[0], max_tokens=64)
    assert not dead.exists() and live.is_dir() and other.is_dir()
    # a later start that finds its bundle in place sweeps too
    dead.mkdir()
    assert step_cache.cached_cpu_engine(checkpoints[0], max_tokens=64) == (engine, False)
    assert not dead.exists() and live.is_dir()


@pytest.mark.slow
@pytest.mark.skipif(not cpu_isa.native_bf16(), reason="--arch cpu compiles the bf16 step")
def test_a_changed_copy_is_compiled_and_served_as_itself(checkpoints, cache) -> None:
    """Real builds: the `cp -p` copy with one changed weight gets a step of its own, and that step
    serves the copy's tokens, not those of the checkpoint compiled first."""
    from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
    from lmfoundry.runtime.loader import load_model

    prompts = [[1, 5, 9, 200, 17], [1, 3] * 7]

    def greedy(model, tokenizer):
        engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8))
        return engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))

    first, second = checkpoints
    a, built_a = step_cache.cached_cpu_engine(first, max_tokens=64)
    b, built_b = step_cache.cached_cpu_engine(second, max_tokens=64)
    assert built_a and built_b and a != b
    served, tok = load_model(b)
    got = [o.outputs[0].token_ids for o in greedy(served, tok)]
    reference, _ = load_model(second, dtype=torch.bfloat16)
    assert_greedy_up_to_bf16_ties(reference, got, greedy(reference, tok))
    other, _ = load_model(first, dtype=torch.bfloat16)
    assert got != [o.outputs[0].token_ids for o in greedy(other, tok)]  # the change shows in the tokens
