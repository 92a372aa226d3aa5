"""The cache of `--arch cpu` bundles that `serve --compile-step` keeps: one per checkpoint content,
block size, step size, toolchain and CPU path (`step_cache_key`), built on first use by a
`lmfoundry compile --arch cpu` child process (`compile.cpu_step` builds it) and checked against
its key before each use (`cache_mismatch`).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Callable

import torch

from lmfoundry.engine_bundle.engine_manifest import CPU_EMBEDDED_FORMAT, is_engine_bundle
from lmfoundry.errors import UserError
from lmfoundry.manifest import sha256_file

DEFAULT_MAX_TOKENS = 8192  # the compiled step's largest flat batch (--max-num-batched-tokens above it: eager)


def compiler_version() -> str:
    try:
        out = subprocess.run(["c++", "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def checkpoint_content(folder: Path, verified: bool = False) -> dict[str, str]:
    """sha256 of every file of checkpoint `folder` that its `--arch cpu` bundle copies (the regular
    files at its top): what the bundle computes is a function of these bytes, and names, sizes or
    modification times say nothing about them (`cp -p` keeps all three across a changed weight).

    `verified`: the caller has just checked the folder against its lmfoundry.json
    (`verify_artifact`), so the sha256s recorded there are the files' and are taken instead of
    reading gigabytes of weights a second time; otherwise (`--skip-verify`, or a plain Hugging Face
    folder without a manifest) every file is hashed."""
    from lmfoundry.manifest import MANIFEST, content_files, recorded_files
    from lmfoundry.manifest import read_manifest as read_artifact_manifest

    recorded: dict[str, str] = {}
    if verified and os.path.lexists(folder / MANIFEST):
        recorded = recorded_files(read_artifact_manifest(folder), folder / MANIFEST)
    return {p.name: recorded.get(p.name) or sha256_file(p) for p in content_files(folder)}


def step_cache_key(folder: Path, *, block_size: int, max_tokens: int, verified: bool = False) -> dict[str, Any]:
    """Everything the cached `--arch cpu` bundle of `folder` depends on: the checkpoint's content
    (`checkpoint_content`), the block size and step size it was compiled for, the torch and C++
    compiler that compiled it, the CPU path it was compiled for, and the bundle format. The same
    fields are read back from a cached bundle's engine.json (`cache_mismatch`)."""
    from lmfoundry.runtime.cpu.features import isa

    return {"files": checkpoint_content(folder, verified), "block_size": block_size, "max_tokens": max_tokens,
            "isa": isa(), "torch": torch.__version__, "compiler": compiler_version(), "format": CPU_EMBEDDED_FORMAT}


def cache_mismatch(engine: Path, key: dict[str, Any]) -> str | None:
    """None when the bundle at `engine` was built for `key` (`step_cache_key`), else what differs.
    A cache folder is named by the key's digest, but a name proves nothing: a folder copied, swapped
    or restored from another machine's cache would serve another model's weights. Its engine.json
    records the sha256 of every file it copied from its checkpoint (and the loader checks the
    bundle's files against engine.json), so comparing those with the key ties the bundle to this
    checkpoint's content."""
    from lmfoundry.engine_bundle.engine_manifest import read_manifest

    try:
        manifest = read_manifest(engine)
    except UserError as exc:
        return str(exc)
    if manifest.get("target") != "cpu":
        return "not an --arch cpu bundle"
    cpu, toolchain = manifest["cpu"], manifest["toolchain"]
    recorded = {"files": {name: entry.get("sha256") for name, entry in manifest["weights"]["files"].items()},
                "block_size": manifest["kv_cache"]["block_size"], "max_tokens": cpu["max_tokens"],
                "isa": cpu["isa"], "torch": toolchain.get("torch"), "compiler": toolchain.get("compiler"),
                "format": manifest["format"]}
    differ = [field for field, value in key.items() if recorded.get(field) != value]
    return f"its {', '.join(differ)} differ" if differ else None


def cached_cpu_engine(checkpoint: str | Path, *, block_size: int = 16, max_tokens: int = DEFAULT_MAX_TOKENS,
                      log_line: Callable[[str], None] = lambda m: None, verified: bool = False) -> tuple[Path, bool]:
    """The `--arch cpu` bundle of `checkpoint` from the cache, built there on first use; (bundle,
    built now). `serve --compile-step` runs a checkpoint through it: the compiled step is what
    makes the CPU runtime fast, and building it takes minutes, so it is built once per
    `step_cache_key` (the checkpoint's content, block size, step size, torch, compiler, ISA and
    bundle format) and reused. A cached folder is used only if its engine.json says it was built
    for that key (`cache_mismatch`); one that is not (swapped, copied in, half-replaced) is removed
    and built again. `verified`: see `checkpoint_content` (serve passes it when it has verified the
    checkpoint's manifest).

    The build runs in a process of its own (`lmfoundry compile`, its lines on stderr): it loads the
    model and Inductor, and the serving process that asks must not keep either resident. Stages a
    killed build left in the cache are removed first (`lmfoundry.staging`)."""
    from lmfoundry.checkpoint.sources import resolve_model
    from lmfoundry.resources import cache_dir
    from lmfoundry.staging import remove, stage_path, sweep_dead_stages

    folder = resolve_model(checkpoint)
    key = step_cache_key(folder, block_size=block_size, max_tokens=max_tokens, verified=verified)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    engine = cache_dir() / "cpu-steps" / digest
    sweep_dead_stages(engine.parent)
    if os.path.lexists(engine):
        wrong = cache_mismatch(engine, key)
        if wrong is None:
            return engine, False
        log_line(f"{engine}: not the compiled step of {checkpoint} ({wrong}); building it again")
        aside = stage_path(engine)  # a stage name: swept like one if this process dies before removing it
        os.replace(engine, aside)
        remove(aside)
    log_line(f"compiling the CPU step of {checkpoint} once (minutes); it is kept in {engine}")
    build_in_child(folder, engine, block_size, max_tokens)
    wrong = cache_mismatch(engine, key)
    if wrong is not None:
        raise UserError(f"the CPU step built into {engine} is not that of {checkpoint} as it was when the build "
                        f"started ({wrong}); was the checkpoint changed meanwhile? Start again")
    return engine, True


STOP_GRACE_SECONDS = 1.5  # a stopping build's time to remove its stage (serve's engine group gets 2 s)


def build_in_child(folder: Path, engine: Path, block_size: int, max_tokens: int) -> None:
    """`lmfoundry compile FOLDER --arch cpu -o ENGINE` in a child process, its output on stderr; a
    failure is one UserError line (the child printed why above it). If this process is stopped
    meanwhile (SIGTERM, Ctrl-C), the child is sent SIGTERM and given a moment to remove its stage
    before it is killed."""
    from lmfoundry.child_python import child_env, python_command

    cmd = python_command("lmfoundry.cli", "compile", str(folder), "--arch", "cpu", "-o", str(engine),
                         "--block-size", str(block_size), "--max-tokens", str(max_tokens))
    child = subprocess.Popen(cmd, env=child_env(), stdout=2)  # fd 2: this process's stderr
    try:
        code = child.wait()
    except BaseException:
        child.terminate()
        try:
            child.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        raise
    if code != 0 or not is_engine_bundle(engine):
        raise UserError(f"compiling the CPU step of {folder} failed (exit code {code}; its error is printed above)")
