"""Build an engine bundle: select the kernels, cross-compile in worker processes, check the SASS, write files.

Bundle layout:
    engine.json                         manifest: kernels + sha256, archs, toolchain, fusions, source
    weights/                            the checkpoint's files (symlinked, copied, or repacked)
    kernels/<sm>/<key>.cubin|.ptx|.json one compiled specialization and its launch metadata

With `tp` N > 1 (`compile --tp N`), one such bundle per tensor-parallel rank, for the shapes of
that rank's share (`lmfoundry.compile.rank_shares`), under a manifest naming them:
    engine.json                         manifest: source, degree, each rank's engine.json sha256
    rank<r>/                            rank r's bundle, as above

The bundle is written into a hidden sibling folder (`.ENGINE.partial-PID-RANDOM`) and moved into
place once complete: a build that is refused, fails or is interrupted (Ctrl-C, SIGTERM) leaves
neither a half-written bundle nor a damaged old one. A build killed outright (SIGKILL) leaves its
stage; the next build of the same output removes it (`lmfoundry.staging`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from lmfoundry.compile import sass
from lmfoundry.compile.aot import run_jobs
from lmfoundry.compile.kernel_selection import KernelBuild, select_kernels
from lmfoundry.compile.rank_shares import write_share
from lmfoundry.compile.source import Checkpoint, load_checkpoint
from lmfoundry.engine_bundle.engine_manifest import (
    BUILT_FOLDERS,
    ENGINE_FORMAT,
    KERNELS_FOLDER,
    MANIFEST_NAME,
    holds_lmfoundry_bundle,
    is_rank_folder,
    own_weights,
    rank_folder,
    write_manifest,
)
from lmfoundry.errors import UserError
from lmfoundry.gpus import ARCH_OF_CAPABILITY, SM_NAME, parse_compile_arch
from lmfoundry.manifest import content_files, sha256_file, verify_artifact
from lmfoundry.model.tensor_parallel import RankShard
from lmfoundry.staging import sigterm_raises, stage_path, sweep_dead_stages

WEIGHT_MODES = ("link", "copy", "repack")


def default_output(checkpoint: Path) -> Path:
    """CHECKPOINT-engine next to the checkpoint (beside its real folder when named through links)."""
    from lmfoundry.output_paths import resolved

    checkpoint = resolved(checkpoint)
    return checkpoint.parent / f"{checkpoint.name}-engine"


@dataclass
class BuildResult:
    output: Path
    manifest: dict[str, Any]
    seconds: float
    ranks: list[BuildResult] = field(default_factory=list)  # a tensor-parallel bundle's per-rank bundles

    @property
    def kernels(self) -> list[dict[str, Any]]:
        if self.ranks:
            return [k for r in self.ranks for k in r.kernels]
        return self.manifest["kernels"]

    @property
    def fusions(self) -> list[dict[str, Any]]:
        return self.ranks[0].manifest["fusions"] if self.ranks else self.manifest["fusions"]


def _check_output(out: Path, checkpoint: Path) -> None:
    """Refuse an -o that cannot receive the engine, before any work (nothing is created here):
    one that is, lies inside, holds or links into the checkpoint, or a folder of other files."""
    from lmfoundry.output_paths import refuse_overlap

    refuse_overlap(out, [checkpoint])
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise UserError(f"{out}: exists and is not a folder")
        if any(out.iterdir()) and not holds_lmfoundry_bundle(out):  # only ours may be rebuilt in place
            raise UserError(f"{out}: exists, is not empty and is not an engine bundle; choose another -o")


def _remove_dirs(created: list[Path]) -> None:
    for d in created:  # deepest first
        try:
            d.rmdir()
        except OSError:
            pass


def _staging(out: Path) -> tuple[Path, list[Path]]:
    """A fresh hidden sibling of `out` to build the bundle in (same filesystem, so the finished
    bundle is moved into place by rename), and the ancestors of `out` created for it (removed again
    if the build fails). A build that fails or is interrupted leaves no half-written bundle."""
    created = []
    real = out.resolve()  # next to the real folder when -o is a symlink: renames stay on one filesystem
    parent = real.parent
    while not parent.exists() and parent != parent.parent:
        created.append(parent)
        parent = parent.parent
    stage = stage_path(real)
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
        sweep_dead_stages(real.parent, real.name)  # stages of this output whose build was killed
        stage.mkdir()
    except OSError as exc:
        _remove_dirs(created)
        raise UserError(f"{out}: cannot write the engine there ({exc.strerror or exc})") from None
    return stage, created


def _install(stage: Path, out: Path) -> None:
    """Move the finished bundle from `stage` to `out`. A new `out` is one rename; an existing bundle
    (or empty folder) keeps any other files the user put there and gets its kernels/, weights/ and
    engine.json replaced, engine.json removed first and written last so that no reader sees a
    manifest next to files it does not describe."""
    if not out.exists():
        os.replace(stage, out)
        return
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    ranks = {p.name for folder in (out, stage) for p in folder.iterdir() if is_rank_folder(p.name)}
    for sub in (*BUILT_FOLDERS, *sorted(ranks)):
        if (out / sub).is_symlink() or (out / sub).is_file():
            (out / sub).unlink()
        elif (out / sub).exists():
            shutil.rmtree(out / sub)
        if (stage / sub).exists():
            os.replace(stage / sub, out / sub)
    os.replace(stage / MANIFEST_NAME, out / MANIFEST_NAME)
    shutil.rmtree(stage, ignore_errors=True)


def _keep_log(log_path: Path) -> Path:
    """Move a failed build's compile.log out of the staging folder (which is removed) to a temp
    file the error message can point to."""
    fd, kept = tempfile.mkstemp(prefix="lmfoundry-compile-", suffix=".log")
    os.close(fd)
    shutil.move(str(log_path), kept)
    return Path(kept)


def _place_weights(ck: Checkpoint, build: KernelBuild, out: Path, mode: str) -> dict[str, Any]:
    dst = own_weights(out)
    dst.mkdir()
    files = content_files(ck.path)
    record: dict[str, Any] = {"mode": mode, "files": {}}
    if mode == "repack" and ck.has_weights():
        from lmfoundry.compile.repack import repack

        record["fused_tensors"] = repack(ck, build, dst / "model.safetensors")
        files = [p for p in files if p.suffix != ".safetensors" and p.name != "model.safetensors.index.json"]
        record["files"]["model.safetensors"] = {"bytes": (dst / "model.safetensors").stat().st_size,
                                                "sha256": sha256_file(dst / "model.safetensors")}
    record["files"].update(place_files(files, dst, mode))
    return record


def place_files(files: list[Path], dst: Path, mode: str) -> dict[str, dict[str, Any]]:
    """Copy (or, mode "link", symlink) `files` into `dst`: engine.json's weights.files entries."""
    record: dict[str, dict[str, Any]] = {}
    for src in files:
        target = dst / src.name
        if mode == "link":
            os.symlink(src.resolve(), target)
            record[src.name] = {"bytes": src.stat().st_size, "link": str(src.resolve()), "sha256": sha256_file(src)}
        else:
            shutil.copy2(src, target)
            record[src.name] = {"bytes": target.stat().st_size, "sha256": sha256_file(target)}
    return record


def build_engine(
    checkpoint: str | Path,
    archs: list[str],
    output: str | Path | None = None,
    *,
    weights: str = "repack",
    workers: int = 2,
    block_size: int = 16,
    dtype: str | None = None,
    tune: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = lambda msg: None,
    tp: int = 1,
    lora: tuple[int, int] | None = None,
) -> BuildResult:
    """Compile every kernel `checkpoint` needs for `archs` into an engine bundle at `output`;
    with `tp` > 1, one bundle per tensor-parallel rank, each for its own share's shapes; with
    `lora` (max adapters, max rank), the LoRA kernels for serving that many adapters."""
    t0 = time.perf_counter()
    if not archs:
        raise UserError("name at least one --arch (ampere, ada, hopper)")
    if weights not in WEIGHT_MODES:
        raise UserError(f"--weights must be one of {', '.join(WEIGHT_MODES)}")
    caps = list(dict.fromkeys(parse_compile_arch(a) for a in archs))
    src = Path(checkpoint)
    final = Path(output) if output is not None else default_output(src)
    _check_output(final, src)  # before any work; nothing is created until the checks below pass
    if src.is_dir():
        verify_artifact(src, "compile")  # before any tensor is read: the bundle records what it reads as good
    ck = load_checkpoint(src, dtype)
    build = None
    if lora is not None and tp > 1:
        raise UserError("LoRA kernels with --tp are not implemented; compile the adapters' bundle for one device")
    if tp > 1:
        RankShard(ck.config, 0, tp).heads  # noqa: B018 - refuses a degree the heads or MLP width do not split into
        if weights == "link":
            raise UserError(f"--weights link with --tp {tp}: each rank's share is written anew, there is nothing "
                            "to link to; use repack or copy")
    else:
        build = _select(ck, caps, block_size, tune, log, lora)
    with sigterm_raises():  # a SIGTERM'd build removes its stage below like a failed one
        stage, created = _staging(final)
        try:
            if build is None:
                built = _write_tp_bundle(stage, ck, caps, src, tp, dtype, block_size, weights, workers, tune,
                                         progress, log, t0)
            else:
                built = _write_bundle(stage, ck, build, caps, src, weights, workers, tune, progress, log, t0)
            _install(stage, final)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            _remove_dirs(created)
            raise
    ranks = [BuildResult(final / rank_folder(i), r.manifest, r.seconds) for i, r in enumerate(built.ranks)]
    return BuildResult(final, built.manifest, time.perf_counter() - t0, ranks)


def _select(ck: Checkpoint, caps: list[int], block_size: int, tune: bool, log: Callable[[str], None],
          lora: tuple[int, int] | None = None) -> KernelBuild:
    build = select_kernels(ck, caps, block_size, lora)
    if tune:
        from lmfoundry.compile.tune import tune_build

        tune_build(build, log)
    return build


def source_record(src: Path) -> dict[str, Any]:
    """What a bundle was compiled from, named by content rather than by where it lay: the folder's
    name and the sha256 of its config and manifest (whose sha256s cover every weight). An absolute
    path would leak the builder's file system into a shipped bundle and make two builds of the same
    checkpoint differ."""
    from lmfoundry.manifest import MANIFEST

    manifest = src / MANIFEST
    return {"name": src.resolve().name, "config_sha256": sha256_file(src / "config.json"),
            **({"manifest_sha256": sha256_file(manifest)} if manifest.is_file() else {})}


def _source_record(src: Path, ck: Checkpoint) -> dict[str, Any]:
    return {**source_record(src), "quantization_format": ck.quant_format}


def _write_tp_bundle(out: Path, ck: Checkpoint, caps: list[int], src: Path, tp: int, dtype: str | None,
                     block_size: int, weights: str, workers: int, tune: bool, progress: bool,
                     log: Callable[[str], None], t0: float) -> BuildResult:
    """Each rank's share of `src` written, planned and compiled into out/rank<r>, then the
    manifest naming them. The ranks share one Triton cache: equal shapes compile once."""
    shares = out / ".shares"
    ranks: list[BuildResult] = []
    with tempfile.TemporaryDirectory(prefix="lmfoundry-triton-") as cache:
        for rank in range(tp):
            log(f"rank {rank} of {tp}: writing its share")
            share = write_share(src, RankShard(ck.config, rank, tp), shares / rank_folder(rank))
            rck = load_checkpoint(share, dtype)
            build = _select(rck, caps, block_size, tune, log)
            (out / rank_folder(rank)).mkdir()
            source = {**_source_record(src, ck), "tensor_parallel": {"rank": rank, "size": tp}}
            ranks.append(_write_bundle(out / rank_folder(rank), rck, build, caps, share, weights, workers, tune, progress,
                                       log, t0, triton_cache=Path(cache), source=source))
            shutil.rmtree(share)
    shares.rmdir()
    manifest = {
        "format": ENGINE_FORMAT,
        "source": _source_record(src, ck),
        "tensor_parallel": {"size": tp, "ranks": [
            {"path": rank_folder(rank), "engine_sha256": sha256_file(out / rank_folder(rank) / MANIFEST_NAME)}
            for rank in range(tp)]},
        "archs": ranks[0].manifest["archs"],
        "build": {"seconds": round(time.perf_counter() - t0, 2), "workers": workers, "tuned": tune},
    }
    write_manifest(out, manifest)
    return BuildResult(out, manifest, time.perf_counter() - t0, ranks)


def _write_bundle(out: Path, ck: Checkpoint, build: KernelBuild, caps: list[int], src: Path, weights: str, workers: int,
                  tune: bool, progress: bool, log: Callable[[str], None], t0: float,
                  triton_cache: Path | None = None, source: dict[str, Any] | None = None) -> BuildResult:
    """Compile the kernels and write the whole bundle into `out` (a fresh staging folder).
    `triton_cache`: a Triton cache folder to reuse (default: a fresh one); `source`: the
    manifest's source record (default: `src`'s)."""
    jobs = [spec.job(i, str(out / KERNELS_FOLDER / spec.sm)) for i, spec in enumerate(build.specs)]
    log(f"{len(jobs)} kernel specializations for {', '.join(SM_NAME[c] for c in caps)}")
    if ck.config.kernel_context_limit < ck.config.max_position_embeddings:
        log(f"note: {ck.config.model_type} attends through a sliding window of {ck.config.kernel_context_limit} "
            f"tokens; the kernels attend causally over everything, so the bundle serves contexts up to "
            f"{ck.config.kernel_context_limit} tokens (the checkpoint folder serves the full "
            f"{ck.config.max_position_embeddings})")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="compile", unit="kernel", leave=False)
    with tempfile.TemporaryDirectory(prefix="lmfoundry-triton-") as cache:
        try:
            replies = run_jobs(jobs, workers, (triton_cache or Path(cache)) / "triton", out / "compile.log",
                               on_done=(lambda r: bar.update(1)) if bar is not None else (lambda r: None))
        finally:
            if bar is not None:
                bar.close()
    failed = [(j, r) for j, r in zip(jobs, replies, strict=True) if not r.get("ok")]
    if failed:
        j, r = failed[0]
        kept = _keep_log(out / "compile.log")
        raise UserError(f"{len(failed)} kernels failed to compile; first: {j['kernel']} for {j['sm']}: "
                        f"{(r.get('error') or '?').splitlines()[0]} (details: {kept})", exit_code=3)
    for spec, reply in zip(build.specs, replies, strict=True):
        sass.check(spec.kernel, spec.sm, spec.expected_sass(), reply["mma"])
        use = reply["resources"]
        if use["stack_bytes"] or use["local_bytes"]:  # correct but slow: name the tile (--tune may pick another)
            log(f"warning: {spec.kernel} for {spec.sm} spills registers ({use['stack_bytes'] + use['local_bytes']} "
                f"bytes of stack/local memory per thread at {use['registers']} registers; tiles "
                f"{spec.config.as_dict()})")
    (out / "compile.log").unlink(missing_ok=True)

    kernels = []
    for spec, _job, reply in zip(build.specs, jobs, replies, strict=True):
        rel = Path(KERNELS_FOLDER) / spec.sm / spec.key()
        files = {ext: str(rel.with_suffix(f".{ext}")) for ext in ("cubin", "ptx", "json")}
        kernels.append({
            "key": spec.key(),
            "kernel": spec.kernel,
            "arch": ARCH_OF_CAPABILITY[spec.capability],
            "sm": spec.sm,
            "capability": spec.capability,
            "types": spec.types,
            "semantics": spec.semantics,
            "config": spec.config.as_dict(),
            "aligned": spec.aligned,
            "covers": spec.covers,
            "files": files,
            "sha256": {ext: sha256_file(out / f) for ext, f in files.items()},
            "sass": {"mma": reply["mma"], "expected_any_of": list(spec.expected_sass()), **reply["resources"]},
            "shared": reply["shared"],
            "num_warps": reply["num_warps"],
            "triton": reply["versions"]["triton"],
            "ptxas": reply["versions"]["ptxas"],
        })
    versions = replies[0]["versions"] if replies else {}
    cfg = ck.config
    manifest = {
        "format": ENGINE_FORMAT,
        "source": source or _source_record(src, ck),
        "model": {"model_type": cfg.model_type, "dtype": build.dtype, "hidden_size": cfg.hidden_size,
                  "intermediate_size": cfg.intermediate_size, "num_layers": cfg.num_layers,
                  "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                  "vocab_size": cfg.vocab_size,
                  # plain causal kernels equal a sliding-window model's attention only this far
                  "context_limit": cfg.kernel_context_limit},
        "linears": {g.name: {"n": g.n, "k": g.k, "scheme": g.scheme.describe(), "kind": g.scheme.kind,
                             "bias": g.bias} for g in build.gemms},
        "kv_cache": {"dtype": ck.kv.dtype, "kernel_type": build.kv_dtype, "block_size": build.block_size,
                     "strategy": ck.kv.strategy},
        "archs": {ARCH_OF_CAPABILITY[c]: {"capability": c, "sm": SM_NAME[c]} for c in caps},
        "toolchain": {"triton": versions.get("triton"), "ptxas": versions.get("ptxas"), "cuda": versions.get("cuda"),
                      "line_info": False},
        "fusions": [f.as_dict() for f in build.fusions],
        "weights": _place_weights(ck, build, out, weights),
        "kernels": kernels,
        "build": {"seconds": round(time.perf_counter() - t0, 2), "workers": workers, "tuned": tune},
    }
    if build.lora is not None:  # only then: a bundle without adapters stays byte for byte what it was
        manifest["lora"] = build.lora
    write_manifest(out, manifest)
    return BuildResult(out, manifest, time.perf_counter() - t0)
